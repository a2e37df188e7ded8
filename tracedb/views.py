"""Branch-spread token views, built with numpy over Arrow columns.

The rule is verifiers' ``Branch.spread`` (see ``schema/macros.sql`` for the same rule in
SQL): along a root-to-leaf path ``token_ids`` and ``sampled_mask`` concatenate; a compact
stream lands on its node's sampled positions in order, 0.0 elsewhere, extra values
dropped and missing ones 0.0; a stream is null for a branch when no node on its path
holds it. ``loss_weights`` maps every name some node on the path holds to its spread.

Work happens per node once (a node shared by several branches is widened once) and
per branch as a few contiguous copies: a branch is a handful of runs of consecutive
nodes, and consecutive nodes are contiguous in the node-ordered flat arrays.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tracedb.models import COMPACT_STREAMS, OPTIONAL_STREAMS

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
class _Nodes:
    """Decoded node columns of a set of traces, node-ordered, with per-token flat arrays."""

    trace_ids: list[str]
    base: dict[str, int]  # trace id -> row of its node 0
    starts: np.ndarray  # int64 per node row + 1: token offset of each node
    tokens: np.ndarray  # int32
    mask: np.ndarray  # bool
    has: dict[str, np.ndarray]  # stream -> bool per node (holds a value, not None)
    full: dict[str, np.ndarray]  # stream -> float32 per token, widened
    loss_weights: list[Any]  # per node: None or list of (name, values)
    branches: pa.Table  # trace_id, branch_index, trainable, path (sorted)


def _load(db: Database, trace_ids: list[str], streams: Sequence[str], credit: str | None = None) -> _Nodes:
    db.con.register("_tdb_sel", pa.table({"trace_id": pa.array(trace_ids, pa.string())}))
    try:
        cols = "".join(f", n.{c}" for c in streams if c != "advantages")
        if credit is not None and "advantages" in streams:
            advantages = (
                ", coalesce(c.advantages, CASE WHEN c.value IS NOT NULL "
                "THEN list_resize([]::FLOAT[], n.n_sampled, c.value) END) AS advantages"
            )
            join = "LEFT JOIN credit c ON c.credit_set = ? AND c.trace_id = n.trace_id AND c.node_index = n.node_index"
            params: list[Any] | None = [credit]
        else:
            advantages = ", n.advantages" if "advantages" in streams else ""
            join, params = "", None
        nodes = db.sql(
            "SELECT n.trace_id, n.node_index, n.n_tokens, n.n_sampled, n.mask_prefix, n.mask_slots, "
            f"n.loss_weights, n.segment_id{cols}{advantages} FROM nodes n {join} "
            "WHERE n.trace_id IN (SELECT trace_id FROM _tdb_sel)",
            params,
        )
        segments = db.sql(
            "SELECT segment_id, token_ids FROM segments WHERE segment_id IN "
            "(SELECT segment_id FROM nodes SEMI JOIN _tdb_sel USING (trace_id))"
        )
        branches = db.sql(
            "SELECT b.trace_id, b.branch_index, b.trainable, b.path FROM branches b "
            "SEMI JOIN _tdb_sel USING (trace_id) ORDER BY b.trace_id, b.branch_index"
        )
    finally:
        db.con.unregister("_tdb_sel")
    if not _node_ordered(nodes):
        nodes = nodes.sort_by([("trace_id", "ascending"), ("node_index", "ascending")])
    return _decode(nodes, segments, branches, streams)


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


def _flat(col: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(values, offsets, validity) of a list column, offsets relative to the values."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    offsets = arr.offsets.to_numpy().astype(np.int64)
    values = arr.values.to_numpy(zero_copy_only=False)
    values = values[offsets[0] : offsets[-1]] if len(offsets) else values[:0]
    offsets = offsets - (offsets[0] if len(offsets) else 0)
    valid = arr.is_valid().to_numpy(zero_copy_only=False) if arr.null_count else np.ones(len(arr), bool)
    return values, offsets, valid


def _copy_runs(
    dst: np.ndarray, dst_start: np.ndarray, src: np.ndarray, src_start: np.ndarray, length: np.ndarray
) -> None:
    """dst[dst_start[i] : +length[i]] = src[src_start[i] : +length[i]] for every run i."""
    keep = length > 0
    dst_start, src_start, length = dst_start[keep], src_start[keep], length[keep]
    if len(length) * 64 < length.sum():  # few long runs: slice copies beat an index
        for d, s, n in zip(dst_start.tolist(), src_start.tolist(), length.tolist()):
            dst[d : d + n] = src[s : s + n]
        return
    if not len(length):
        return
    dst[_gather_index(dst_start, dst_start + length)] = src[_gather_index(src_start, src_start + length)]


def _decode(nodes: pa.Table, segments: pa.Table, branches: pa.Table, streams: Sequence[str]) -> _Nodes:
    trace_col = nodes.column("trace_id").to_pylist()
    base: dict[str, int] = {}
    for row, tid in enumerate(trace_col):
        base.setdefault(tid, row)
    n_tokens = nodes.column("n_tokens").to_numpy().astype(np.int64)
    n_sampled = nodes.column("n_sampled").to_numpy().astype(np.int64)
    n_rows = len(n_tokens)
    starts = np.zeros(n_rows + 1, np.int64)
    np.cumsum(n_tokens, out=starts[1:])
    total = int(starts[-1])

    seg_values, seg_offsets, _ = _flat(segments.column("token_ids"))
    seg_row = {key: i for i, key in enumerate(segments.column("segment_id").to_pylist())}
    src = seg_offsets[np.fromiter((seg_row[k] for k in nodes.column("segment_id").to_pylist()), np.int64, n_rows)]
    tokens = np.empty(total, np.int32)
    _copy_runs(tokens, starts[:-1], seg_values, src, n_tokens)

    # Where each node's sampled tokens sit: canonical nodes hold them from
    # start + prefix on; the few non-canonical ones are placed one by one.
    prefix_col = nodes.column("mask_prefix")
    canonical = prefix_col.is_valid().to_numpy(zero_copy_only=False)
    prefix = pc.fill_null(prefix_col, 0).to_numpy().astype(np.int64)
    first = starts[:-1] + prefix
    mask = np.zeros(total, bool)
    ones = np.ones(int(n_sampled.max()) if n_rows else 0, bool)
    _copy_runs(mask, first[canonical], ones, np.zeros(int(canonical.sum()), np.int64), n_sampled[canonical])
    odd = np.flatnonzero(~canonical)
    positions: dict[int, np.ndarray] = {}
    if len(odd):
        slots, slot_off, _ = _flat(nodes.column("mask_slots"))
        for row in odd.tolist():
            where = np.flatnonzero(slots[slot_off[row] : slot_off[row + 1]] > 0) + starts[row]
            positions[row] = where
            mask[where] = True

    has: dict[str, np.ndarray] = {}
    full: dict[str, np.ndarray] = {}
    for name in streams:
        values, offsets, valid = _flat(nodes.column(name))
        has[name] = valid
        take = np.minimum(np.diff(offsets), n_sampled)  # extra values are dropped
        out = np.zeros(total, np.float32)
        _copy_runs(out, first[canonical], values, offsets[:-1][canonical], take[canonical])
        for row, where in positions.items():
            m = int(take[row])
            out[where[:m]] = values[offsets[row] : offsets[row] + m]
        full[name] = out
    lw = nodes.column("loss_weights")
    loss_weights = lw.to_pylist() if lw.null_count < len(lw) else [None] * n_rows
    return _Nodes(list(base), base, starts, tokens, mask, has, full, loss_weights, branches)


def _runs(paths: list[list[int]], bases: list[int], starts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Token ranges (start, end) covering each branch, and the run count per branch."""
    run_start: list[int] = []
    run_end: list[int] = []
    per_branch = np.zeros(len(paths), np.int64)
    for i, (path, base) in enumerate(zip(paths, bases)):
        first = prev = path[0]
        count = 0
        for node in path[1:]:
            if node != prev + 1:
                run_start.append(starts[base + first])
                run_end.append(starts[base + prev + 1])
                count += 1
                first = node
            prev = node
        run_start.append(starts[base + first])
        run_end.append(starts[base + prev + 1])
        per_branch[i] = count + 1
    return np.asarray(run_start, np.int64), np.asarray(run_end, np.int64), per_branch


