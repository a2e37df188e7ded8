"""Branch-spread token views, built from DuckDB's Arrow columns by compiled loops.

The rule is verifiers' ``Branch.spread`` (see ``schema/macros.sql`` for the same rule in
SQL): along a root-to-leaf path ``token_ids`` and ``sampled_mask`` concatenate; a compact
stream lands on its node's sampled positions in order, 0.0 elsewhere, extra values
dropped and missing ones 0.0; a stream is null for a branch when no node on its path
holds it. ``loss_weights`` maps every name some node on the path holds to its spread.

The nodes, segments and branches of the selection are read once (in one read
transaction; a whole-database read takes the segments on a second cursor) and kept as
DuckDB returned them; ``tracedb._kernels`` then writes each output column in one pass,
straight from those columns. Nothing is widened per node first: each output byte is
written once.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tracedb import _buffers
from tracedb.models import COMPACT_STREAMS

if TYPE_CHECKING:
    import polars

    from tracedb.store import Database

BRANCH_SCHEMA = pa.schema(
    [
        pa.field("trace_id", pa.string(), nullable=False),
        pa.field("branch_index", pa.int32(), nullable=False),
        pa.field("trainable", pa.bool_(), nullable=False),
        pa.field("token_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("sampled_mask", pa.list_(pa.bool_()), nullable=False),
        pa.field("logprobs", pa.list_(pa.float32()), nullable=False),
        pa.field("advantages", pa.list_(pa.float32())),
        pa.field("reference_logprobs", pa.list_(pa.float32())),
        pa.field("trainer_logprobs", pa.list_(pa.float32())),
        pa.field("entropies", pa.list_(pa.float32())),
        pa.field("loss_weights", pa.map_(pa.string(), pa.list_(pa.float32())), nullable=False),
    ]
)
"""The one definition of a branch view's Arrow schema (``db.branches()``, exports, REST)."""

TOKEN_COLUMNS = ("token_ids", "sampled_mask", *COMPACT_STREAMS, "loss_weights")
KEY_COLUMNS = ("trace_id", "branch_index")
_CACHE_TOKENS = 200_000_000  # do not keep decoded nodes of selections larger than this


def _select_traces(
    db: Database,
    trace_ids: Sequence[str] | None,
    group: str | Sequence[str] | None,
    episode: str | Sequence[str] | None,
) -> list[tuple[str, int]]:
    """(trace id, stored tokens) of the selected traces, in trace id order."""
    where, params = [], []
    for column, value in (("trace_id", trace_ids), ("group_id", group), ("episode_id", episode)):
        if value is None:
            continue
        values = [value] if isinstance(value, str) else list(value)
        where.append(f"{column} IN (SELECT unnest(?::VARCHAR[]))")
        params.append(values)
    query = "SELECT trace_id, n_tokens FROM traces"
    if where:
        query += " WHERE " + " AND ".join(where)
    query += " ORDER BY trace_id"
    return [(r[0], r[1]) for r in db.con.execute(query, params).fetchall()]


@dataclass
class _Stream:
    """One compact stream of the loaded nodes, as DuckDB returned it."""

    values: np.ndarray  # float32, every node's values back to back
    src: np.ndarray  # int64 per node row: offset of its values
    take: np.ndarray  # int64 per node row: values it spreads (extra ones are dropped)
    has: np.ndarray  # bool per node row: holds the stream (not None)


