"""Upgrading a lake's layout to this tracedb's (:data:`~tracedb.lake.catalog.LAKE_SCHEMA_VERSION`).

Every upgrade first adds to each table the columns of this tracedb's schema it lacks
(:func:`add_columns`: the file store's stored schema, :func:`tracedb.lake.catalog.lake_tables`,
plus the lake's own columns), nullable: rows written before read null there. The file
store's schema growing by columns is an upgrade of nothing else.

1 → 2: a version-1 writer stored the file store's ``seq`` in each ``traces`` row (a push
copied it) and readers took the data sequence number of the file holding the row; a
version-2 reader takes a stored seq when there is one. The upgrade rewrites ``traces``
with compaction's own rewrite (:func:`tracedb.lake.compact.rewrite_traces`: the visible
row per trace id), each row's stored seq set to the data sequence number of the file
holding it then, whatever version 1 stored, so every trace keeps the seq version-1
readers gave it.

2 → 3: segments move beside the traces that use them. ``segments`` gets the lake's
columns :data:`~tracedb.lake.catalog.BATCH` and :data:`~tracedb.lake.catalog.SEGMENT_HOME`
and the partition ``bucket(N, lake_trace)`` (N: the lake's bucket count, 16 for lakes of
versions 1 and 2, recorded now in ``tracedb_meta``), and is rewritten: each segment a
visible node uses, once per bucket holding a trace that uses it, homed at the first such
trace and carrying its visible row's batch (what a version-3 write stores). Segments no
visible node uses are left out (a killed writer's, as compaction leaves them out).
It goes bucket by bucket (the nodes of one trace bucket at a time).

Crash-safe by its order and its markers: each rewrite's snapshot carries :data:`UPGRADED`
in its summary, in the same commit as the rows, and the meta rows are set last. A rerun
after a crash before them takes the stored seq of the files the traces rewrite added
(they are right already, and their files' own numbers are the rewrite's) and the file's
number everywhere else (rows a version-1 writer appended since); it does not rewrite
``traces`` again when that rewrite is its current snapshot, nor ``segments`` when every
segments file is of the new partition spec. Stop the lake's writers while it runs: an
older writer keeps writing its layout until the meta row says this version.

3 → 4: the file store's schema-6 columns (policy versions, dropped traces, the episodes'
work; added with the others by :func:`add_columns`) are filled in from the rows'
records, as the file store's migration fills them, ``traces`` rewritten last with every
seq kept (:mod:`tracedb.lake.policy_columns`). A rerun fills only what is still empty.
"""

from __future__ import annotations

from collections.abc import Callable

import duckdb
import pyarrow as pa
from pyiceberg.transforms import BucketTransform

from tracedb.lake import catalog, compact, policy_columns
from tracedb.lake import files as lake_files
from tracedb.lake.commit import data_files, replace_files
from tracedb.lake.scan import visible_traces
from tracedb.lake.write import lake_rows

UPGRADED = "tracedb.lake-schema-version"
"""The snapshot summary property marking an upgrade's rewrite of ``traces`` or
``segments`` (value: the version it upgrades to)."""


def upgrade(location: catalog.Location) -> int | None:
    """Upgrade the lake at ``location`` to this version, and add to its tables the columns
    of this tracedb's schema they lack; returns the version it had (None: it was of this
    version already). A lake of a newer or unknown version is refused
    (:class:`~tracedb.lake.catalog.LakeError`). The steps of :data:`STEPS` from its
    version on run in order, then the tables get this version's properties and the meta
    rows are set (last: a rerun after a crash runs the steps again, each of which finds
    its own work done)."""
    load = compact.own_tables(location)
    held = catalog.meta_rows(load(catalog.META))
    version = held.get(catalog.VERSION_KEY)
    known = version is not None and version.isdigit() and 1 <= int(version) <= catalog.LAKE_SCHEMA_VERSION
    if not known:
        raise catalog.LakeError(f"lake {location.where}: {catalog.version_problem(version, location.where)}")
    add_columns(load)
    if version == str(catalog.LAKE_SCHEMA_VERSION):
        return None
    buckets = catalog.lake_buckets(held)
    marker = {UPGRADED: str(catalog.LAKE_SCHEMA_VERSION)}
    for step in range(int(version), catalog.LAKE_SCHEMA_VERSION):
        STEPS[step](load, buckets, marker)
    for name in catalog.lake_tables():  # the properties of this version's tables (statistics, row groups)
        table = load(name)
        wanted = catalog.table_properties(name, catalog.lake_schema(name, catalog.lake_tables()[name]))
        if any(table.properties.get(k) != v for k, v in wanted.items()):
            with table.transaction() as tx:
                tx.set_properties(wanted)
    catalog.set_meta(
        load(catalog.META), {catalog.VERSION_KEY: str(catalog.LAKE_SCHEMA_VERSION), catalog.BUCKETS_KEY: str(buckets)}
    )
    return int(version)


def seq_into_traces(load: object, buckets: int, properties: dict[str, str]) -> bool:
    """1 → 2: ``traces`` rewritten with each row's lake seq stored in it (see the module's
    docstring); False when its current snapshot is such a rewrite already (a rerun)."""
    traces = load("traces")  # type: ignore[operator]
    marked = {s.snapshot_id for s in traces.metadata.snapshots if s.summary and s.summary[UPGRADED]}
    current = traces.current_snapshot()
    if current is None or current.snapshot_id in marked:
        return False
    compact.rewrite_traces(load, stored_from=marked, properties=properties, force=True)
    return True