def _gather_index(run_start: np.ndarray, run_end: np.ndarray) -> np.ndarray:
    lengths = run_end - run_start
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    # Position i of run r reads run_start[r] + i: a cumulative sum of steps that jump at
    # each run boundary.
    steps = np.ones(total, np.int64)
    firsts = np.zeros(len(lengths), np.int64)
    np.cumsum(lengths[:-1], out=firsts[1:])
    nonempty = lengths > 0
    prev_end = np.concatenate([[0], run_end[:-1]])
    jumps = run_start - prev_end + 1
    jumps[0] = run_start[0]
    # empty runs contribute no position; fold their jump into the next non-empty run
    if not nonempty.all():
        keep = np.flatnonzero(nonempty)
        jumps = run_start[keep] - np.concatenate([[0], run_end[keep][:-1]]) + 1
        jumps[0] = run_start[keep[0]]
        firsts = firsts[keep]
    steps[firsts] = jumps
    return np.cumsum(steps)


def _take(flat: np.ndarray, run_start: np.ndarray, run_end: np.ndarray, index: np.ndarray | None) -> np.ndarray:
    if index is not None:
        return flat[index]
    if len(run_start) == 0:
        return flat[:0].copy()
    if len(run_start) == 1:
        return flat[run_start[0] : run_end[0]].copy()
    return np.concatenate([flat[a:b] for a, b in zip(run_start.tolist(), run_end.tolist())])


