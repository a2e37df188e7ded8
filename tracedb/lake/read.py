"""Reading a lake: only what is visible, in the file store's schemas.

The rule: a trace is visible once its ``traces`` row is committed, and its rows in the
other tables are the ones written with that row (the same
:data:`~tracedb.lake.catalog.BATCH`); rows of writes that never committed their traces
row (a killed writer, a writer that lost the race for a trace id) are not shown. A
trace's ``seq`` is the sequence number of the snapshot that committed its traces row
(the data sequence number of the file holding it), so ``after=`` / the watermark mean
here what they mean in the file store. Segments are shown once each (concurrent writers
may store one twice) and only those a visible node uses; rejects once each; credit
sets once per name (the first written); credit values only of a set whose ``credit_sets``
row is visible (it is committed after them); a weight label's latest mapping
(``policy_labels``, :mod:`tracedb.lake.labels`). The rule is :func:`visible_rows`, which
:mod:`tracedb.lake.sqlscan` applies too.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
from pyiceberg.expressions import AlwaysTrue, BooleanExpression, In

from tracedb.lake import files as lake_files
from tracedb.lake import nulls
from tracedb.lake.catalog import BATCH, SEGMENT_HOME, batched, lake_tables, per_trace
from tracedb.lake.commit import compacted
from tracedb.lake.scan import scan_keys, visible_traces
from tracedb.selection import check_watermark
from tracedb.sqltext import quote_identifier

VISIBLE_SETS = "vis_sets"
"""The name :func:`visible_rows` reads the visible credit set names under."""
REJECT_KEY = ("source", "line", "trace_id", "node", "field", "reason", "record_sha256")
"""What makes two rejects one (a file pushed or ingested twice is rejected twice)."""


def _scan(table: Any) -> pa.Table:
    return lake_files.read(table, lake_files.live_files(table))


def trace_segments(
    table: Any,
    trace_ids: pa.Array | pa.ChunkedArray,
    segment_ids: pa.Array | pa.ChunkedArray,
    columns: Sequence[str] | None = None,
    files: list[str] | None = None,
    batches: pa.Array | pa.ChunkedArray | None = None,
) -> pa.Table:
    """The rows of ``segment_ids`` in the segments table ``table`` that traces of
    ``trace_ids`` use: read from the files of those traces' buckets (a write stores each
    segment beside the traces using it, :data:`~tracedb.lake.catalog.SEGMENT_HOME`), only
    the rows of those ids (a segment may show more than once); given the ``batches`` of
    those traces' visible rows, of a write's own files only those whose bounds of
    :data:`~tracedb.lake.catalog.BATCH` admit one (a write stores every segment its traces
    use in its own file of each of their buckets; a compaction's files hold any batch's);
    ``files`` (a list) gets the paths of the data files read."""
    ids = pa.array(pc.unique(segment_ids).to_pylist(), pa.binary())
    if not len(ids):
        return lake_files.read(table, [], columns)
    found = lake_files.live_files(table)
    traces = pc.unique(trace_ids).drop_null()
    buckets = lake_files.buckets(table, SEGMENT_HOME, traces.cast(pa.string()))
    where = lake_files.bucket_of(table, SEGMENT_HOME)
    if buckets is not None and where is not None:
        wanted = set(pc.unique(buckets).to_pylist())
        spec = table.spec().spec_id
        found = [f for f in found if f.spec_id != spec or f.partition[where[0]] in wanted]
    else:  # segments bucketed by their own id (an older layout): by key
        found = lake_files.key_files(table, "segment_id", ids, found)
    if batches is not None and BATCH in table.schema().column_names:
        writes = [f for f in found if not compacted(f.path)]
        kept = lake_files.key_files(table, BATCH, pc.unique(batches).drop_null().cast(pa.string()), writes)
        found = [f for f in found if compacted(f.path) or f in kept]
    if files is not None:
        files.extend(f.path for f in found)
    return lake_files.read(table, found, columns, key=("segment_id", ids))


def stored(name: str, table: pa.Table | None) -> pa.Table:
    """``table`` (rows read of lake table ``name``) in the stored schema of ``name``,
    every column nullable: the lake's column dropped, types cast, columns not read null;
    ``None`` (nothing read) an empty table."""
    schema = pa.schema([f.with_nullable(True) for f in lake_tables()[name]])
    if table is None:
        return schema.empty_table()
    columns = [
        table.column(f.name).cast(f.type) if f.name in table.column_names else pa.nulls(table.num_rows, f.type)
        for f in schema
    ]
    return nulls.decode(name, pa.Table.from_arrays(columns, schema=schema))


def visible(
    lake: Any,
    *,
    trace_ids: str | Sequence[str] | None = None,
    group: str | Sequence[str] | None = None,
    after: int | None = None,
) -> dict[str, pa.Table]:
    """Every lake table, by name, holding the visible rows of the selected traces (all
    when nothing is selected), in the stored schemas, ``traces`` ordered by ``seq`` then
    trace id. ``trace_ids`` and ``group`` filter the scans (the files of other trace ids'
    buckets are not read: :func:`~tracedb.lake.scan.scan_keys`; ``group`` a row filter);
    ``after`` keeps traces of ``seq > after`` (ValueError, the file store's, unless an int
    >= 0); a str ``trace_ids`` or ``group`` is one."""
    if after is not None:
        check_watermark("after", after)
    selected = trace_ids is not None or group is not None
    row_filter: BooleanExpression = AlwaysTrue()
    if group is not None:
        row_filter = In("group_id", [group] if isinstance(group, str) else list(group))
    ids = None if trace_ids is None else [trace_ids] if isinstance(trace_ids, str) else list(trace_ids)
    traces = visible_traces(lake.table("traces"), row_filter, trace_ids=ids)  # ids read by key
    if after is not None:  # on the visible rows: a trace committed at or before `after` is not taken
        traces = traces.filter(pc.greater(traces.column("seq"), after))
    con = lake_files.duck()
    con.register("vis", traces)
    ids = traces.column("trace_id").to_pylist()
    out: dict[str, pa.Table] = {"traces": stored("traces", traces)}
    schemas = lake_tables()
    for name, schema in schemas.items():
        if name in ("traces", "segments"):
            continue
        if per_trace(name, schema):
            raw = scan_keys(lake.table(name), "trace_id", ids) if selected else _scan(lake.table(name))
        elif name == "episodes" and selected:  # the row a full read shows (visible_episodes)
            episodes = [e for e in traces.column("episode_id").to_pylist() if e is not None]
            raw = scan_keys(lake.table(name), "episode_id", episodes)
            out[name] = stored(name, visible_episodes(con, lake, raw, traces))
            continue
        else:
            raw = _scan(lake.table(name))
            if name == "rejects" and selected:
                raw = raw.filter(pc.is_in(raw.column("trace_id"), value_set=pa.array(ids, pa.string())))
        out[name] = stored(name, visible_rows(con, name, raw))
        if name == "credit_sets":
            con.register(VISIBLE_SETS, out[name].select(["name"]))
    used = pc.unique(out["nodes"].column("segment_id"))
    table = lake.table("segments")
    raw = trace_segments(table, out["nodes"].column("trace_id"), used) if selected else _scan(table)
    out["segments"] = stored("segments", visible_segments(con, raw, used.to_pylist()))
    con.close()
    return {name: out[name] for name in schemas}


def visible_rows(con: duckdb.DuckDBPyConnection, name: str, raw: pa.Table) -> pa.Table:
    """The visibility rule on rows ``raw`` read of table ``name`` (not ``traces`` or
    ``segments``): rows of a trace are those written with its visible traces row (``vis``,
    registered in ``con``, with :data:`BATCH`); an episode once, from a write of one of its
    visible traces; rejects and credit sets once each (the first); credit values only of
    sets whose ``credit_sets`` row is visible (:data:`VISIBLE_SETS`, registered in
    ``con``): a set being written, or whose writer died, shows nothing."""
    schema = lake_tables()[name]
    con.register("raw", raw)
    try:
        if per_trace(name, schema):
            query = f"SELECT r.* FROM raw r SEMI JOIN vis v ON r.trace_id = v.trace_id AND r.{BATCH} = v.{BATCH}"
            if "credit_set" in schema.names:
                query += f" SEMI JOIN {VISIBLE_SETS} s ON r.credit_set = s.name"
        elif name == "episodes":
            order = "r.ingested_at, " if "ingested_at" in raw.column_names else ""
            query = (
                f"SELECT r.* FROM raw r SEMI JOIN vis v ON r.episode_id = v.episode_id AND r.{BATCH} = v.{BATCH} "
                f"QUALIFY row_number() OVER (PARTITION BY r.episode_id ORDER BY {order}r.{BATCH}) = 1"
            )
        elif name == "rejects":
            key = ", ".join(quote_identifier(c) for c in REJECT_KEY)
            query = f"SELECT * FROM raw QUALIFY row_number() OVER (PARTITION BY {key} ORDER BY rejected_at) = 1"
        elif name == "credit_sets":
            query = "SELECT * FROM raw QUALIFY row_number() OVER (PARTITION BY name ORDER BY created_at) = 1"
        elif name == "policy_labels":  # a label mapped again: the latest mapping
            query = "SELECT * FROM raw QUALIFY row_number() OVER (PARTITION BY label ORDER BY set_at DESC) = 1"
        else:
            query = "SELECT * FROM raw"
        return con.sql(query).to_arrow_table()
    finally:
        con.unregister("raw")


def visible_episodes(con: duckdb.DuckDBPyConnection, lake: Any, raw: pa.Table, vis: pa.Table) -> pa.Table:
    """The visible rows of the episodes read in ``raw`` (every row of their ids, with
    ``episode_id``, :data:`BATCH` and ``ingested_at`` if the table has it), of which
    ``vis`` (registered in ``con`` as ``vis``) holds some visible traces rows: decided
    as over every visible trace (:func:`visible_rows`), the first row by ingest time
    then write of the writes of a visible trace of the episode. ``vis`` decides it for
    an episode whose first row is of a write of one of its traces; for any other, that
    episode's visible traces are read (by episode id), so a reader of some of an
    episode's traces shows the row a reader of all of them does. ``vis`` is registered
    again after."""
    pairs = vis.select(["trace_id", BATCH, "episode_id"])
    order = "r.ingested_at, " if "ingested_at" in raw.column_names else ""
    con.register("ep_raw", raw)
    con.register("ep_vis", pairs)
    try:
        unsure = con.sql(
            f"SELECT episode_id FROM (SELECT r.episode_id, EXISTS (SELECT 1 FROM ep_vis v WHERE v.episode_id = "
            f"r.episode_id AND v.{BATCH} = r.{BATCH}) AS seen, row_number() OVER (PARTITION BY r.episode_id "
            f"ORDER BY {order}r.{BATCH}) AS k FROM ep_raw r) WHERE k = 1 AND NOT seen"
        ).fetchall()
    finally:
        con.unregister("ep_raw")
        con.unregister("ep_vis")
    if unsure:  # a row of another write comes first: is a trace of that write visible?
        mates = visible_traces(lake.table("traces"), In("episode_id", sorted(r[0] for r in unsure)))
        pairs = pa.concat_tables([pairs, mates.select(pairs.column_names).cast(pairs.schema)])
    con.register("vis", pairs)
    try:
        return visible_rows(con, "episodes", raw)
    finally:
        con.register("vis", vis)


def visible_segments(con: duckdb.DuckDBPyConnection, raw: pa.Table, used: Iterable[bytes]) -> pa.Table:
    """The rows of ``raw`` (segments read) that readers see: the segments ``used`` (by
    visible nodes), each once (concurrent writers may store one twice)."""
    con.register("raw", raw)
    con.register("used", pa.table({"segment_id": pa.array(sorted(used), pa.binary())}))
    try:
        return con.sql(
            "SELECT * FROM raw SEMI JOIN used USING (segment_id) "
            "QUALIFY row_number() OVER (PARTITION BY segment_id) = 1"
        ).to_arrow_table()
    finally:
        con.unregister("raw")
        con.unregister("used")


__all__ = [
    "BATCH",
    "VISIBLE_SETS",
    "batched",
    "stored",
    "trace_segments",
    "visible",
    "visible_rows",
    "visible_segments",
]