@dataclass
class _Nodes:
    """The selected traces' nodes, node-ordered, in the columns the kernels read."""

    base: dict[str, int]  # trace id -> row of its node 0
    n_tok: np.ndarray  # int64 per node row
    starts: np.ndarray  # int64 per node row + 1: token offset of each node, node-flat
    tok_src: np.ndarray  # int64 per node row: offset of its tokens in seg_values
    seg_values: np.ndarray  # int32: the segments' tokens
    prefix: np.ndarray  # int64 per node row: leading unsampled tokens, -1 if not canonical
    slot_src: np.ndarray  # int64 per node row: offset of its mask slots
    slots: np.ndarray  # int32: mask slots of the non-canonical nodes
    streams: dict[str, _Stream]
    loss_weights: list[Any]  # per node: None or list of (name, values)
    branches: pa.Table  # trace_id, branch_index, trainable, path (sorted)
    _mask: np.ndarray | None = None

    @property
    def mask(self) -> np.ndarray:
        """Node-flat sampled mask (every node once, in row order)."""
        if self._mask is None:
            n = len(self.n_tok)
            rows = np.arange(n, dtype=np.int64)
            tokens = np.empty(int(self.starts[-1]), np.int32)
            self._mask = np.empty(len(tokens), np.bool_)
            _kernels().spread_tokens(
                0, n, np.arange(n + 1, dtype=np.int64), rows, np.ones(n, np.bool_), self.starts, self.n_tok,
                self.tok_src, self.seg_values, self.prefix, self.slot_src, self.slots, tokens, self._mask,
            )  # fmt: skip
        return self._mask


def _kernels() -> Any:
    from tracedb import _kernels

    return _kernels


_POOL: ThreadPoolExecutor | None = None  # reads the segments beside the main read


def _forget_pool() -> None:
    global _POOL
    _POOL = None  # a forked child inherits the pool but not its threads


os.register_at_fork(after_in_child=_forget_pool)


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="tracedb")
    return _POOL


_Parts = tuple[np.ndarray, np.ndarray, np.ndarray]  # values, offsets (rows + 1) into values, validity


def _sql(con: Any, query: str, params: list[Any] | None = None) -> pa.Table:
    return con.sql(query, params=params).to_arrow_table()


def _load(db: Database, trace_ids: list[str] | None, streams: Sequence[str], credit: str | None = None) -> _Nodes:
    """Read the nodes, segments and branches of the selected traces (``None``: all of
    them) in one read transaction, so the queries see one state of the database.

    A whole-database read takes list columns flat (see :func:`_read_all`) and the
    segments' tokens on a second cursor, side by side with the rest: segments are
    content-addressed and never change, so another snapshot can only hold more of them;
    a node whose segment it lacks (written in between) makes the tokens be read again.
    Inside a transaction already open on the connection (tracedb's or the user's own
    ``BEGIN``) everything is read there, on that connection, and it is left open.
    """
    node_streams = [s for s in streams if not (s == "advantages" and credit is not None)]
    con = db.con
    first, ordered = con.execute(
        "SELECT current_transaction_id(), current_setting('preserve_insertion_order')"
    ).fetchall()[0]
    # In autocommit every statement is a transaction of its own: the same id twice means
    # a transaction is open.
    own = not db._in_transaction and con.execute("SELECT current_transaction_id()").fetchall()[0][0] != first
    flat = trace_ids is None and bool(ordered)  # flat reads pair two scans by row order
    where = ""
    if trace_ids is not None:
        con.register("_tdb_sel", pa.table({"trace_id": pa.array(trace_ids, pa.string())}))
        where = " WHERE trace_id IN (SELECT trace_id FROM _tdb_sel)"
    apart = _pool().submit(_read_segments, db.cursor(), True) if flat and own else None
    try:
        if own:
            con.execute("BEGIN TRANSACTION")
        try:
            if flat:
                nodes, lists = _read_all(con, node_streams)
                segments = None if apart else _read_segments(con, False)
            else:
                nodes, segments, lists = _read_lists(con, node_streams, where)
            branches = _sql(
                con,
                f"SELECT trace_id, branch_index, trainable, path FROM branches{where} ORDER BY trace_id, branch_index",
            )
            credit_rows = None
            if credit is not None and "advantages" in streams:
                credit_rows = _sql(
                    con,
                    "SELECT trace_id, node_index, value, advantages FROM credit WHERE credit_set = ?"
                    + where.replace(" WHERE ", " AND "),
                    [credit],
                )
        except BaseException:
            if own:
                con.execute("ROLLBACK")
            raise
        else:
            if own:
                con.execute("COMMIT")
    finally:
        if trace_ids is not None:
            con.unregister("_tdb_sel")
        if apart is not None:
            wait([apart])  # never leave the side read running; its error is raised below
    if apart is not None:
        segments = apart.result()
    try:
        return _decode(nodes, segments, lists, branches, credit_rows, streams)
    except _MissingSegment:  # the segments were read before a write that added some
        return _decode(nodes, _read_segments(db.cursor(), True), lists, branches, credit_rows, streams)