def _list(values: np.ndarray, offsets: pa.Array, value_type: pa.DataType, valid: np.ndarray | None = None) -> pa.Array:
    mask = None if valid is None or valid.all() else pa.array(~valid)
    return pa.ListArray.from_arrays(offsets, pa.array(values, value_type), mask=mask)


def _branch_tables(data: _Nodes, columns: Sequence[str], train_once: bool, trainable: bool | None) -> pa.Table:
    br = data.branches
    if trainable is not None:
        br = br.filter(pc.equal(br.column("trainable"), trainable))
    n_branches = br.num_rows
    trace_ids = br.column("trace_id").to_pylist()
    paths = br.column("path").to_pylist()
    bases = [data.base[t] for t in trace_ids]
    run_start, run_end, per_branch = _runs(paths, bases, data.starts)
    lengths = (
        np.add.reduceat(run_end - run_start, np.concatenate([[0], np.cumsum(per_branch)[:-1]]))
        if n_branches
        else np.zeros(0, np.int64)
    )
    offsets64 = np.zeros(n_branches + 1, np.int64)
    np.cumsum(lengths, out=offsets64[1:])
    offsets = pa.array(offsets64.astype(np.int32)) if offsets64[-1] < 2**31 else None
    if offsets is None:
        raise ValueError("a view over more than 2**31 tokens: select fewer traces (or export, which streams)")
    index = _gather_index(run_start, run_end) if len(run_start) > 4096 else None

    out: dict[str, pa.Array] = {
        "trace_id": pa.array(trace_ids, pa.string()),
        "branch_index": br.column("branch_index").combine_chunks(),
        "trainable": br.column("trainable").combine_chunks(),
    }
    path_rows = [np.asarray(p, np.int64) + b for p, b in zip(paths, bases)]
    for name in columns:
        if name == "token_ids":
            out[name] = _list(_take(data.tokens, run_start, run_end, index), offsets, pa.int32())
        elif name == "sampled_mask":
            mask = _take(data.mask, run_start, run_end, index)
            if train_once:
                mask &= _first_use(data, br, path_rows, len(mask))
            out[name] = _list(mask, offsets, pa.bool_())
        elif name == "logprobs":
            out[name] = _list(_take(data.full[name], run_start, run_end, index), offsets, pa.float32())
        elif name in OPTIONAL_STREAMS:
            held = (
                np.array([data.has[name][rows].any() for rows in path_rows], bool) if n_branches else np.zeros(0, bool)
            )
            values = _take(data.full[name], run_start, run_end, index)
            out[name] = _list(values, offsets, pa.float32(), held)
        elif name == "loss_weights":
            out[name] = _loss_weights(data, path_rows)
    fields = [BRANCH_SCHEMA.field(c) for c in ("trace_id", "branch_index", "trainable", *columns)]
    return pa.Table.from_arrays([out[f.name] for f in fields], schema=pa.schema(fields))


