"""A process-wide cache of branch views, shared by every server thread.

A trainer or dashboard looks the same branches up again and again; building a 32k-token
view costs a few DuckDB queries, serving a cached one only its encoding. Entries are
whole traces (all columns, as ``db.branches(trace_ids=[id])`` returns them), keyed by
credit set and ``train_once``, least recently used out first once ``max_tokens`` is
passed. Any write moves the backend's generation on and empties the cache, so a
cached view is never staler than the last commit it was built after.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

import pyarrow as pa
import pyarrow.compute as pc

from tracedb.database import Database


class ViewCache:
    """LRU of per-trace branch tables, bounded by their total token count."""

    def __init__(self, max_tokens: int, generation: Callable[[], int]) -> None:
        self.max_tokens = max_tokens
        self._generation = generation
        self._seen = generation()
        self._entries: OrderedDict[tuple, tuple[pa.Table, int]] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def branches(self, db: Database, trace_id: str, credit: str | None, train_once: bool) -> pa.Table:
        """Every branch of one trace, all columns; from the cache when it holds them."""
        key = (trace_id, credit, train_once)
        generation = self._generation()
        with self._lock:
            if generation != self._seen:  # something was written: nothing cached is current
                self._entries.clear()
                self._tokens, self._seen = 0, generation
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return entry[0]
            self.misses += 1
        table = db.branches(trace_ids=[trace_id], credit=credit, train_once=train_once)
        tokens = int(pc.sum(pc.list_value_length(table.column("token_ids"))).as_py() or 0)
        if 0 < tokens <= self.max_tokens:
            with self._lock:
                if generation == self._seen and key not in self._entries:
                    self._entries[key] = (table, tokens)
                    self._tokens += tokens
                    while self._tokens > self.max_tokens:
                        _, (_, dropped) = self._entries.popitem(last=False)
                        self._tokens -= dropped
        return table