class _MissingSegment(Exception):
    pass


_SEGMENT_LOOKUP = 1000  # segments of a selection looked up by a literal IN list up to this many

_META = "trace_id, node_index, n_tokens, n_sampled, mask_prefix, mask_slots, loss_weights, segment_id"


def _read_all(con: Any, streams: Sequence[str]) -> tuple[pa.Table, dict[str, _Parts]]:
    """Every node. List columns are read flat with ``unnest`` (DuckDB hands over flat
    values several times faster than lists) and cut by the row lengths that a plain scan
    of the same table returns in the same order (both keep insertion order)."""
    lengths = "".join(f', len({s}) AS "len:{s}"' for s in streams)
    nodes = _sql(con, f"SELECT {_META}{lengths} FROM nodes")
    lists = {
        s: _flat_column(con, f"SELECT unnest({s}) FROM nodes", nodes.column(f"len:{s}"), np.float32) for s in streams
    }
    return nodes, lists


def _read_segments(con: Any, own_cursor: bool) -> tuple[pa.ChunkedArray, _Parts]:
    """Every segment: (ids, tokens), read flat like the node lists."""
    try:
        if own_cursor:
            con.execute("BEGIN TRANSACTION")
        segments = _sql(con, "SELECT segment_id, n_tokens FROM segments")
        tokens = _flat_column(con, "SELECT unnest(token_ids) FROM segments", segments.column("n_tokens"), np.int32)
        if own_cursor:
            con.execute("COMMIT")
        return segments.column("segment_id"), tokens
    finally:
        if own_cursor:
            con.close()


_STREAM_ROWS = 1 << 16
"""Rows per batch of a flat read: DuckDB's result buffers then stay small enough for the
C allocator to reuse, instead of ~30 MB of fresh pages per read (measured: tokens and
logprobs of the benchmark database read in ~28 ms with ~0 page faults, ~40 ms with ~4k)."""


def _flat_column(con: Any, query: str, lengths: pa.ChunkedArray, dtype: type) -> _Parts:
    """The values of ``query`` (one column of ``dtype``), cut by ``lengths``; streamed
    batch by batch into one array (:mod:`tracedb._buffers`)."""
    valid = lengths.is_valid().to_numpy(zero_copy_only=False)
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(pc.fill_null(lengths, 0).to_numpy(zero_copy_only=False), out=offsets[1:])
    total = int(offsets[-1])
    values = _buffers.empty(total, dtype)
    pos = end = 0
    for batch in con.sql(query).to_arrow_reader(_STREAM_ROWS):
        part = batch.column(0).to_numpy(zero_copy_only=False)
        end = pos + len(part)
        if end > total:
            break
        values[pos:end] = part
        pos = end
    if end != total:  # cannot happen within one transaction; never misalign silently
        raise RuntimeError(f"{query!r} returned other than the {total} values its rows hold")
    return values, offsets, valid


