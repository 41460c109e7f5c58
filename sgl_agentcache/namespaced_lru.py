"""A bounded LRU map whose keys belong to namespaces (tenants), so that one namespace's flood cannot
evict another's entries (pure: no SGLang, no clock, deterministic).

Two bounds:

- ``namespace_limit``: a namespace holds at most this many entries; its own least recently used go.
- ``limit``: all namespaces together. Over it, the least recently used entry of the *largest*
  namespace goes: a namespace within its fair share (``limit`` / the number of namespaces at the
  bound) is never touched by another's growth.

``retained(key)`` (optional) marks entries that must not be forgotten while it holds (a branch that still
owns tokens). They are passed over -- moved to their namespace's most recent end -- and the map may stay
over its bounds by them; each eviction looks at no more than :data:`SCAN` entries, so a namespace of
retained entries costs O(1) per insert, not a walk over all of them.

The largest namespace is found in O(1): namespaces are bucketed by size (sizes move by one per insert or
removal).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from operator import itemgetter
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

#: Entries an eviction looks at before giving up (all retained): bounds the cost of one insert.
SCAN = 64


class NamespacedLRU(Generic[K, V]):
    """Key -> value, least recently used first within each namespace (see the module docstring)."""

    def __init__(self, limit: int, namespace_limit: int | None = None, *,
                 namespace_of: Callable[[K], Hashable] = itemgetter(0),
                 retained: Callable[[K], bool] | None = None):
        if limit < 1 or (namespace_limit is not None and namespace_limit < 1):
            raise ValueError("NamespacedLRU limits must be >= 1")
        self.limit = limit
        self.namespace_limit = min(namespace_limit or limit, limit)
        self.namespace_of = namespace_of
        self.retained = retained
        self.forgotten = 0  # entries evicted by a bound (not removed by pop)
        self._groups: dict[Hashable, OrderedDict[K, V]] = {}
        self._size = 0
        self._by_size: dict[int, dict[Hashable, None]] = {}  # size -> namespaces of that size (ordered)
        self._largest = 0

    # ---- reads ----

    def get(self, key: K, default=None):
        """The value of ``key`` (not marked used), or ``default``."""
        group = self._groups.get(self.namespace_of(key))
        return default if group is None else group.get(key, default)

    def __getitem__(self, key: K) -> V:
        """The value of ``key`` (not marked used); ``KeyError`` when absent."""
        group = self._groups.get(self.namespace_of(key))
        if group is None or key not in group:
            raise KeyError(key)
        return group[key]

    def __contains__(self, key: object) -> bool:
        try:
            group = self._groups.get(self.namespace_of(key))  # type: ignore[arg-type]
        except (TypeError, IndexError, KeyError, AttributeError):  # not a key at all (None): absent
            return False
        return group is not None and key in group

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[K]:
        """Every key (a snapshot), namespace by namespace, least recently used first within each."""
        return iter([key for group in self._groups.values() for key in group])

    def items(self) -> list[tuple[K, V]]:
        return [item for group in self._groups.values() for item in group.items()]

    def namespace_items(self, namespace: Hashable) -> list[tuple[K, V]]:
        return list(self._groups.get(namespace, {}).items())

    def namespace_size(self, namespace: Hashable) -> int:
        return len(self._groups.get(namespace, ()))

    # ---- writes ----

    def touch(self, key: K) -> None:
        """Mark ``key`` most recently used (it must be present)."""
        self._groups[self.namespace_of(key)].move_to_end(key)

    def put(self, key: K, value: V, *, bound: bool = True) -> list[tuple[K, V]]:
        """Set ``key`` (most recently used now); returns what the bounds evicted, oldest first. The key
        just put is never among them. With ``bound=False`` a new key may leave the map over its
        bounds until :meth:`enforce` (an entry that may still be taken back)."""
        namespace = self.namespace_of(key)
        group = self._groups.get(namespace)
        if group is None:
            group = self._groups[namespace] = OrderedDict()
        elif key in group:
            group[key] = value
            group.move_to_end(key)
            return []
        group[key] = value
        self._size += 1
        self._resized(namespace, len(group) - 1, len(group))
        return self.enforce(key) if bound else []

    def enforce(self, key: K) -> list[tuple[K, V]]:
        """Bring the map within its bounds again, never evicting ``key``: first ``key``'s namespace
        within its own bound, then the largest namespaces within the total. Returns what went."""
        namespace = self.namespace_of(key)
        evicted: list[tuple[K, V]] = []
        while len(self._groups.get(namespace, ())) > self.namespace_limit:
            if not self._evict_from(namespace, evicted, keep=key):
                break
        while self._size > self.limit:
            if not self._evict_from(next(iter(self._by_size[self._largest])), evicted, keep=key):
                break  # the largest namespace holds only retained entries (within a scan): stay over
        return evicted

    def pop(self, key: K, default=None):
        """Remove ``key``; its value, or ``default``."""
        namespace = self.namespace_of(key)
        group = self._groups.get(namespace)
        if group is None or key not in group:
            return default
        value = group.pop(key)
        self._removed(namespace, group)
        return value

    def pop_namespace(self, namespace: Hashable) -> list[tuple[K, V]]:
        """Remove every entry of ``namespace``; returns them."""
        group = self._groups.pop(namespace, None)
        if not group:
            return []
        self._size -= len(group)
        self._resized(namespace, len(group), 0)
        return list(group.items())

    # ---- internals ----

    def _evict_from(self, namespace: Hashable, evicted: list, keep: K) -> bool:
        group = self._groups[namespace]
        for _ in range(min(SCAN, len(group))):
            key = next(iter(group))
            if key == keep or (self.retained is not None and self.retained(key)):
                group.move_to_end(key)
                continue
            evicted.append((key, group.pop(key)))
            self.forgotten += 1
            self._removed(namespace, group)
            return True
        return False

    def _removed(self, namespace: Hashable, group: OrderedDict) -> None:
        self._size -= 1
        self._resized(namespace, len(group) + 1, len(group))
        if not group:
            del self._groups[namespace]

    def _resized(self, namespace: Hashable, old: int, new: int) -> None:
        if old:
            bucket = self._by_size[old]
            del bucket[namespace]
            if not bucket:
                del self._by_size[old]
        if new:
            self._by_size.setdefault(new, {})[namespace] = None
        if new > self._largest:
            self._largest = new
        while self._largest and self._largest not in self._by_size:
            self._largest -= 1
