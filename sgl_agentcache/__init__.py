"""sgl_agentcache: an agent-lifecycle-aware RadixAttention prefix cache for SGLang.

Importing this package is cheap: it imports neither torch nor sglang. The SGLang-coupled parts live in
:mod:`sgl_agentcache.server` and are imported only inside SGLang processes (through the plugin entry
point) or by code that asks for them.
"""

__version__ = "0.1.0"

#: The SGLang release whose internals the server adapter is written against (see ``server/pins.py``).
SGLANG_VERSION = "0.5.23"

#: Name of the radix-cache backend and tree-core backend we register (``--radix-cache-backend agentcache``).
BACKEND_NAME = "agentcache"
