"""Retained store keys: blocks an agent session needs again, kept against capacity pressure.

An agent's next turn comes back after its tool has run, often minutes later, and needs every
block its earlier turns wrote or read. Plain LRU may evict them meanwhile: other sessions'
writes push them out. A decode engine therefore marks a session request's blocks retained for
the session's retention time (``KVStore.retain``, from ``Assignment.session_retention_s``):
their hit blocks when the request is assigned, and every block it read or wrote again when it
finishes, so the time runs from the session's last turn and each turn extends it.

The store's eviction (``LruIndex.evict_over_capacity``) passes over keys whose mark has not
expired, unless nothing else is left to evict: then the least recently used retained blocks go
too, counted (``StoreStats.retained_evictions``). Capacity stays a hard bound.

A mark may precede its block (a block the engine has queued for writing) and outlive it (a
block another process deleted): marks are by key, not by index entry. The bookkeeping is
bounded: at most ``max_num_keys`` marks (the store's capacity in blocks: more could not all be
kept), kept in the order they were last set; a full table drops its earliest first. Every mark
is set ``retention_s`` after "now", and one server uses one retention time, so that order is
also deadline order: expired marks sit at the front and are dropped from there.

    marks = RetainedKeys(max_num_keys=1024)
    marks.retain(keys, until_s=now_s + 300.0)
    marks.is_retained(key, now_s)   # False once now_s >= until_s
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class RetainedKeys:
    """Key -> the time (the store's clock, seconds) until which it is retained. Not
    thread-safe by itself (its store's lock guards it)."""

    def __init__(self, max_num_keys: int) -> None:
        if max_num_keys <= 0:
            raise ValueError(f"max_num_keys must be > 0, got {max_num_keys}")
        self.max_num_keys = max_num_keys
        self._key_to_until_s: OrderedDict[str, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._key_to_until_s)

    def retain(self, keys: Iterable[str], until_s: float) -> None:
        """Retain ``keys`` until ``until_s``; a later mark already set is kept (a mark only
        ever grows). Each key becomes the last set."""
        marks = self._key_to_until_s
        for key in keys:
            marks[key] = max(until_s, marks.pop(key, until_s))
        while len(marks) > self.max_num_keys:
            marks.popitem(last=False)

    def is_retained(self, key: str, now_s: float) -> bool:
        """Whether ``key``'s mark lasts beyond ``now_s``; an expired mark is dropped."""
        until_s = self._key_to_until_s.get(key)
        if until_s is None:
            return False
        if until_s > now_s:
            return True
        del self._key_to_until_s[key]
        return False

    def expire(self, now_s: float) -> None:
        """Drop the expired marks at the front (the earliest set: module docstring)."""
        marks = self._key_to_until_s
        while marks:
            key, until_s = next(iter(marks.items()))
            if until_s > now_s:
                return
            del marks[key]

    def discard(self, key: str) -> None:
        self._key_to_until_s.pop(key, None)
