"""The last micro-batch plans a server built (``GET /micro-batches``): each rank of a
training step asks for its part of the same plan, which is built once."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable

from tracedb.batches import Plan


class PlanCache:
    """The last ``size`` micro-batch plans by their arguments: the ranks of a step each
    ask for their part of one plan, which is built once (the others wait for it)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._entries: OrderedDict[Hashable, Plan] = OrderedDict()
        self._building: dict[Hashable, threading.Lock] = {}
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, key: Hashable, build: Callable[[], Plan]) -> Plan:
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                self.hits += 1
                return self._entries[key]
            building = self._building.setdefault(key, threading.Lock())
        with building:
            with self._lock:
                if key in self._entries:
                    self.hits += 1
                    return self._entries[key]
                self.misses += 1
            try:
                plan = build()
                with self._lock:
                    self._entries[key] = plan
                    while len(self._entries) > self.size:
                        self._entries.popitem(last=False)
            finally:
                with self._lock:
                    self._building.pop(key, None)
        return plan
