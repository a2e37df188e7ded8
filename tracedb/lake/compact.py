"""Compacting a lake: what readers never see is removed, small files are rewritten, old
snapshots (and the files only they held) are expired.

Each table is rewritten (one overwrite commit per table) holding only what a reader can
see, with the lake's own :data:`~tracedb.lake.catalog.BATCH` kept: per-trace rows of the
write that committed their trace's row, episodes likewise (one per episode id), each
segment once, rejects once per key, credit sets once per name. Rows of a write that
never committed its traces row are removed only when the file holding them was added
more than ``grace`` seconds ago, so a writer still at work keeps its rows. A table whose
rows are all kept and which has one file per partition is left alone.

``traces`` is rewritten too, one row per trace id (the visible one: the first by seq
then :data:`BATCH`), each row carrying its ``seq`` in the stored ``seq`` column: a
trace's seq is the data sequence number of the file its write committed, which the
rewrite renumbers, and readers take the stored value when there is one
(:func:`tracedb.lake.scan.scan_traces`). The rewrite is one more traces commit, with a
sequence number above every stored one, so a trace committed after it still gets a
``seq`` above every earlier trace's. A writer that commits traces between the
compaction's read and its commit makes the commit conflict (pyiceberg's retries are
off on ``traces``, and the compaction holds a table object of its own, which nothing
refreshes meanwhile): the table is read and rewritten again.

:func:`expire` removes, per table, the snapshots that stopped being current more than
``older_than`` seconds ago (never the current one: a reader that loaded a table up to
``older_than`` seconds ago still finds its files), then deletes the files in the
table's location that no remaining snapshot and no metadata file of the log references:
those only the expired snapshots held (the data files compaction replaced, their
manifests) at once, any other (a writer killed before its commit, a failed commit's
manifests, metadata files past the log) once it is older than ``grace`` seconds.
pyiceberg's ``expire_snapshots`` only edits the metadata; deleting files is done here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import duckdb
import pyarrow as pa
from pyarrow.fs import FileSelector, FileType
from pyiceberg.exceptions import CommitFailedException, ValidationException
from pyiceberg.expressions import AlwaysTrue
from pyiceberg.io.pyarrow import ArrowScan, PyArrowFileIO

from tracedb.lake import catalog, read
from tracedb.lake.scan import visible_traces
from tracedb.sqltext import quote_identifier

GRACE_SECONDS = 3600.0
"""Rows of an uncommitted write in a file younger than this are kept (a writer may still
commit its traces row); unreferenced files younger than this are not deleted."""

ATTEMPTS = 5
"""Rewrites of one table tried when writers keep committing to it meanwhile."""

_ADDED = "_tdb_added_ms"


@dataclass
class CompactReport:
    """What a compaction did, per table: rows and files before and after (``tables``), and
    what snapshot expiry removed (``expired``: snapshots, files, bytes; empty without it)."""

    tables: dict[str, dict[str, int]] = field(default_factory=dict)
    expired: dict[str, dict[str, int]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"tables": self.tables, "expired": self.expired}


def own_tables(location: catalog.Location) -> Any:
    """A loader of table objects of a compaction's own (by name): a lake's are refreshed
    by every call on it (another thread's write would move them between a read and a commit)."""
    where = location.catalog()
    return lambda name: where.load_table(f"{location.namespace}.{name}")


def _scan_with_age(table: Any) -> tuple[pa.Table, list[Any]]:
    """Every row of ``table`` with the time (ms) its file was added, and the scan tasks.

    A file added by a snapshot expired since is given the time of the oldest snapshot
    left (it was added before that one: taking it as younger keeps more, never less)."""
    snapshot = table.current_snapshot()
    if snapshot is None:
        return table.scan().to_arrow().append_column(_ADDED, pa.array([], pa.int64())), []
    oldest = min(s.timestamp_ms for s in table.metadata.snapshots)
    added = {}
    for manifest in snapshot.manifests(table.io):
        for entry in manifest.fetch_manifest_entry(table.io, discard_deleted=True):
            made = table.snapshot_by_id(entry.snapshot_id)
            added[entry.data_file.file_path] = made.timestamp_ms if made is not None else oldest
    scan = ArrowScan(table.metadata, table.io, table.schema(), AlwaysTrue())
    tasks = list(table.scan().plan_files())
    parts = []
    for task in tasks:
        part = scan.to_table([task])
        parts.append(part.append_column(_ADDED, pa.array([added[task.file.file_path]] * part.num_rows, pa.int64())))
    if not parts:
        empty = table.scan(limit=0).to_arrow()
        return empty.append_column(_ADDED, pa.array([], pa.int64())), []
    return pa.concat_tables(parts, promote_options="permissive"), tasks


def _compacted(tasks: list[Any]) -> bool:
    """Whether the files of ``tasks`` are one per partition already."""
    return len({(t.file.spec_id, str(t.file.partition)) for t in tasks}) == len(tasks)


def _kept_query(name: str, schema: pa.Schema, cutoff_ms: int) -> str:
    """The SQL choosing the rows of ``raw`` that compaction keeps (``vis``: visible traces)."""
    young = f"r.{_ADDED} > {cutoff_ms}"
    if catalog.per_trace(name, schema):
        of_a_set = " AND r.credit_set IN (SELECT name FROM sets)" if "credit_set" in schema.names else ""
        return (
            f"SELECT r.* FROM raw r WHERE {young} OR (EXISTS "
            f"(SELECT 1 FROM vis v WHERE v.trace_id = r.trace_id AND v.{catalog.BATCH} = r.{catalog.BATCH}){of_a_set})"
        )
    if name == "episodes":
        return (
            f"SELECT * FROM raw r WHERE {young} UNION ALL SELECT r.* FROM raw r SEMI JOIN vis v "
            f"ON r.episode_id = v.episode_id AND r.{catalog.BATCH} = v.{catalog.BATCH} WHERE NOT {young} "
            f"QUALIFY row_number() OVER (PARTITION BY r.episode_id ORDER BY r.ingested_at, r.{catalog.BATCH}) = 1"
        )
    if name == "segments":
        return (
            f"SELECT * FROM raw r WHERE {young} UNION ALL SELECT r.* FROM raw r WHERE NOT {young} "
            "AND r.segment_id IN (SELECT segment_id FROM used) "
            "QUALIFY row_number() OVER (PARTITION BY r.segment_id ORDER BY r.segment_id) = 1"
        )
    if name == "rejects":
        key = ", ".join(f"r.{quote_identifier(c)}" for c in read.REJECT_KEY)
        return f"SELECT r.* FROM raw r QUALIFY row_number() OVER (PARTITION BY {key} ORDER BY r.rejected_at) = 1"
    if name == "credit_sets":
        return "SELECT r.* FROM raw r QUALIFY row_number() OVER (PARTITION BY r.name ORDER BY r.created_at) = 1"
    return "SELECT r.* FROM raw r"


def rewrite_traces(
    load: Any,
    *,
    stored_from: Collection[int] | None = None,
    properties: dict[str, str] | None = None,
    force: bool = False,
    change: Callable[[pa.Table], pa.Table] | None = None,
) -> dict[str, int]:
    """Rewrite ``traces`` (tables from ``load(name)``): the visible row per trace id, each
    with its ``seq`` (as :func:`~tracedb.lake.scan.scan_traces` reads it, with
    ``stored_from``) stored in the row, in one overwrite commit carrying ``properties``
    in its snapshot summary; retried when another traces commit lands meanwhile. Left
    alone (unless ``force``) when it holds one row per trace and one file per partition.
    ``change`` (an upgrade's) changes the visible rows before they are written (their
    columns, never which rows or their seq). Returns rows and files before and after."""
    for attempt in range(1, ATTEMPTS + 1):
        table = load("traces")
        tasks = list(table.scan().plan_files())
        kept = visible_traces(table, stored_from=stored_from)
        rows = sum(t.file.record_count for t in tasks)  # traces has no delete files
        entry = {"rows_before": rows, "rows_after": kept.num_rows, "files_before": len(tasks)}
        if not force and kept.num_rows == rows and _compacted(tasks):
            return {**entry, "files_after": len(tasks)}
        if change is not None:
            kept = change(kept)
        try:
            table.overwrite(kept.cast(table.schema().as_arrow()), snapshot_properties=properties or {})
        except CommitFailedException:
            if attempt == ATTEMPTS:
                raise
            continue
        return {**entry, "files_after": len(list(load("traces").scan().plan_files()))}
    raise AssertionError("unreachable")


def compact(
    lake: catalog.Opened, *, grace: float = GRACE_SECONDS, expire_older_than: float | None = None
) -> CompactReport:
    """See :meth:`tracedb.lake.Lake.compact`."""
    if grace < 0:
        raise ValueError(f"grace is a number of seconds >= 0, not {grace!r}")
    if expire_older_than is not None and expire_older_than < 0:
        raise ValueError(f"expire_older_than is a number of seconds >= 0, not {expire_older_than!r}")
    load = own_tables(lake.location)
    report = CompactReport()
    for name, schema in catalog.lake_tables().items():
        if name == "traces":
            report.tables[name] = rewrite_traces(load)
            continue
        for attempt in range(1, ATTEMPTS + 1):
            cutoff = int((time.time() - grace) * 1000)
            con = duckdb.connect()
            con.register("vis", visible_traces(load("traces"), columns=["episode_id"]))
            con.register(
                "sets", load("credit_sets").scan(selected_fields=("name",)).to_arrow()
            )  # values need their set
            if name == "segments":
                nodes, _ = _scan_with_age(load("nodes"))
                con.register("nodes_raw", nodes)
                con.execute(
                    "CREATE TEMP TABLE used AS SELECT DISTINCT n.segment_id FROM nodes_raw n WHERE "
                    f"n.{_ADDED} > {cutoff} OR EXISTS (SELECT 1 FROM vis v WHERE v.trace_id = n.trace_id "
                    f"AND v.{catalog.BATCH} = n.{catalog.BATCH})"
                )
            table = load(name)
            raw, tasks = _scan_with_age(table)
            con.register("raw", raw)
            kept = con.sql(_kept_query(name, schema, cutoff)).to_arrow_table().drop_columns([_ADDED])
            con.close()
            entry = {"rows_before": raw.num_rows, "rows_after": kept.num_rows, "files_before": len(tasks)}
            if kept.num_rows == raw.num_rows and _compacted(tasks):
                report.tables[name] = {**entry, "files_after": len(tasks)}
                break
            try:
                table.overwrite(kept.cast(table.schema().as_arrow()))
            except (CommitFailedException, ValidationException):  # pyiceberg's retries found a racing write's files
                if attempt == ATTEMPTS:
                    raise
                continue
            report.tables[name] = {**entry, "files_after": len(list(load(name).scan().plan_files()))}
            break
    if expire_older_than is not None:
        report.expired = expire(lake, older_than=expire_older_than, grace=grace)
    return report


def _expirable(table: Any, cutoff_ms: int) -> list[int]:
    """The snapshots of ``table`` replaced by another before ``cutoff_ms`` (never the current)."""
    current = table.current_snapshot()
    ordered = sorted(table.metadata.snapshots, key=lambda s: s.sequence_number)
    return [
        old.snapshot_id
        for old, new in zip(ordered, ordered[1:], strict=False)
        if new.timestamp_ms < cutoff_ms and current is not None and old.snapshot_id != current.snapshot_id
    ]


def _referenced(table: Any) -> set[str]:
    """Every file a snapshot or metadata file of ``table`` refers to (the metadata files of
    the log, manifest lists, manifests, live data and delete files, statistics)."""
    metadata = table.metadata
    files = {table.metadata_location, *(log.metadata_file for log in metadata.metadata_log)}
    files |= {s.statistics_path for s in metadata.statistics}
    files |= {s.statistics_path for s in metadata.partition_statistics}
    for snapshot in metadata.snapshots:
        files.add(snapshot.manifest_list)
        for manifest in snapshot.manifests(table.io):
            files.add(manifest.manifest_path)
            for entry in manifest.fetch_manifest_entry(table.io, discard_deleted=True):
                files.add(entry.data_file.file_path)
    return files


def _delete_unreferenced(load: Any, name: str, released: set[str], grace: float) -> tuple[int, int]:
    """Delete the files under table ``name``'s location that nothing refers to now: those
    only expired snapshots held (``released``) at once, any other (a killed writer's, a
    failed commit's) once it is older than ``grace`` seconds. Returns (files, bytes)."""
    table = load(name)
    io = table.io
    if not isinstance(io, PyArrowFileIO):
        raise catalog.LakeError(
            f"lake table {name}: its FileIO ({type(io).__name__}) cannot list files; "
            "unreferenced files are left (set py-io-impl to pyiceberg.io.pyarrow.PyArrowFileIO)"
        )
    scheme, netloc, root = io.parse_location(table.location(), io.properties)
    fs = io.fs_by_scheme(scheme, netloc)
    cutoff = time.time() - grace
    listed = [
        info
        for info in fs.get_file_info(FileSelector(root, recursive=True, allow_not_found=True))
        if info.type == FileType.File
    ]
    referenced = _referenced(load(name))  # after the listing: a file committed meanwhile is kept
    paths = {io.parse_location(path, io.properties)[2] for path in referenced}
    freed = {io.parse_location(path, io.properties)[2] for path in released - referenced}
    files = size = 0
    for info in listed:
        old = info.mtime is not None and info.mtime.timestamp() < cutoff
        if info.path not in paths and (info.path in freed or old):
            fs.delete_file(info.path)
            files += 1
            size += info.size or 0
    return files, size


def expire(lake: catalog.Opened, *, older_than: float, grace: float = GRACE_SECONDS) -> dict[str, dict[str, int]]:
    """Expire every table's snapshots that were replaced more than ``older_than`` seconds
    ago (the current one always stays), then delete the files under each table that no
    remaining snapshot refers to: the ones only the expired snapshots held, and any other
    older than ``grace`` seconds (a writer killed before its commit). Returns, per table,
    the snapshots expired and the files and bytes deleted."""
    if older_than < 0 or grace < 0:
        raise ValueError(f"older_than and grace are numbers of seconds >= 0, not {older_than!r}, {grace!r}")
    load = own_tables(lake.location)
    out: dict[str, dict[str, int]] = {}
    for name in (catalog.META, *catalog.lake_tables()):
        expired: list[int] = []
        released: set[str] = set()
        for attempt in range(1, ATTEMPTS + 1):
            table = load(name)
            expired = _expirable(table, int((time.time() - older_than) * 1000))
            if not expired:
                break
            released = _referenced(table)
            try:
                table.maintenance.expire_snapshots().by_ids(expired).commit()
                break
            except CommitFailedException:
                if attempt == ATTEMPTS:
                    raise
        files, size = _delete_unreferenced(load, name, released, grace)
        out[name] = {"snapshots_expired": len(expired), "files_deleted": files, "bytes_deleted": size}
    return out


__all__ = ["ATTEMPTS", "GRACE_SECONDS", "CompactReport", "compact", "expire", "own_tables", "rewrite_traces"]