def _read_lists(
    con: Any, streams: Sequence[str], where: str
) -> tuple[pa.Table, tuple[pa.ChunkedArray, _Parts], dict[str, _Parts]]:
    """The nodes (``where``: of the traces in ``_tdb_sel``) and their segments, with list
    columns as lists: each row carries its own values, so no row order is relied on (a
    selection filters with a join, which keeps none; ``preserve_insertion_order`` may be
    off)."""
    columns = "".join(f", {s}" for s in streams)
    nodes = _sql(con, f"SELECT {_META}{columns} FROM nodes{where}")
    if not where:
        segments = _sql(con, "SELECT segment_id, token_ids FROM segments")
    else:
        # The segments these nodes name: a short literal list is looked up through the
        # key's index (~3x faster than a join for one trace); a long one is joined.
        wanted = pc.unique(nodes.column("segment_id").combine_chunks())
        if len(wanted) <= _SEGMENT_LOOKUP:
            marks = ", ".join("?" * len(wanted)) or "NULL"
            segments = _sql(
                con, f"SELECT segment_id, token_ids FROM segments WHERE segment_id IN ({marks})", wanted.to_pylist()
            )
        else:
            con.register("_tdb_segs", pa.table({"segment_id": wanted}))
            try:
                segments = _sql(
                    con, "SELECT s.segment_id, s.token_ids FROM segments s SEMI JOIN _tdb_segs USING (segment_id)"
                )
            finally:
                con.unregister("_tdb_segs")
    lists = {s: _list_parts(nodes.column(s)) for s in streams}
    return nodes, (segments.column("segment_id"), _list_parts(segments.column("token_ids"))), lists


def _node_ordered(nodes: pa.Table) -> bool:
    """True when each trace's nodes are one run in node order (as ingest writes them),
    so the rows need no sort: node_index is 0 where the trace changes and +1 elsewhere."""
    if nodes.num_rows == 0:
        return True
    codes = pc.dictionary_encode(nodes.column("trace_id")).combine_chunks().indices.to_numpy()
    index = nodes.column("node_index").to_numpy()
    change = np.ones(len(codes), bool)
    change[1:] = codes[1:] != codes[:-1]
    if change.sum() != len(np.unique(codes)):  # a trace split over several runs
        return False
    expected = np.arange(len(index)) - np.maximum.accumulate(np.where(change, np.arange(len(index)), 0))
    return bool(np.array_equal(index, expected))


def trace_bases(trace_col: pa.Array) -> dict[str, int]:
    """Trace id -> row of its first node, for node rows grouped by trace (node-ordered)."""
    if not len(trace_col):
        return {}
    codes = pc.dictionary_encode(trace_col).indices.to_numpy()
    firsts = np.flatnonzero(np.concatenate([[True], codes[1:] != codes[:-1]]))
    return dict(zip(trace_col.take(pa.array(firsts, pa.int64())).to_pylist(), firsts.tolist()))


def _list_parts(col: pa.ChunkedArray) -> _Parts:
    """(values, offsets, validity) of a list column; offsets index ``values`` directly."""
    arr = col.combine_chunks()
    offsets = arr.offsets.to_numpy().astype(np.int64)
    values = arr.values.to_numpy(zero_copy_only=False)
    valid = arr.is_valid().to_numpy(zero_copy_only=False) if arr.null_count else np.ones(len(arr), bool)
    return values, offsets, valid


