"""Sources of the CPU shims that ``sgl-agentcache cpu-setup`` copies into a CPU environment's site-packages.

Never imported from here: ``_tv_cpu_shim`` and ``sgl_kernel`` only work as top-level modules of the
environment they were installed into (see :mod:`sgl_agentcache.cpu_setup`).
"""
