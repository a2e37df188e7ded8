"""The lake on Ray: branch views computed in workers, files ingested in tasks.

Both run the file store's own code in the workers: a view worker pulls its traces into
an in-memory tracedb (:func:`tracedb.lake.move.write_into`) and calls
:meth:`tracedb.Database.branches` (the same kernels); an ingest task ingests its files
into an in-memory tracedb (the same scanner, parser and validation, rejects kept) and
appends the result to the lake as one write (:mod:`tracedb.lake.write`: idempotent by
trace id whatever else writes at the same time, so a task Ray retries after its worker
died adds nothing twice). Ray is imported here only, when one of these runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc
from pyiceberg.expressions import AlwaysTrue, In

from tracedb.database import connect
from tracedb.ingest.files import find_files
from tracedb.lake import catalog, move, read
from tracedb.lake.write import AppendReport, append

if TYPE_CHECKING:
    import ray.data


VIEW_TRACES = 256
"""Traces per view task (whole groups are kept in one task where the selection allows)."""


def running_ray() -> Any:
    """Ray, once it runs in this process (an error saying what to do otherwise)."""
    try:
        import ray
    except ImportError as e:
        raise ImportError("the lake's Ray calls need the lake extra: pip install 'tracedb[lake]'") from e
    if not ray.is_initialized():
        raise RuntimeError("Ray is not running in this process: call ray.init(...) first (tracedb lake: --ray-address)")
    return ray


def select_ids(
    lake: catalog.Opened,
    *,
    trace_ids: Sequence[str] | None = None,
    group: str | Sequence[str] | None = None,
    episode: str | Sequence[str] | None = None,
    after: int | None = None,
    through: int | None = None,
) -> list[str]:
    """The visible traces a selection takes, ordered by group then trace id (so that
    chunks of it keep groups whole)."""
    row_filter = AlwaysTrue()
    if trace_ids is not None:
        row_filter = In("trace_id", list(trace_ids)) if trace_ids else None
    if row_filter is None:
        return []
    for column, values in (("group_id", group), ("episode_id", episode)):
        if values is not None:
            row_filter = row_filter & In(column, [values] if isinstance(values, str) else list(values))
    traces = read.scan_traces(lake.table("traces"), row_filter, ["trace_id", "group_id", catalog.BATCH])
    keep = pc.is_valid(traces.column("seq"))
    if after is not None:
        keep = pc.and_(keep, pc.greater(traces.column("seq"), after))
    if through is not None:
        keep = pc.and_(keep, pc.less_equal(traces.column("seq"), through))
    chosen = traces.filter(keep).group_by(["trace_id", "group_id"]).aggregate([])
    ordered = chosen.sort_by([("group_id", "ascending"), ("trace_id", "ascending")])
    return ordered.column("trace_id").to_pylist()


def _chunks(ids: list[str], size: int) -> list[list[str]]:
    return [ids[i : i + size] for i in range(0, len(ids), size)]


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
    *,
    trace_ids: Sequence[str] | None = None,
    group: str | Sequence[str] | None = None,
    episode: str | Sequence[str] | None = None,
    after: int | None = None,
    complete_groups: int | None = None,
    tags: Any = None,
    through: int | None = None,
    trainable: bool | None = None,
    branch_index: int | Sequence[int] | None = None,
    columns: Sequence[str] | None = None,
    train_once: bool = False,
    credit: str | None = None,
    traces_per_task: int = VIEW_TRACES,
) -> ray.data.Dataset:
    """See :meth:`tracedb.lake.Lake.branches`."""
    if complete_groups is not None or tags is not None:
        raise ValueError(
            "lake.branches: complete_groups= and tags= are not supported on a lake yet (select by ids/group)"
        )
    if not isinstance(traces_per_task, int) or traces_per_task < 1:
        raise ValueError(f"traces_per_task is a number of traces (an int >= 1), not {traces_per_task!r}")
    ray = running_ray()
    ids = select_ids(lake, trace_ids=trace_ids, group=group, episode=episode, after=after, through=through)
    options = dict(
        trainable=trainable, branch_index=branch_index, columns=columns, train_once=train_once, credit=credit
    )
    chunks = _chunks(ids, traces_per_task)
    items = pa.table({"trace_ids": pa.array(chunks, pa.list_(pa.string()))})
    if not chunks:
        with connect(":memory:") as db:
            return ray.data.from_arrow(db.branches(**options).replace_schema_metadata(None))
    return (
        ray.data.from_arrow(items)
        .repartition(len(chunks))
        .map_batches(_Views(lake.location, options), batch_format="pyarrow", batch_size=1, zero_copy_batch=True)
    )


@dataclass
class LakeIngestReport:
    """What a ``lake ingest`` did."""

    files: int = 0
    lines: int = 0
    traces: int = 0
    skipped: int = 0
    """Traces the lake showed already (from an earlier or a concurrent ingest)."""
    rejected: int = 0
    rows: dict[str, int] = field(default_factory=dict)
    tasks: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("files", "lines", "traces", "skipped", "rejected", "rows", "tasks")}

    def __str__(self) -> str:
        return (
            f"ingested {self.traces} traces from {self.files} files in {self.tasks} Ray tasks"
            f" ({self.skipped} already in the lake, {self.rejected} rejected)"
        )


def ingest_files(location: catalog.Location, files: list[str], allow_ragged: bool) -> dict[str, Any]:
    """One ingest task: ``files`` into an in-memory tracedb (its scanner, parser and
    checks), then appended to the lake as one write. Returns the counts."""

    lake = catalog.Opened.at(location)
    with connect(":memory:") as db:
        report = db.ingest(files, allow_ragged=allow_ragged)
        ids = db.sql("SELECT trace_id FROM traces ORDER BY seq").column("trace_id").to_pylist()
        appended: AppendReport = append(lake, move.file_rows(db, ids))
    return {
        "lines": report.lines,
        "rejected": len(report.rejected),
        "traces": appended.traces,
        "skipped": appended.skipped + report.skipped,
        "rows": appended.rows,
    }


def ingest(
    lake: catalog.Opened,
    paths: Iterable[str | Path],
    *,
    workers: int | None = None,
    files_per_task: int = 1,
    allow_ragged: bool = False,
) -> LakeIngestReport:
    """See :meth:`tracedb.lake.Lake.ingest`."""
    if workers is not None and (not isinstance(workers, int) or workers < 1):
        raise ValueError(f"workers is a number of tasks at once (an int >= 1), not {workers!r}")
    ray = running_ray()
    files = [str(p.resolve()) for p in find_files(paths)]
    task = ray.remote(max_retries=3, retry_exceptions=False)(ingest_files)
    groups = _chunks(files, max(1, files_per_task))
    limit = workers or max(1, int(ray.available_resources().get("CPU", 1)))
    report = LakeIngestReport(files=len(files), tasks=len(groups))
    pending: list[Any] = []
    results: list[dict[str, Any]] = []
    for group in groups:
        if len(pending) >= limit:
            done, pending = ray.wait(pending, num_returns=1)
            results.extend(ray.get(done))
        pending.append(task.remote(lake.location, group, allow_ragged))
    results.extend(ray.get(pending))
    for r in results:
        report.lines += r["lines"]
        report.traces += r["traces"]
        report.skipped += r["skipped"]
        report.rejected += r["rejected"]
        for name, n in r["rows"].items():
            report.rows[name] = report.rows.get(name, 0) + n
    return report


__all__ = ["LakeIngestReport", "branches", "ingest", "select_ids"]
