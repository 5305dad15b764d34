"""What a thread-safe queue holds now, taken without waiting (one consumer's side).

for state in drain(self._submissions): ...
"""

from __future__ import annotations

import queue
from typing import TypeVar

T = TypeVar("T")


def drain(items: queue.SimpleQueue[T]) -> list[T]:
    """Every item ``items`` holds now, oldest first; what other threads put meanwhile may be
    among them or wait for the next call."""
    drained = []
    while True:
        try:
            drained.append(items.get_nowait())
        except queue.Empty:
            return drained
