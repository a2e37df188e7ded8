"""A selection's nodes, segments and branches, read from DuckDB into the columns the
view kernels (and the writers and credit algorithms) read.

:func:`load_nodes` reads the nodes, segments and branches of the selected traces once,
in one read transaction (a whole-database read takes the segments on a second cursor),
from the tables that hold them (``node_store``, ``segment_store``: token ids and streams
as text, :mod:`tracedb.codec`), decodes those into flat arrays, and keeps them as
:class:`NodeColumns`, with the watermark (the highest sequence number committed) that
read saw. Node rows are in (trace, node) order, so a trace's node ``i`` is row
``base[trace] + i``.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import wait
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tracedb import codec, runtime
from tracedb.handle import Handle
from tracedb.views import _buffers


def kernels() -> ModuleType:
    """The compiled spread, :mod:`tracedb.views._kernels` (numba: imported on the first
    view, which keeps ``import tracedb`` from paying numba's ~0.35 s import)."""
    from tracedb.views import _kernels

    return _kernels


@dataclass
class Stream:
    """One compact stream of the loaded nodes, as DuckDB returned it."""

    values: np.ndarray  # float32, every node's values back to back
    src: np.ndarray  # int64 per node row: offset of its values
    take: np.ndarray  # int64 per node row: values it spreads (extra ones are dropped)
    has: np.ndarray  # bool per node row: holds the stream (not None)


@dataclass
class NodeColumns:
    """The selected traces' nodes, node-ordered, in the columns the kernels read."""

    base: dict[str, int]  # trace id -> row of its node 0
    n_tok: np.ndarray  # int64 per node row
    n_sampled: np.ndarray  # int64 per node row: its sampled tokens
    starts: np.ndarray  # int64 per node row + 1: token offset of each node, node-flat
    tok_src: np.ndarray  # int64 per node row: offset of its tokens in seg_values
    seg_values: np.ndarray  # int32: the segments' tokens
    prefix: np.ndarray  # int64 per node row: leading unsampled tokens, -1 if not canonical
    slot_src: np.ndarray  # int64 per node row: offset of its mask slots
    slots: np.ndarray  # int32: mask slots of the non-canonical nodes
    streams: dict[str, Stream]
    loss_weights: list[Any]  # per node: None or list of (name, values)
    branches: pa.Table  # trace_id, branch_index, trainable, path (sorted)
    watermark: int = 0  # the highest sequence number committed when the nodes were read
    versions: np.ndarray | None = None  # int32 node-flat policy versions (views/versions.py), when read
    versions_read: bool = False
    _mask: np.ndarray | None = None

    @property
    def mask(self) -> np.ndarray:
        """Node-flat sampled mask (every node once, in row order)."""
        if self._mask is None:
            n = len(self.n_tok)
            rows = np.arange(n, dtype=np.int64)
            tokens = np.empty(int(self.starts[-1]), np.int32)
            self._mask = np.empty(len(tokens), np.bool_)
            kernels().spread_tokens(
                0, n, np.arange(n + 1, dtype=np.int64), rows, np.ones(n, np.bool_), self.starts, self.n_tok,
                self.tok_src, self.seg_values, self.prefix, self.slot_src, self.slots, tokens, self._mask,
            )  # fmt: skip
        return self._mask


_Parts = tuple[np.ndarray, np.ndarray, np.ndarray]  # values, offsets (rows + 1) into values, validity


def _sql(con: Any, query: str, params: list[Any] | None = None) -> pa.Table:
    return con.sql(query, params=params).to_arrow_table()


def load_nodes(
    handle: Handle, trace_ids: list[str] | None, streams: Sequence[str], credit: str | None = None
) -> NodeColumns:
    """Read the nodes, segments and branches of the selected traces (``None``: all of
    them) in one read transaction, so the queries see one state of the database.

    A whole-database read takes list columns flat (see :func:`read_all`) and the
    segments' tokens on a second cursor, side by side with the rest: segments are
    content-addressed and never change, so another snapshot can only hold more of them;
    a node whose segment it lacks (written in between) makes the tokens be read again.
    Inside a transaction already open on the connection (tracedb's or the user's own
    ``BEGIN``) everything is read there, on that connection, and it is left open.
    """
    node_streams = [s for s in streams if not (s == "advantages" and credit is not None)]
    con = handle.con
    first, ordered = con.execute(
        "SELECT current_transaction_id(), current_setting('preserve_insertion_order')"
    ).fetchall()[0]
    # In autocommit every statement is a transaction of its own: the same id twice means
    # a transaction is open.
    own = not handle.in_transaction and con.execute("SELECT current_transaction_id()").fetchall()[0][0] != first
    flat = trace_ids is None and bool(ordered)  # flat reads pair two scans by row order
    where = ""
    if trace_ids is not None:
        con.register("_tdb_sel", pa.table({"trace_id": pa.array(trace_ids, pa.string())}))
        where = " WHERE trace_id IN (SELECT trace_id FROM _tdb_sel)"
    apart = runtime.threads().submit(read_segments, handle.cursor(), True) if flat and own else None
    try:
        if own:
            con.execute("BEGIN TRANSACTION")
        try:
            mark = handle.watermark(con)
            if flat:
                nodes, lists = read_all(con, node_streams)
                segments = None if apart else read_segments(con, False)
            else:
                nodes, segments, lists = read_lists(con, node_streams, where)
            branches = _sql(
                con,
                f"SELECT trace_id, branch_index, trainable, path FROM branches{where} ORDER BY trace_id, branch_index",
            )
            credit_rows = None
            if credit is not None and "advantages" in streams:
                # A set is stored per node (credit) or per trace (trace_credit: no node_index).
                also = where.replace(" WHERE ", " AND ")
                credit_rows = _sql(
                    con,
                    f"SELECT trace_id, node_index, value, advantages FROM credit WHERE credit_set = ?{also} "
                    "UNION ALL SELECT trace_id, NULL::INTEGER, value, NULL::FLOAT[] FROM trace_credit "
                    f"WHERE credit_set = ?{also}",
                    [credit, credit],
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
        data = _decode(nodes, segments, lists, branches, credit_rows, streams)
    except _MissingSegment:  # the segments were read before a write that added some
        data = _decode(nodes, read_segments(handle.cursor(), True), lists, branches, credit_rows, streams)
    data.watermark = mark
    return data


class _MissingSegment(Exception):
    pass


def node_columns(
    nodes: pa.Table,
    segments: pa.Table,
    branches: pa.Table,
    streams: Sequence[str],
    credit_rows: pa.Table | None = None,
    *,
    watermark: int = 0,
) -> NodeColumns:
    """:class:`NodeColumns` of Arrow tables read elsewhere (the lake's files): ``nodes``
    (the columns of ``_META`` and the ``streams`` the nodes hold, as lists), the
    ``segments`` they use (``segment_id``, ``token_ids``; a segment may be there twice),
    their ``branches`` (``trace_id``, ``branch_index``, ``trainable``, ``path``) and, for a
    named credit set, its ``credit_rows`` (``trace_id``, ``node_index``, ``value``,
    ``advantages``: the advantages stream then). Decoded by the code a file's selection is
    (:func:`load_nodes`), so views and plans made of them are the file store's.
    ``KeyError`` naming a segment a node uses that ``segments`` lacks."""
    node_streams = [s for s in streams if not (s == "advantages" and credit_rows is not None)]
    lists = {s: list_parts(nodes.column(s)) for s in node_streams}
    held = (segments.column("segment_id"), list_parts(segments.column("token_ids")))
    ordered = branches.sort_by([("trace_id", "ascending"), ("branch_index", "ascending")])
    try:
        data = _decode(nodes, held, lists, ordered, credit_rows, streams)
    except _MissingSegment:
        at = pc.index_in(nodes.column("segment_id"), value_set=held[0].combine_chunks())
        row = nodes.filter(pc.is_null(at)).slice(0, 1).to_pylist()[0]
        raise KeyError(
            f"trace {row['trace_id']!r} node {row['node_index']}: segment {row['segment_id'].hex()} is not among "
            f"the {len(held[0])} segments read"
        ) from None
    data.watermark = watermark
    return data


_META = "trace_id, node_index, n_tokens, n_sampled, mask_prefix, mask_slots, loss_weights, segment_id"


def read_all(con: Any, streams: Sequence[str]) -> tuple[pa.Table, dict[str, _Parts]]:
    """Every node, its streams: the rows kept as text decoded (handed over as strings,
    which DuckDB does several times faster than lists), those kept as lists read flat with
    ``unnest`` and cut by the lengths a plain scan of the same table returns in the same
    order (both keep insertion order)."""
    columns = "".join(f', {s}, len({s}_list) AS "len:{s}"' for s in streams)
    nodes = _sql(con, f"SELECT {_META}{columns} FROM node_store")
    out = {}
    for s in streams:
        listed = flat_column(con, f"SELECT unnest({s}_list) FROM node_store", nodes.column(f"len:{s}"), np.float32)
        out[s] = merged(codec.stream_values(nodes.column(s)), listed)
    return nodes, out


def merged(a: _Parts, b: _Parts) -> _Parts:
    """One stream of rows whose values are in ``a`` or in ``b`` (the other holds none for
    the row: null or empty), as (values, offsets, validity)."""
    a_values, a_off, a_valid = a
    b_values, b_off, b_valid = b
    if not b_valid.any():
        return a
    if not a_valid.any():
        return b
    a_len, b_len = np.diff(a_off), np.diff(b_off)
    offsets = np.zeros(len(a_len) + 1, np.int64)
    np.cumsum(a_len + b_len, out=offsets[1:])
    values = np.empty(int(offsets[-1]), np.result_type(a_values, b_values))
    for part, part_off, part_len in ((a_values, a_off, a_len), (b_values, b_off, b_len)):
        at = np.repeat(offsets[:-1] - part_off[:-1], part_len) + np.arange(part_off[0], part_off[-1], dtype=np.int64)
        values[at] = part[part_off[0] : part_off[-1]]
    return values, offsets, a_valid | b_valid


def read_segments(con: Any, own_cursor: bool) -> tuple[pa.ChunkedArray, _Parts]:
    """Every segment: (ids, tokens). The rows kept as lists are read flat with ``unnest``
    (DuckDB hands over flat values about twice as fast as lists), in the order a plain
    scan of the same table returns them (both keep insertion order)."""
    try:
        if own_cursor:
            con.execute("BEGIN TRANSACTION")
        # A row holds its ids as text or as a list, so the list rows are those without
        # text (``token_ids IS NOT NULL`` would read the lists: ~8 ms on the benchmark file).
        segments = _sql(con, "SELECT segment_id, n_tokens, tokens FROM segment_store")
        is_list = pc.is_null(segments.column("tokens"))
        listed = is_list.to_numpy(zero_copy_only=False) if segments.num_rows else np.zeros(0, bool)
        flat = (np.zeros(0, np.int32), np.zeros(len(listed) + 1, np.int64))  # no row kept as a list
        if listed.any():
            lengths = pa.chunked_array([pc.if_else(is_list, segments.column("n_tokens"), 0)])
            values, offsets, _ = flat_column(con, "SELECT unnest(token_ids) FROM segment_store", lengths, np.int32)
            flat = (values, offsets)
        if own_cursor:
            con.execute("COMMIT")
        return segments.column("segment_id"), segment_tokens(segments, flat)
    finally:
        if own_cursor:
            con.close()


def flat_column(con: Any, query: str, lengths: pa.ChunkedArray, dtype: type) -> _Parts:
    """The values of ``query`` (one column of ``dtype``), cut by ``lengths``; streamed
    batch by batch into one array (:mod:`tracedb.views._buffers`). Batches of the
    ``stream_rows`` setting keep DuckDB's result buffers small enough for the C allocator
    to reuse, instead of ~30 MB of fresh pages per read (measured: tokens and logprobs of
    the benchmark database read in ~28 ms with ~0 page faults, ~40 ms with ~4k)."""
    valid = lengths.is_valid().to_numpy(zero_copy_only=False)
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(pc.fill_null(lengths, 0).to_numpy(zero_copy_only=False), out=offsets[1:])
    total = int(offsets[-1])
    if total == 0:  # nothing to read (a stream no node holds): skip the scan
        return np.zeros(0, dtype), offsets, valid
    values = _buffers.empty(total, dtype)
    pos = end = 0
    for batch in con.sql(query).to_arrow_reader(runtime.settings().stream_rows):
        part = batch.column(0).to_numpy(zero_copy_only=False)
        end = pos + len(part)
        if end > total:
            break
        values[pos:end] = part
        pos = end
    if end != total:  # cannot happen within one transaction; never misalign silently
        raise RuntimeError(f"{query!r} returned other than the {total} values its rows hold")
    return values, offsets, valid


def segment_tokens(segments: pa.Table, flat: tuple[np.ndarray, np.ndarray] | None = None) -> _Parts:
    """The token ids of ``segment_store`` rows (``tokens``, and ``token_ids`` unless their
    values are given ``flat``: (values, offsets per row, 0 ids for a row kept as text)),
    each row's from its list or its text, as (values, offsets, validity)."""
    counts = segments.column("n_tokens").to_numpy(zero_copy_only=False) if "n_tokens" in segments.column_names else None
    text_values, text_off, _ = codec.token_values(segments.column("tokens"), counts)
    if flat is None:
        lists = segments.column("token_ids")
        if lists.null_count == len(lists):
            return text_values, text_off, np.ones(len(text_off) - 1, bool)
        list_values, list_off, _ = list_parts(lists)
        list_values = list_values[list_off[0] : list_off[-1]]
        list_off = list_off - list_off[0]
    else:
        list_values, list_off = flat
    if not len(text_values):
        return list_values.astype(np.int32, copy=False), list_off, np.ones(len(list_off) - 1, bool)
    if not len(list_values):
        return text_values, text_off, np.ones(len(text_off) - 1, bool)
    # Rows of both kinds (batches stored each its own way): each row's ids where they go.
    text_len, list_len = np.diff(text_off), np.diff(list_off)
    offsets = np.zeros(len(text_len) + 1, np.int64)
    np.cumsum(text_len + list_len, out=offsets[1:])
    values = np.empty(int(offsets[-1]), np.int32)
    for part, part_off, part_len in ((text_values, text_off, text_len), (list_values, list_off, list_len)):
        at = np.repeat(offsets[:-1] - part_off[:-1], part_len) + np.arange(len(part), dtype=np.int64)
        values[at] = part
    return values, offsets, np.ones(len(text_len), bool)


def read_lists(
    con: Any, streams: Sequence[str], where: str
) -> tuple[pa.Table, tuple[pa.ChunkedArray, _Parts], dict[str, _Parts]]:
    """The nodes (``where``: of the traces in ``_tdb_sel``) and their segments: each row
    carries its own values, so no row order is relied on (a selection filters with a
    join, which keeps none; ``preserve_insertion_order`` may be off)."""
    columns = "".join(f", {s}, {s}_list" for s in streams)
    nodes = _sql(con, f"SELECT {_META}{columns} FROM node_store{where}")
    wanted_columns = "segment_id, n_tokens, token_ids, tokens"
    if not where:
        segments = _sql(con, f"SELECT {wanted_columns} FROM segment_store")
    else:
        # The segments these nodes name: a short literal list is looked up as a filter
        # (~3x faster than a join for one trace); a long one is joined.
        wanted = pc.unique(nodes.column("segment_id").combine_chunks())
        if len(wanted) <= runtime.settings().segment_lookup:
            marks = ", ".join("?" * len(wanted)) or "NULL"
            segments = _sql(
                con,
                f"SELECT {wanted_columns} FROM segment_store WHERE segment_id IN ({marks})",
                wanted.to_pylist(),
            )
        else:
            con.register("_tdb_segs", pa.table({"segment_id": wanted}))
            try:
                segments = _sql(
                    con, f"SELECT {wanted_columns} FROM segment_store s SEMI JOIN _tdb_segs USING (segment_id)"
                )
            finally:
                con.unregister("_tdb_segs")
    lists = {s: merged(codec.stream_values(nodes.column(s)), list_parts(nodes.column(f"{s}_list"))) for s in streams}
    return nodes, (segments.column("segment_id"), segment_tokens(segments)), lists


def node_ordered(nodes: pa.Table) -> bool:
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


def list_parts(col: pa.ChunkedArray) -> _Parts:
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
) -> NodeColumns:
    # Rows are used in (trace, node) order; per-row arrays are permuted into it when the
    # scan returned another order (the flat values stay where they are).
    perm = None
    if not node_ordered(nodes):
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
    slots, slot_off, _ = list_parts(nodes.column("mask_slots"))

    decoded: dict[str, Stream] = {}
    for name in streams:
        if name == "advantages" and credit_rows is not None:
            decoded[name] = _credit_stream(credit_rows, base, n_sampled)
            continue
        values, offsets, valid = lists[name]
        take = np.where(valid, np.minimum(np.diff(offsets), n_sampled_scan), 0)
        decoded[name] = Stream(values.astype(np.float32, copy=False), rows(offsets[:-1]), rows(take), rows(valid))
    lw = nodes.column("loss_weights")
    loss_weights = codec.loss_weights_values(lw) if lw.null_count < len(lw) else [None] * n_rows
    if perm is not None:
        loss_weights = [loss_weights[i] for i in perm.tolist()]
    return NodeColumns(
        base=base,
        n_tok=n_tok,
        n_sampled=n_sampled,
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


def _credit_stream(credit_rows: pa.Table, base: dict[str, int], n_sampled: np.ndarray) -> Stream:
    """Advantages of a named credit set: a row holds a list or one value broadcast over
    the node's sampled tokens, or (``node_index`` null: a set stored per trace) one value
    broadcast over the sampled tokens of every node of its trace; a node without a row
    (or with neither) is unassigned, and so is a node without sampled tokens under a
    trace's row."""
    n_rows = len(n_sampled)
    first = np.fromiter((base.get(t, -1) for t in credit_rows.column("trace_id").to_pylist()), np.int64)
    per_trace = credit_rows.column("node_index").is_null().to_numpy(zero_copy_only=False)
    index = pc.fill_null(credit_rows.column("node_index"), 0).to_numpy().astype(np.int64)
    # A row naming no node of the selection (an unknown trace or node) is ignored, as a
    # join would; it never lands on another node's row.
    bounds = np.array(sorted(base.values()) + [n_rows], np.int64)
    end = bounds[np.searchsorted(bounds, first, side="right").clip(max=len(bounds) - 1)]
    known = (first >= 0) & (index >= 0) & (first + index < end)
    if not known.all():
        credit_rows, first, index = credit_rows.filter(pa.array(known)), first[known], index[known]
        per_trace, end = per_trace[known], end[known]
    node = first + index
    values, offsets, listed = list_parts(credit_rows.column("advantages"))
    value = credit_rows.column("value")
    number = pc.fill_null(value, 0.0).to_numpy().astype(np.float32)
    scalar = value.is_valid().to_numpy(zero_copy_only=False) & ~listed & ~per_trace
    scalar_node, scalar_value = node[scalar], number[scalar]
    if per_trace.any():
        # A trace's row covers its node rows first .. end - 1; those with sampled tokens take it.
        lo, sizes = first[per_trace], end[per_trace] - first[per_trace]
        starts = np.zeros(len(sizes), np.int64)
        np.cumsum(sizes[:-1], out=starts[1:])
        rows = np.arange(int(sizes.sum()), dtype=np.int64) + np.repeat(lo - starts, sizes)
        spread = np.repeat(number[per_trace], sizes)
        sampled = n_sampled[rows] > 0
        scalar_node = np.concatenate([scalar_node, rows[sampled]])
        scalar_value = np.concatenate([scalar_value, spread[sampled]])
    # Broadcast values go after the listed ones, n_sampled of each.
    counts = n_sampled[scalar_node]
    broadcast = np.repeat(scalar_value, counts)
    src = np.zeros(n_rows, np.int64)
    take = np.zeros(n_rows, np.int64)
    has = np.zeros(n_rows, bool)
    src[node[listed]] = offsets[:-1][listed]
    take[node[listed]] = np.minimum(np.diff(offsets)[listed], n_sampled[node[listed]])
    at = np.zeros(len(counts), np.int64)
    np.cumsum(counts[:-1], out=at[1:])
    src[scalar_node] = len(values) + at
    take[scalar_node] = counts
    has[node[listed]] = True
    has[scalar_node] = True
    return Stream(np.concatenate([values.astype(np.float32, copy=False), broadcast]), src, take, has)
