"""Branch views of a lake, computed in Ray workers by the file store's own view code.

A view task pulls its chunk of traces into an in-memory tracedb
(:func:`tracedb.lake.move.write_into` of :func:`tracedb.lake.read.visible`) and calls
:meth:`tracedb.Database.branches` there (the same kernels). Tasks take the traces in
the order of their ``trace_id`` hash bucket (:func:`tracedb.lake.scan.bucket_order`), so
a task reads the per-trace files of its own buckets only; the segments its nodes use
are content-addressed, bucketed by segment id, and read from every bucket that holds
one (see ``docs/scale.md``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from tracedb.database import connect
from tracedb.lake import catalog, move, read
from tracedb.lake.scan import bucket_order
from tracedb.lake.select import select_ids
from tracedb.lake.workers import chunks, running_ray
from tracedb.selection import Selection

if TYPE_CHECKING:
    import ray.data


VIEW_TRACES = 256
"""Traces per view task."""


class _Views:
    """What one view task computes: the branch views of a chunk of trace ids."""

    def __init__(self, location: catalog.Location, options: dict[str, Any]) -> None:
        self.location = location
        self.options = options

    def __call__(self, batch: pa.Table) -> pa.Table:

        lake = catalog.Opened.at(self.location)
        ids = [t for chunk in batch.column("trace_ids").to_pylist() for t in chunk]
        with connect(":memory:") as db:
            move.write_into(db, read.visible(lake, trace_ids=ids))
            views = db.branches(**self.options)
        return views.replace_schema_metadata(None)


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
    if not isinstance(traces_per_task, int) or traces_per_task < 1:
        raise ValueError(f"traces_per_task is a number of traces (an int >= 1), not {traces_per_task!r}")
    ray = running_ray()
    ids = select_ids(lake, selection)
    options = dict(
        trainable=trainable, branch_index=branch_index, columns=columns, train_once=train_once, credit=credit
    )
    parts = chunks(bucket_order(lake.table("traces"), "trace_id", ids), traces_per_task)
    items = pa.table({"trace_ids": pa.array(parts, pa.list_(pa.string()))})
    if not parts:
        with connect(":memory:") as db:
            return ray.data.from_arrow(db.branches(**options).replace_schema_metadata(None))
    return (
        ray.data.from_arrow(items)
        .repartition(len(parts))
        .map_batches(_Views(lake.location, options), batch_format="pyarrow", batch_size=1, zero_copy_batch=True)
    )


__all__ = ["VIEW_TRACES", "branches"]