def add_columns(load: object) -> dict[str, list[str]]:
    """Add to every lake table (tables from ``load(name)``) the columns of its lake schema
    (:func:`tracedb.lake.catalog.lake_schema` of the stored schema) it lacks, nullable, in
    one schema commit per table that lacks any; returns the columns added, per table."""
    added: dict[str, list[str]] = {}
    for name, schema in catalog.lake_tables().items():
        table = load(name)  # type: ignore[operator]
        have = set(table.schema().column_names)
        missing = [f for f in catalog.lake_schema(name, schema) if f.name not in have]
        if not missing:
            continue
        with table.update_schema() as update:
            update.union_by_name(pa.schema(missing))
        added[name] = [f.name for f in missing]
    return added


def rehome_segments(load: object, buckets: int, properties: dict[str, str]) -> bool:
    """Partition ``segments`` by ``bucket(buckets, lake_trace)`` and rewrite its rows as a
    version-3 write stores them (see the module's docstring), in one commit; False when
    every segments file is of that partitioning already (nothing done)."""
    table = load("segments")  # type: ignore[operator]
    if lake_files.bucket_of(table, catalog.SEGMENT_HOME) is None:
        with table.update_spec() as update:
            for part in table.spec().fields:
                update.remove_field(part.name)
            update.add_field(catalog.SEGMENT_HOME, BucketTransform(buckets), f"{catalog.SEGMENT_HOME}_bucket")
        table = load("segments")  # type: ignore[operator]
    spec = table.spec().spec_id
    old = lake_files.live_files(table)
    if all(f.spec_id == spec for f in old):
        return False
    nodes_table = load("nodes")  # type: ignore[operator]
    visible = visible_traces(load("traces"), columns=["trace_id"]).select(["trace_id", catalog.BATCH])  # type: ignore[operator]
    position = lake_files.bucket_of(nodes_table, "trace_id")
    nodes_files = lake_files.live_files(nodes_table)
    groups = sorted({f.partition[position[0]] for f in nodes_files}) if position is not None else [None]
    added = []
    con = lake_files.duck()
    try:
        con.register("vis", visible)
        for bucket in groups:
            chosen = [f for f in nodes_files if bucket is None or f.partition[position[0]] == bucket]
            nodes = lake_files.read(nodes_table, chosen, ["trace_id", "segment_id", catalog.BATCH])
            con.register("nodes_part", nodes)
            batch = catalog.BATCH
            homes = con.sql(
                f"SELECT n.segment_id, min(n.trace_id) AS home, arg_min(n.{batch}, n.trace_id) AS batch "
                f"FROM nodes_part n SEMI JOIN vis v ON n.trace_id = v.trace_id AND n.{batch} = v.{batch} "
                "GROUP BY n.segment_id"
            ).to_arrow_table()
            con.unregister("nodes_part")
            if not homes.num_rows:
                continue
            found = lake_files.read(
                table,
                lake_files.key_files(table, "segment_id", homes.column("segment_id").combine_chunks(), old),
                key=("segment_id", homes.column("segment_id").combine_chunks()),
            )
            added += _homed_files(table, con, homes, found)
    finally:
        con.close()
    replace_files(table, [f.data_file for f in old], added, properties)
    return True


def fill_policy_columns(load: object, buckets: int, properties: dict[str, str]) -> bool:
    """3 → 4: the schema-6 columns filled in the rows an older writer made (see the
    module's docstring and :mod:`tracedb.lake.policy_columns`); False when every row has
    them already (nothing written)."""
    filled = policy_columns.fill(load, properties=properties)
    return any(filled.values())


STEPS: dict[int, Callable[[object, int, dict[str, str]], bool]] = {
    1: seq_into_traces,
    2: rehome_segments,
    3: fill_policy_columns,
}
"""The upgrade from each version to the next, by the version it upgrades from: each takes
the table loader, the lake's bucket count and the summary properties marking its
rewrites, does nothing when it finds its work done (a rerun after a crash), and says
whether it did anything. A new layout version adds its step here (its new columns,
added by :func:`add_columns` before any step, filled in by it when they need more than
null)."""


def _homed_files(table: object, con: duckdb.DuckDBPyConnection, homes: pa.Table, found: pa.Table) -> list:
    """The data files of the segment rows ``found`` (each id once) homed as ``homes`` says."""
    mine = [c for c in (catalog.BATCH, catalog.SEGMENT_HOME) if c in found.column_names]
    con.register("homes", homes)
    con.register("found", found.drop_columns(mine))
    try:
        rows = con.sql(
            f"SELECT f.*, h.home AS {catalog.SEGMENT_HOME}, h.batch FROM "
            "(SELECT * FROM found QUALIFY row_number() OVER (PARTITION BY segment_id) = 1) f "
            "JOIN homes h USING (segment_id)"
        ).to_arrow_table()
    finally:
        con.unregister("homes")
        con.unregister("found")
    stamped = lake_rows("segments", rows.drop_columns(["batch"]), "")
    at = stamped.schema.get_field_index(catalog.BATCH)
    stamped = stamped.set_column(at, catalog.BATCH, rows.column("batch").cast(pa.string()))
    return data_files(table, stamped, compaction=True)  # rows of many writes: read as a compaction's


__all__ = ["STEPS", "UPGRADED", "add_columns", "fill_policy_columns", "rehome_segments", "seq_into_traces", "upgrade"]
