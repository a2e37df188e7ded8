"""Compacting a lake: what readers never see is removed, new small files are merged,
old snapshots (and the files only they held) are expired.

Incremental: per table, only the files added since the last compaction (the files not
written by a compaction, :func:`tracedb.lake.commit.compacted`) are rewritten, one file
per partition, in one commit that replaces them (a compaction's files are never rewritten
again but by ``full=True``, which rewrites every file). The rewrite keeps only what a
reader can see, the lake's own :data:`~tracedb.lake.catalog.BATCH` kept: per-trace rows
of the write that committed their trace's row, episodes likewise (one per episode id
among the rows rewritten), segments of writes that committed a trace (each once per
partition among the rows rewritten), rejects once per key, credit sets once per name.
Readers show each segment, episode, reject and credit set once whatever the files hold,
so duplicates across compactions cost bytes, not answers. A file holding rows of a
write that never committed its traces row is left for a later compaction while it is
younger than ``grace`` seconds (its writer may still be at work); older, those rows are
removed. The commit also merges the table's manifests into one (each append adds a
manifest, and planning a scan reads them all). What a compaction reads is the files it
rewrites and the ``traces`` key columns (trace id, batch, episode, seq: which rows are
visible), so its time follows the new data, not the lake's size.

``traces`` is compacted last, one row per trace id (the visible one: the first by seq
then :data:`BATCH`), each row carrying its ``seq`` in the stored ``seq`` column: a trace's
seq is the data sequence number of the file its write committed, which the rewrite
renumbers, and readers take the stored value when there is one
(:func:`tracedb.lake.scan.scan_traces`). The rewrite is one more traces commit, with a
sequence number above every stored one, so a trace committed after it still gets a
``seq`` above every earlier trace's. A writer that commits traces between the
compaction's read and its commit makes the commit conflict (pyiceberg's retries are
off on ``traces``, and the compaction holds a table object of its own, which nothing
refreshes meanwhile): the table is read and rewritten again. A commit to another table
meanwhile conflicts only when it removed one of the files being replaced (another
compaction): that table is planned again.

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

import pyarrow as pa
import pyarrow.compute as pc
from pyarrow.fs import FileSelector, FileType
from pyiceberg.exceptions import CommitFailedException, ValidationException
from pyiceberg.io.pyarrow import PyArrowFileIO

from tracedb.lake import catalog, read
from tracedb.lake import files as lake_files
from tracedb.lake.commit import compacted, data_files, replace_files
from tracedb.lake.scan import visible_traces
from tracedb.sqltext import quote_identifier

GRACE_SECONDS = 3600.0
"""Rows of an uncommitted write in a file younger than this are kept (a writer may still
commit its traces row); unreferenced files younger than this are not deleted."""

ATTEMPTS = 5
"""Rewrites of one table tried when writers keep committing to it meanwhile."""

_ADDED = "_tdb_added_ms"
_FILE = "_tdb_file"
_PART = "_tdb_part"


@dataclass
class CompactReport:
    """What a compaction did, per table: live files before and after, files rewritten and
    their rows before and after (``tables``), and what snapshot expiry removed
    (``expired``: snapshots, files, bytes; empty without it)."""

    tables: dict[str, dict[str, int]] = field(default_factory=dict)
    expired: dict[str, dict[str, int]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"tables": self.tables, "expired": self.expired}


def own_tables(location: catalog.Location) -> Any:
    """A loader of table objects of a compaction's own (by name): a lake's are refreshed
    by every call on it (another thread's write would move them between a read and a commit)."""
    where = location.catalog()
    return lambda name: where.load_table(f"{location.namespace}.{name}")


def _kept_query(name: str, schema: pa.Schema) -> str:
    """The SQL choosing the rows of ``raw`` (rows of the files rewritten) that readers can
    see (``vis``: the visible traces rows; ``sets``: the credit sets' names)."""
    b = catalog.BATCH
    if name == "traces":
        return f"SELECT r.* REPLACE (v.seq AS seq) FROM raw r JOIN vis v ON v.trace_id = r.trace_id AND v.{b} = r.{b}"
    if catalog.per_trace(name, schema):
        of_a_set = " AND r.credit_set IN (SELECT name FROM sets)" if "credit_set" in schema.names else ""
        return (
            "SELECT r.* FROM raw r WHERE EXISTS "
            f"(SELECT 1 FROM vis v WHERE v.trace_id = r.trace_id AND v.{b} = r.{b}){of_a_set}"
        )
    if name == "episodes":
        order = "r.ingested_at, " if "ingested_at" in schema.names else ""
        return (
            f"SELECT r.* FROM raw r SEMI JOIN vis v ON r.episode_id = v.episode_id AND r.{b} = v.{b} "
            f"QUALIFY row_number() OVER (PARTITION BY r.episode_id ORDER BY {order}r.{b}) = 1"
        )
    if name == "segments":
        return (
            f"SELECT r.* FROM raw r WHERE r.{b} IN (SELECT {b} FROM vis) "
            f"QUALIFY row_number() OVER (PARTITION BY r.{_PART}, r.segment_id ORDER BY r.{b}) = 1"
        )
    if name == "rejects":
        key = ", ".join(f"r.{quote_identifier(c)}" for c in read.REJECT_KEY)
        return f"SELECT r.* FROM raw r QUALIFY row_number() OVER (PARTITION BY {key} ORDER BY r.rejected_at) = 1"
    if name == "credit_sets":
        return "SELECT r.* FROM raw r QUALIFY row_number() OVER (PARTITION BY r.name ORDER BY r.created_at) = 1"
    return "SELECT r.* FROM raw r"


def _decided_query(name: str, schema: pa.Schema, cutoff_ms: int) -> str | None:
    """The SQL of the files (``_tdb_file``) holding rows readers do not see that a writer
    still at work may commit: rows of a write without a visible traces row, in a file
    younger than ``cutoff_ms``; None for a table of no such rows."""
    b = catalog.BATCH
    young = f"r.{_ADDED} > {cutoff_ms}"
    if name == "traces":  # a traces row is visible or lost: nothing waits
        return None
    if catalog.per_trace(name, schema):
        return (
            f"SELECT DISTINCT r.{_FILE} FROM raw r WHERE {young} AND NOT EXISTS "
            f"(SELECT 1 FROM vis v WHERE v.trace_id = r.trace_id AND v.{b} = r.{b})"
        )
    if name in ("episodes", "segments"):
        return f"SELECT DISTINCT r.{_FILE} FROM raw r WHERE {young} AND r.{b} NOT IN (SELECT {b} FROM vis)"
    return None


def _added_ms(table: Any, files: list[lake_files.LiveFile]) -> list[int]:
    """When each file was added (ms), by the snapshot that added it; a file added by a
    snapshot expired since gets the time of the oldest snapshot left (it was added before
    that one: taking it as younger keeps more, never less)."""
    oldest = min((s.timestamp_ms for s in table.metadata.snapshots), default=0)
    out = []
    for f in files:
        made = table.snapshot_by_id(f.snapshot_id)
        out.append(made.timestamp_ms if made is not None else oldest)
    return out


def _chosen(table: Any, full: bool) -> tuple[list[lake_files.LiveFile], list[lake_files.LiveFile]]:
    """A table's live files and those a compaction rewrites (``full``: all; else those
    added since the last compaction)."""
    live = lake_files.live_files(table)
    return live, (live if full else [f for f in live if not compacted(f.path)])


def compact_table(
    load: Any,
    name: str,
    vis: pa.Table,
    sets: pa.Table,
    *,
    cutoff_ms: int,
    full: bool = False,
    force: bool = False,
    properties: dict[str, str] | None = None,
    change: Callable[[pa.Table], pa.Table] | None = None,
    table: Any = None,
) -> dict[str, int] | None:
    """Rewrite table ``name`` (from ``load``): its files added since the last compaction
    (``full``: every file) that hold nothing a writer at work may still commit (see
    :func:`_decided_query`), as the rows readers see of them (``vis``: the visible traces
    rows with ``seq``; ``sets``: credit set names), one file per partition, in one commit
    replacing them (``properties`` in its summary). Nothing is done when those files are
    one per partition already and lose no row (unless ``force``). Returns the entry of
    the report; None when the commit conflicted (plan again). ``change`` changes the kept
    rows before they are written (see :func:`rewrite_traces`); ``table``: the table object
    to rewrite (default: ``load(name)``; ``traces`` must be the one ``vis`` was read of, so
    that a traces commit after that read makes the rewrite's commit conflict)."""
    schema = catalog.lake_tables()[name]
    table = load(name) if table is None else table
    live, chosen = _chosen(table, full)
    entry = {"files_before": len(live), "files_rewritten": 0, "rows_before": 0, "rows_after": 0}
    if not chosen:
        return {**entry, "files_after": len(live)}
    raw = lake_files.read(table, chosen, file_index=_FILE)
    added = pa.array(_added_ms(table, chosen), pa.int64())
    parts = {}
    part_of = pa.array([parts.setdefault((f.spec_id, f.partition), len(parts)) for f in chosen], pa.int32())
    raw = raw.append_column(_ADDED, pc.take(added, raw.column(_FILE)))
    raw = raw.append_column(_PART, pc.take(part_of, raw.column(_FILE)))
    con = lake_files.duck()
    try:
        con.register("vis", vis)
        con.register("sets", sets)
        con.register("raw", raw)
        query = _decided_query(name, schema, cutoff_ms)
        waiting = set() if query is None else {r[0] for r in con.execute(query).fetchall()}
        if waiting:  # left for a later compaction, rows and all
            keep = pa.array(sorted(set(range(len(chosen))) - waiting), pa.int32())
            con.register("raw", raw.filter(pc.is_in(raw.column(_FILE), value_set=keep)))
            chosen = [f for i, f in enumerate(chosen) if i not in waiting]
        rewritten = con.execute("SELECT count(*) FROM raw").fetchall()[0][0]
        kept = con.sql(_kept_query(name, schema)).to_arrow_table().drop_columns([_FILE, _ADDED, _PART])
    finally:
        con.close()
    entry.update(files_rewritten=len(chosen), rows_before=rewritten, rows_after=kept.num_rows)
    one_each = len({(f.spec_id, f.partition) for f in chosen}) == len(chosen)
    if not chosen or (not force and kept.num_rows == rewritten and one_each and all(compacted(f.path) for f in chosen)):
        return {**entry, "files_rewritten": 0, "files_after": len(live)}
    if change is not None:
        kept = change(kept)
    written = lake_files.arrow_schema(table)
    new = data_files(table, kept.cast(written), compaction=True)
    try:
        replace_files(table, [f.data_file for f in chosen], new, properties)
    except (CommitFailedException, ValidationException):  # another writer removed one of the files, or traces moved
        return None
    return {**entry, "files_after": len(lake_files.live_files(load(name)))}


def _visible(
    load: Any, stored_from: Collection[int] | None = None, *, traces: Any = None, buckets: Collection[int] | None = None
) -> tuple[pa.Table, pa.Table]:
    """The visible traces rows (trace id, batch, episode, seq; of ``traces``, default
    ``load("traces")``; ``buckets``: of those buckets of the trace id only) and the credit
    set names."""
    traces = load("traces") if traces is None else traces
    vis = visible_traces(traces, columns=["episode_id"], stored_from=stored_from, buckets=buckets)
    sets = lake_files.read(load("credit_sets"), lake_files.live_files(load("credit_sets")), ["name"])
    return vis.select(["trace_id", catalog.BATCH, "episode_id", "seq"]), sets


def _buckets(load: Any, names: Collection[str], full: bool) -> set[int] | None:
    """The buckets of the trace id whose visible traces a compaction of tables ``names``
    needs: those of the files it rewrites of the per-trace tables and of segments (homed
    in their traces' buckets). None (every bucket) when episodes are rewritten (an
    episode row is visible through a trace of any bucket), or a table's files are not
    bucketed as ``traces`` is."""
    traces = load("traces")
    home = lake_files.bucket_of(traces, "trace_id")
    if home is None:
        return None
    out: set[int] = set()
    schemas = catalog.lake_tables()
    for name in names:
        schema = schemas[name]
        if name == "episodes":
            table = load(name)
            if _chosen(table, full)[1]:
                return None
            continue
        if not (catalog.per_trace(name, schema) or name == "segments"):
            continue  # rejects, credit sets: their rewrite reads no traces
        table = load(name)
        where = lake_files.bucket_of(table, catalog.SEGMENT_HOME if name == "segments" else "trace_id")
        if where is None or where[1].num_buckets != home[1].num_buckets:
            return None
        spec = table.spec().spec_id
        for f in _chosen(table, full)[1]:
            if f.spec_id != spec:
                return None
            out.add(f.partition[where[0]])
    return out


def rewrite_traces(
    load: Any,
    *,
    stored_from: Collection[int] | None = None,
    properties: dict[str, str] | None = None,
    force: bool = False,
    full: bool = True,
    change: Callable[[pa.Table], pa.Table] | None = None,
) -> dict[str, int]:
    """Rewrite ``traces`` (tables from ``load(name)``; ``full``: every file, else those
    added since the last compaction): the visible row per trace id, each with its ``seq``
    (as :func:`~tracedb.lake.scan.scan_traces` reads it, with ``stored_from``) stored in
    the row, in one commit carrying ``properties`` in its snapshot summary; planned again
    when another traces commit lands meanwhile. Left alone (unless ``force``) when the
    files are one per partition, compacted already, and every row visible. ``change`` (an
    upgrade's) changes the rows before they are written (their columns, never which rows
    or their seq). Returns the report's entry."""
    for _ in range(ATTEMPTS):
        done = _rewrite_traces(load, None, stored_from, properties, force, full, change)
        if done is not None:
            return done
    raise CommitFailedException(f"traces: {ATTEMPTS} rewrites conflicted with other writers")


def _rewrite_traces(
    load: Any,
    read: tuple[Any, pa.Table, pa.Table] | None,
    stored_from: Collection[int] | None,
    properties: dict[str, str] | None,
    force: bool,
    full: bool,
    change: Callable[[pa.Table], pa.Table] | None,
) -> dict[str, int] | None:
    """One attempt of :func:`rewrite_traces`; ``read``: a traces table object and the
    visible rows and set names read of it, when they hold every bucket its rewrite needs
    (else they are read here, of the buckets of the files rewritten)."""
    if read is None:
        table = load("traces")
        buckets = None
        where = lake_files.bucket_of(table, "trace_id")
        if where is not None:
            spec = table.spec().spec_id
            chosen = _chosen(table, full)[1]
            if all(f.spec_id == spec for f in chosen):
                buckets = {f.partition[where[0]] for f in chosen}
        vis, sets = _visible(load, stored_from, traces=table, buckets=buckets)
    else:
        table, vis, sets = read
    return compact_table(
        load,
        "traces",
        vis,
        sets,
        cutoff_ms=0,
        full=full,
        force=force,
        properties=properties,
        change=change,
        table=table,
    )


def _snapshot(table: Any) -> int | None:
    current = table.current_snapshot()
    return None if current is None else current.snapshot_id


def _read_visible(load: Any, names: Collection[str], full: bool, grace: float) -> tuple[int, Any, pa.Table, pa.Table]:
    """What a compaction's rewrites decide by, read once for all its tables: the cutoff
    (ms), the traces table object, its visible rows of the buckets the rewrites need
    (:func:`_buckets`) and the credit set names. The cutoff is taken first: a file added
    after the buckets were chosen, or after the read, is younger than it, so rows the
    read does not show as visible there are left for a later compaction, not removed."""
    cutoff = int((time.time() - grace) * 1000)
    buckets = _buckets(load, names, full)
    traces = load("traces")
    vis, sets = _visible(load, traces=traces, buckets=buckets)
    return cutoff, traces, vis, sets


def compact(
    lake: catalog.Opened, *, grace: float = GRACE_SECONDS, expire_older_than: float | None = None, full: bool = False
) -> CompactReport:
    """See :meth:`tracedb.lake.Lake.compact`."""
    if not isinstance(grace, int | float) or grace < 0:
        raise ValueError(f"grace is a number of seconds >= 0, not {grace!r}")
    if expire_older_than is not None and expire_older_than < 0:
        raise ValueError(f"expire_older_than is a number of seconds >= 0, not {expire_older_than!r}")
    load = own_tables(lake.location)
    report = CompactReport()
    names = list(catalog.lake_tables())
    cutoff, traces, vis, sets = _read_visible(load, names, full, grace)
    for name in names:
        if name == "traces":
            continue
        for attempt in range(1, ATTEMPTS + 1):
            if attempt > 1 or _snapshot(load("traces")) != _snapshot(traces):  # conflicted, or traces moved
                cutoff, traces, vis, sets = _read_visible(load, names, full, grace)
            done = compact_table(load, name, vis, sets, cutoff_ms=cutoff, full=full)
            if done is not None:
                report.tables[name] = done
                break
            if attempt == ATTEMPTS:
                raise CommitFailedException(f"{name}: {ATTEMPTS} rewrites conflicted with other writers")
    # traces: the rows read above when it has not moved since (the rewrite's commit then
    # conflicts with any traces commit after that read), else read again.
    first = (traces, vis, sets) if _snapshot(load("traces")) == _snapshot(traces) else None
    for attempt in range(1, ATTEMPTS + 1):
        done = _rewrite_traces(load, first if attempt == 1 else None, None, None, False, full, None)
        if done is not None:
            report.tables["traces"] = done
            break
        if attempt == ATTEMPTS:
            raise CommitFailedException(f"traces: {ATTEMPTS} rewrites conflicted with other writers")
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


__all__ = [
    "ATTEMPTS",
    "GRACE_SECONDS",
    "CompactReport",
    "compact",
    "compact_table",
    "expire",
    "own_tables",
    "rewrite_traces",
]