def _decode(
    nodes: pa.Table,
    segments: tuple[pa.ChunkedArray, _Parts],
    lists: dict[str, _Parts],
    branches: pa.Table,
    credit_rows: pa.Table | None,
    streams: Sequence[str],
) -> _Nodes:
    # Rows are used in (trace, node) order; per-row arrays are permuted into it when the
    # scan returned another order (the flat values stay where they are).
    perm = None
    if not _node_ordered(nodes):
        keys = [("trace_id", "ascending"), ("node_index", "ascending")]
        perm = pc.sort_indices(nodes.select(["trace_id", "node_index"]), sort_keys=keys).to_numpy()

    def rows(a: np.ndarray) -> np.ndarray:
        return a if perm is None else a[perm]

    n_rows = nodes.num_rows
    trace_col = nodes.column("trace_id").combine_chunks()
    if perm is not None:
        trace_col = trace_col.take(pa.array(perm))
    base = trace_bases(trace_col)
    n_tok = rows(nodes.column("n_tokens").to_numpy().astype(np.int64))
    n_sampled_scan = nodes.column("n_sampled").to_numpy().astype(np.int64)
    n_sampled = rows(n_sampled_scan)
    starts = np.zeros(n_rows + 1, np.int64)
    np.cumsum(n_tok, out=starts[1:])

    seg_ids, (seg_values, seg_offsets, _) = segments
    seg_row = pc.index_in(nodes.column("segment_id"), value_set=seg_ids.combine_chunks())
    if seg_row.null_count:
        raise _MissingSegment
    tok_src = rows(seg_offsets[:-1][seg_row.to_numpy(zero_copy_only=False).astype(np.int64)])
    prefix = rows(pc.fill_null(nodes.column("mask_prefix"), -1).to_numpy().astype(np.int64))
    slots, slot_off, _ = _list_parts(nodes.column("mask_slots"))

    decoded: dict[str, _Stream] = {}
    for name in streams:
        if name == "advantages" and credit_rows is not None:
            decoded[name] = _credit_stream(credit_rows, base, n_sampled)
            continue
        values, offsets, valid = lists[name]
        take = np.where(valid, np.minimum(np.diff(offsets), n_sampled_scan), 0)
        decoded[name] = _Stream(values.astype(np.float32, copy=False), rows(offsets[:-1]), rows(take), rows(valid))
    lw = nodes.column("loss_weights")
    loss_weights = lw.to_pylist() if lw.null_count < len(lw) else [None] * n_rows
    if perm is not None:
        loss_weights = [loss_weights[i] for i in perm.tolist()]
    return _Nodes(
        base=base,
        n_tok=n_tok,
        starts=starts,
        tok_src=tok_src,
        seg_values=seg_values.astype(np.int32, copy=False),
        prefix=prefix,
        slot_src=rows(slot_off[:-1]),
        slots=slots.astype(np.int32, copy=False),
        streams=decoded,
        loss_weights=loss_weights,
        branches=branches,
    )


def _credit_stream(credit_rows: pa.Table, base: dict[str, int], n_sampled: np.ndarray) -> _Stream:
    """Advantages of a named credit set: a row holds a list or one value broadcast over
    the node's sampled tokens; a node without a row (or with neither) is unassigned."""
    n_rows = len(n_sampled)
    first = np.fromiter((base.get(t, -1) for t in credit_rows.column("trace_id").to_pylist()), np.int64)
    index = credit_rows.column("node_index").to_numpy().astype(np.int64)
    # A row naming no node of the selection (an unknown trace or node) is ignored, as a
    # join would; it never lands on another node's row.
    bounds = np.array(sorted(base.values()) + [n_rows], np.int64)
    end = bounds[np.searchsorted(bounds, first, side="right").clip(max=len(bounds) - 1)]
    known = (first >= 0) & (index >= 0) & (first + index < end)
    if not known.all():
        credit_rows, first, index = credit_rows.filter(pa.array(known)), first[known], index[known]
    node = first + index
    values, offsets, listed = _list_parts(credit_rows.column("advantages"))
    value = credit_rows.column("value")
    scalar = value.is_valid().to_numpy(zero_copy_only=False) & ~listed
    # Broadcast values go after the listed ones, n_sampled of each.
    counts = n_sampled[node[scalar]]
    broadcast = np.repeat(pc.fill_null(value, 0.0).to_numpy().astype(np.float32)[scalar], counts)
    src = np.zeros(n_rows, np.int64)
    take = np.zeros(n_rows, np.int64)
    has = np.zeros(n_rows, bool)
    src[node[listed]] = offsets[:-1][listed]
    take[node[listed]] = np.minimum(np.diff(offsets)[listed], n_sampled[node[listed]])
    first = np.zeros(len(counts), np.int64)
    np.cumsum(counts[:-1], out=first[1:])
    src[node[scalar]] = len(values) + first
    take[node[scalar]] = counts
    has[node[listed | scalar]] = True
    return _Stream(np.concatenate([values.astype(np.float32, copy=False), broadcast]), src, take, has)