def _first_use(data: _Nodes, br: pa.Table, path_rows: list[np.ndarray], total: int) -> np.ndarray:
    """Per branch token: True where this branch is the node's first trainable branch."""
    # First branch per node across the whole trace (all branches, not only the filtered).
    first: dict[int, int] = {}
    every = data.branches
    all_ids = every.column("trace_id").to_pylist()
    all_paths = every.column("path").to_pylist()
    all_train = every.column("trainable").to_pylist()
    all_index = every.column("branch_index").to_pylist()
    for prefer in (True, False):
        for tid, path, tr, bi in zip(all_ids, all_paths, all_train, all_index):
            if tr != prefer:
                continue
            base = data.base[tid]
            for node in path:
                first.setdefault(base + node, (tid, bi))
    keep = []
    for tid, bi, rows in zip(br.column("trace_id").to_pylist(), br.column("branch_index").to_pylist(), path_rows):
        for row in rows:
            n = int(data.starts[row + 1] - data.starts[row])
            keep.append(np.full(n, first[int(row)] == (tid, bi), bool))
    return np.concatenate(keep) if keep else np.zeros(total, bool)


def _loss_weights(data: _Nodes, path_rows: list[np.ndarray]) -> pa.Array:
    entries = []
    for rows in path_rows:
        per_node = [dict(data.loss_weights[r]) if data.loss_weights[r] is not None else {} for r in rows]
        names = sorted({k for d in per_node for k in d})
        branch = []
        for name in names:
            parts = []
            for r, d in zip(rows, per_node):
                size = int(data.starts[r + 1] - data.starts[r])
                parts.append(np.asarray(d[name], np.float32) if name in d else np.zeros(size, np.float32))
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
    selected = _select_traces(db, trace_ids, group, episode)
    chunk: list[str] = []
    acc = 0
    for tid, size in selected:
        chunk.append(tid)
        acc += size
        if acc >= batch_tokens:
            yield _view(db, chunk, cols, train_once, trainable, credit, cache=False)
            chunk, acc = [], 0
    if chunk or not selected:
        yield _view(db, chunk, cols, train_once, trainable, credit, cache=False)


def _view(
    db: Database,
    trace_ids: list[str],
    cols: list[str],
    train_once: bool,
    trainable: bool | None,
    credit: str | None,
    cache: bool,
) -> pa.Table:
    streams = [c for c in COMPACT_STREAMS if c in cols]
    key = (db._generation, tuple(trace_ids), credit)
    data = None
    if cache and db._cache is not None and db._cache[0] == key and set(streams) <= set(db._cache[1].full):
        data = db._cache[1]
    if data is None:
        data = _load(db, trace_ids, streams, credit)
        if cache and len(data.tokens) <= _CACHE_TOKENS:
            db._cache = (key, data)
    return _branch_tables(data, cols, train_once, trainable)


def branches(
    db: Database,
    *,
    trace_ids: Sequence[str] | None = None,
    group: str | Sequence[str] | None = None,
    episode: str | Sequence[str] | None = None,
    trainable: bool | None = None,
    columns: Sequence[str] | None = None,
    train_once: bool = False,
    credit: str | None = None,
) -> pa.Table:
    """One row per branch of the selected traces, ordered by trace id then branch index.

    ``trace_ids``, ``group`` (``episode.group.id``) and ``episode`` select traces;
    ``trainable=True`` keeps only trainable branches. ``columns`` picks token columns
    (``trace_id``, ``branch_index`` and ``trainable`` are always there). ``train_once``
    leaves a shared node's sampled tokens in the mask of its first trainable branch only.
    ``credit="name"`` reads advantages from that credit set (default: the ingested set).
    Decoded node columns are cached on ``db`` until its next write, so repeated views of
    the same selection skip the database.
    """
    cols = _columns(columns)
    credit = db._credit_name(credit)
    selected = [tid for tid, _ in _select_traces(db, trace_ids, group, episode)]
    return _view(db, selected, cols, train_once, trainable, credit, cache=True)


def to_polars(table: pa.Table) -> polars.DataFrame:
    """A branch view as a Polars DataFrame (zero-copy where Arrow allows)."""
    import polars as pl

    return pl.from_arrow(table)
