"""Branch views of a lake, computed in Ray workers by the file store's own view code.

The driver resolves the selection (the visible ``traces`` rows it takes, with their
:data:`~tracedb.lake.catalog.BATCH`: :func:`tracedb.lake.select.resolve_rows`) and cuts it
into tasks in the order of the traces' ``trace_id`` hash bucket, then trace id
(:func:`tracedb.lake.scan.bucket_order`), so that a task reads the files of a few
buckets, and in them the row groups of its traces. A view task reads its traces' nodes,
branches and segments straight from the lake's files as Arrow
(:func:`tracedb.lake.columns.visible_columns`: a trace's segments are stored in its own
bucket) and runs the file store's kernels on them (:func:`tracedb.views.spread.branch_table`),
the tokens' policy versions read of the lake when the views ask for them
(:func:`tracedb.lake.versions.attach`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from tracedb.lake import catalog, versions
from tracedb.lake.columns import resolve_credit, visible_columns
from tracedb.lake.scan import bucket_order
from tracedb.lake.select import resolve_rows
from tracedb.lake.workers import chunks, running_ray
from tracedb.records import COMPACT_STREAMS
from tracedb.selection import Selection
from tracedb.views import branch_indices, token_columns
from tracedb.views.nodes import NodeColumns
from tracedb.views.spread import branch_table

if TYPE_CHECKING:
    import ray.data


VIEW_TRACES = 256
"""Traces per view task."""
CACHE_TOKENS = 8_000_000
"""Tokens of decoded node columns a process (a Ray worker) keeps for later view tasks of
the same traces at the same snapshots (up to about 24 bytes a token with every stream:
~200 MB a worker at most, small beside Ray's memory monitor's threshold)."""
_TABLES = ("nodes", "branches", "segments", "episodes", "policy_labels", "credit", "trace_credit", "credit_sets")
"""The tables a view's columns and policy versions are read of: their snapshots key the cache."""


class _Cache:
    """Decoded node columns of view tasks, least recently used first out, at most
    :data:`CACHE_TOKENS` tokens (what the file store's handle keeps between calls,
    :attr:`tracedb.handle.Handle.view_cache`, kept here per worker process). A key holds
    the snapshots of every table the columns were read of, so any commit to one misses."""

    def __init__(self) -> None:
        self.items: OrderedDict[Any, NodeColumns] = OrderedDict()
        self.lock = threading.Lock()

    def get(self, key: Any, streams: Sequence[str]) -> NodeColumns | None:
        with self.lock:
            data = self.items.get(key)
            if data is None or not set(streams) <= set(data.streams):
                return None
            self.items.move_to_end(key)
            return data

    def put(self, key: Any, data: NodeColumns) -> None:
        tokens = int(data.starts[-1])
        if tokens > CACHE_TOKENS:
            return
        with self.lock:
            self.items[key] = data
            held = sum(int(d.starts[-1]) for d in self.items.values())
            while held > CACHE_TOKENS:
                _, dropped = self.items.popitem(last=False)
                held -= int(dropped.starts[-1])


_cache = _Cache()


def _key(lake: Any, traces: pa.Table, credit: str | None) -> tuple[Any, ...]:
    """What a view task's node columns depend on: the lake, the tables' snapshots, the
    visible traces rows (trace id and write) and the credit set."""
    snapshots = []
    for name in (n for n in _TABLES if n in catalog.lake_tables()):
        current = lake.table(name).current_snapshot()
        snapshots.append(None if current is None else current.snapshot_id)
    where = (lake.location.name, lake.location.namespace, tuple(sorted(lake.location.properties.items())))
    rows = (tuple(traces.column("trace_id").to_pylist()), tuple(traces.column(catalog.BATCH).to_pylist()))
    return where, tuple(snapshots), rows, credit


class _Views:
    """What one view task computes: the branch views of a chunk of visible traces."""

    def __init__(self, location: catalog.Location, options: dict[str, Any]) -> None:
        self.location = location
        self.options = options

    def __call__(self, batch: pa.Table) -> pa.Table:
        lake = catalog.Opened.worker(self.location)
        ids = [t for chunk in batch.column("trace_ids").to_pylist() for t in chunk]
        batches = [b for chunk in batch.column("batches").to_pylist() for b in chunk]
        return view(lake, pa.table({"trace_id": ids, catalog.BATCH: batches}), **self.options)


def view(
    lake: Any,
    traces: pa.Table,
    *,
    columns: list[str],
    train_once: bool,
    trainable: bool | None,
    branch_index: list[int] | None,
    credit: str | None,
) -> pa.Table:
    """The branch views of the visible traces rows ``traces`` (``trace_id``,
    :data:`~tracedb.lake.catalog.BATCH`), the arguments checked already
    (``columns``: :func:`tracedb.views.token_columns`'s, ``credit``:
    :func:`~tracedb.lake.columns.resolve_credit`'s)."""
    streams = [c for c in COMPACT_STREAMS if c in columns]
    key = _key(lake, traces, credit)
    data = _cache.get(key, streams)
    if data is None:
        data = visible_columns(lake, traces, streams, credit)
        _cache.put(key, data)
    if "policy_version" in columns:  # attached once to the cached columns (of the same snapshots)
        versions.attach(lake, traces, data)
    return branch_table(data, columns, train_once, trainable, branch_index).replace_schema_metadata(None)


def branches(
    lake: catalog.Opened,
    selection: Selection,
    *,
    trainable: bool | None = None,
    branch_index: int | Sequence[int] | None = None,
    columns: Sequence[str] | None = None,
    train_once: bool = False,
    credit: str | None = None,
    traces_per_task: int = VIEW_TRACES,
) -> ray.data.Dataset:
    """See :meth:`tracedb.lake.Lake.branches`."""
    if not isinstance(traces_per_task, int) or isinstance(traces_per_task, bool) or traces_per_task < 1:
        raise ValueError(f"traces_per_task is a number of traces (an int >= 1), not {traces_per_task!r}")
    options = dict(
        columns=token_columns(columns),
        train_once=train_once,
        trainable=trainable,
        branch_index=branch_indices(branch_index),
        credit=resolve_credit(lake, credit),
    )
    rows, _ = resolve_rows(lake, selection)
    ray = running_ray()
    batch_of = dict(zip(rows.column("trace_id").to_pylist(), rows.column(catalog.BATCH).to_pylist(), strict=True))
    parts = chunks(bucket_order(lake.table("traces"), "trace_id", list(batch_of)), traces_per_task)
    if not parts:
        return ray.data.from_arrow(view(lake, rows, **options))
    items = pa.table(
        {
            "trace_ids": pa.array(parts, pa.list_(pa.string())),
            "batches": pa.array([[batch_of[t] for t in part] for part in parts], pa.list_(pa.string())),
        }
    )
    return (
        ray.data.from_arrow(items)
        .repartition(len(parts))
        .map_batches(_Views(lake.location, options), batch_format="pyarrow", batch_size=1, zero_copy_batch=True)
    )


__all__ = ["VIEW_TRACES", "branches", "view"]