def _list(values: np.ndarray, offsets: pa.Array, value_type: pa.DataType, valid: np.ndarray | None = None) -> pa.Array:
    mask = None if valid is None or valid.all() else pa.array(~valid)
    if value_type == pa.bool_():  # numpy packs the bitmap several times faster than pa.array
        bits = pa.py_buffer(np.packbits(values, bitorder="little"))
        flat = pa.BooleanArray.from_buffers(pa.bool_(), len(values), [None, bits])
    elif isinstance(values.base, pa.Buffer):  # written by a kernel into _buffers.empty's buffer: no copy
        flat = pa.Array.from_buffers(value_type, len(values), [None, values.base])
    else:
        flat = pa.array(values, value_type)
    return pa.ListArray.from_arrays(offsets, flat, mask=mask)


def _path_rows(data: _Nodes, br: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """(path_off, path_rows): each branch's nodes as node rows, back to back."""
    path = br.column("path").combine_chunks()
    if len(path) == 0:
        return np.zeros(1, np.int64), np.zeros(0, np.int64)
    path_off = path.offsets.to_numpy().astype(np.int64)
    nodes = path.values.to_numpy(zero_copy_only=False).astype(np.int64)[path_off[0] : path_off[-1]]
    path_off = path_off - path_off[0]
    bases = np.fromiter((data.base[t] for t in br.column("trace_id").to_pylist()), np.int64, br.num_rows)
    return path_off, nodes + np.repeat(bases, np.diff(path_off))


def _per_branch_sum(path_off: np.ndarray, per_entry: np.ndarray) -> np.ndarray:
    """Sum of ``per_entry`` over each branch's path entries (empty paths give 0)."""
    acc = np.zeros(len(per_entry) + 1, np.int64)
    np.cumsum(per_entry, out=acc[1:])
    return acc[path_off[1:]] - acc[path_off[:-1]]


def _branch_tables(
    data: _Nodes,
    columns: Sequence[str],
    train_once: bool,
    trainable: bool | None,
    branch_index: list[int] | None = None,
) -> pa.Table:
    br = data.branches
    if trainable is not None:
        br = br.filter(pc.equal(br.column("trainable"), trainable))
    if branch_index is not None:
        br = br.filter(pc.is_in(br.column("branch_index"), value_set=pa.array(branch_index, pa.int32())))
    n_branches = br.num_rows
    path_off, path_rows = _path_rows(data, br)
    out_off = np.zeros(n_branches + 1, np.int64)
    np.cumsum(_per_branch_sum(path_off, data.n_tok[path_rows]), out=out_off[1:])
    total = int(out_off[-1])
    if total >= 2**31:
        raise ValueError("a view over more than 2**31 tokens: select fewer traces (or export, which streams)")
    offsets = pa.array(out_off.astype(np.int32))
    kernels = _kernels()

    out: dict[str, pa.Array] = {
        "trace_id": br.column("trace_id").combine_chunks(),
        "branch_index": br.column("branch_index").combine_chunks(),
        "trainable": br.column("trainable").combine_chunks(),
    }
    if "token_ids" in columns or "sampled_mask" in columns:
        keep = _first_use(data, br) if train_once else np.ones(len(path_rows), np.bool_)
        tokens = _buffers.empty(total, np.int32)
        mask = _buffers.empty(total, np.bool_)
        kernels.spread_tokens(
            0, n_branches, path_off, path_rows, keep, out_off, data.n_tok, data.tok_src, data.seg_values,
            data.prefix, data.slot_src, data.slots, tokens, mask,
        )  # fmt: skip
        out["token_ids"] = _list(tokens, offsets, pa.int32())
        out["sampled_mask"] = _list(mask, offsets, pa.bool_())
    for name in columns:
        if name not in data.streams:
            continue
        stream = data.streams[name]
        values = _buffers.empty(total, np.float32)
        kernels.spread_stream(
            0, n_branches, path_off, path_rows, out_off, data.n_tok, data.prefix, data.slot_src, data.slots,
            stream.src, stream.take, stream.values, values,
        )  # fmt: skip
        held = None if name == "logprobs" else _per_branch_sum(path_off, stream.has[path_rows]) > 0
        out[name] = _list(values, offsets, pa.float32(), held)
    if "loss_weights" in columns:
        out["loss_weights"] = _loss_weights(data, path_off, path_rows)
    fields = [BRANCH_SCHEMA.field(c) for c in ("trace_id", "branch_index", "trainable", *columns)]
    return pa.Table.from_arrays([out[f.name] for f in fields], schema=pa.schema(fields))


def _first_use(data: _Nodes, br: pa.Table) -> np.ndarray:
    """Per path entry of ``br``: True where this branch is its node's first trainable
    branch (the first branch at all when none containing it is trainable)."""
    every = data.branches
    all_off, all_rows = _path_rows(data, every)
    n_all = every.num_rows
    # Preference rank of each branch: trainable ones first, each kind in view order.
    trainable = every.column("trainable").to_numpy(zero_copy_only=False).astype(bool)
    order = np.argsort(~trainable, kind="stable")
    rank = np.empty(n_all, np.int64)
    rank[order] = np.arange(n_all)
    entry_rank = np.repeat(rank, np.diff(all_off))
    best = np.full(len(data.n_tok), n_all, np.int64)
    np.minimum.at(best, all_rows, entry_rank)
    # The same ranks for the (possibly filtered) branches in ``br``.
    key = {
        (t, b): i
        for i, (t, b) in enumerate(zip(every.column("trace_id").to_pylist(), every.column("branch_index").to_pylist()))
    }
    own = np.fromiter(
        (rank[key[(t, b)]] for t, b in zip(br.column("trace_id").to_pylist(), br.column("branch_index").to_pylist())),
        np.int64,
        br.num_rows,
    )
    path_off, path_rows = _path_rows(data, br)
    return best[path_rows] == np.repeat(own, np.diff(path_off))


def _loss_weights(data: _Nodes, path_off: np.ndarray, path_rows: np.ndarray) -> pa.Array:
    entries = []
    for b in range(len(path_off) - 1):
        rows = path_rows[path_off[b] : path_off[b + 1]].tolist()
        per_node = [dict(data.loss_weights[r]) if data.loss_weights[r] is not None else {} for r in rows]
        names = sorted({k for d in per_node for k in d})
        branch = []
        for name in names:
            parts = [
                np.asarray(d[name], np.float32) if name in d else np.zeros(int(data.n_tok[r]), np.float32)
                for r, d in zip(rows, per_node)
            ]
            branch.append((name, np.concatenate(parts) if parts else np.zeros(0, np.float32)))
        entries.append(branch)
    return pa.array(entries, type=BRANCH_SCHEMA.field("loss_weights").type)


def _columns(columns: Sequence[str] | None) -> list[str]:
    if columns is None:
        return list(TOKEN_COLUMNS)
    unknown = [c for c in columns if c not in BRANCH_SCHEMA.names]
    if unknown:
        raise ValueError(f"unknown column(s) {unknown}; a branch view has {BRANCH_SCHEMA.names}")
    return [c for c in TOKEN_COLUMNS if c in columns]


def iter_branches(
    db: Database,
    *,
    trace_ids: Sequence[str] | None = None,
    group: str | Sequence[str] | None = None,
    episode: str | Sequence[str] | None = None,
    trainable: bool | None = None,
    branch_index: int | Sequence[int] | None = None,
    columns: Sequence[str] | None = None,
    train_once: bool = False,
    credit: str | None = None,
    batch_tokens: int = 16_000_000,
) -> Iterator[pa.Table]:
    """Branch views in batches of whole traces, about ``batch_tokens`` stored tokens each.

    Memory stays bounded by the batch size whatever the database size: this is what
    exports stream from.
    """
    cols = _columns(columns)
    credit = db._credit_name(credit)
    indices = _branch_indices(branch_index)
    selected = _select_traces(db, trace_ids, group, episode)
    everything = trace_ids is None and group is None and episode is None
    if everything and sum(size for _, size in selected) < batch_tokens:  # one batch: the whole-database read
        yield _view(db, None, cols, train_once, trainable, indices, credit, cache=False)
        return
    chunk: list[str] = []
    acc = 0
    for tid, size in selected:
        chunk.append(tid)
        acc += size
        if acc >= batch_tokens:
            yield _view(db, chunk, cols, train_once, trainable, indices, credit, cache=False)
            chunk, acc = [], 0
    if chunk or not selected:
        yield _view(db, chunk, cols, train_once, trainable, indices, credit, cache=False)


def _view(
    db: Database,
    trace_ids: list[str] | None,
    cols: list[str],
    train_once: bool,
    trainable: bool | None,
    branch_index: list[int] | None,
    credit: str | None,
    cache: bool,
) -> pa.Table:
    streams = [c for c in COMPACT_STREAMS if c in cols]
    key = (db._generation, None if trace_ids is None else tuple(trace_ids), credit)
    data = None
    if cache and db._cache is not None and db._cache[0] == key and set(streams) <= set(db._cache[1].streams):
        data = db._cache[1]
    if data is None:
        data = _load(db, trace_ids, streams, credit)
        if cache and data.starts[-1] <= _CACHE_TOKENS:
            db._cache = (key, data)
    return _branch_tables(data, cols, train_once, trainable, branch_index)


def branches(
    db: Database,
    *,
    trace_ids: Sequence[str] | None = None,
    group: str | Sequence[str] | None = None,
    episode: str | Sequence[str] | None = None,
    trainable: bool | None = None,
    branch_index: int | Sequence[int] | None = None,
    columns: Sequence[str] | None = None,
    train_once: bool = False,
    credit: str | None = None,
) -> pa.Table:
    """One row per branch of the selected traces, ordered by trace id then branch index.

    ``trace_ids``, ``group`` (``episode.group.id``) and ``episode`` select traces;
    ``trainable=True`` keeps only trainable branches, ``branch_index`` only the branches of
    that index (or indices; verifiers' ``Branch.index``). ``columns`` picks token columns
    (``trace_id``, ``branch_index`` and ``trainable`` are always there). ``train_once``
    leaves a shared node's sampled tokens in the mask of its first trainable branch only.
    ``credit="name"`` reads advantages from that credit set (default: the ingested set).
    Decoded node columns are cached on ``db`` until its next write, so repeated views of
    the same selection skip the database.
    """
    cols = _columns(columns)
    credit = db._credit_name(credit)
    selected = None
    if trace_ids is not None or group is not None or episode is not None:
        selected = [tid for tid, _ in _select_traces(db, trace_ids, group, episode)]
    return _view(db, selected, cols, train_once, trainable, _branch_indices(branch_index), credit, cache=True)


def _branch_indices(branch_index: int | Sequence[int] | None) -> list[int] | None:
    if branch_index is None:
        return None
    values = [branch_index] if isinstance(branch_index, int) else list(branch_index)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise TypeError(f"branch_index takes an int or a list of ints, not {branch_index!r}")
    return values


def to_polars(table: pa.Table) -> polars.DataFrame:
    """A branch view as a Polars DataFrame (zero-copy where Arrow allows)."""
    import polars as pl

    return pl.from_arrow(table)
