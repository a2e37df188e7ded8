"""Training samples from the store: one per packed branch, its tokens and its loss mask.

A sample is a branch's token view (the spreading rule of :mod:`tracedb.views.spread`),
cut to ``seq_len`` when it is longer (or dropped, or refused: ``overflow``). A branch
whose advantages are None (never scored) is not a sample: it is skipped and counted,
never filled with zeros.

**The train-once rule on samples as packed.** A node shared by several packed samples
(a compaction's prefix, a subagent fork) has one value; its sampled tokens are in the
loss once, in the first trainable sample (in the owning-branch order of
:mod:`tracedb.graph`: trainable first, then by branch) that still carries each token after
truncation. So a token a truncated sample lost goes to the next sample holding it.

**Shareable prefixes.** With ``share_prefixes`` the samples' prefixes are interned in a
trie of nodes: two samples share a trie node when their paths up to it hold the same
nodes, where a node is the same node of one trace, or, for a node without sampled tokens
or loss weights (a system or task prompt), the same tokens in any trace (its spread values
are zeros everywhere then, so one copy serves every sample), and the two samples hold the
same optional streams and loss-weight names (a shared token is null or not for all of
its samples at once).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tracedb.batches.importance import Weights
from tracedb.tables import NULLABLE_TOKEN_COLUMNS, TOKEN_COLUMNS
from tracedb.views.nodes import NodeColumns
from tracedb.views.spread import branch_entries, branch_table

OVERFLOW = ("truncate", "drop", "error")


@dataclass
class Samples:
    """The packed samples of one call, as flat columns over their (truncated) tokens."""

    trace_id: list[str]
    branch_index: np.ndarray  # int32 per sample
    length: np.ndarray  # int64 per sample: tokens kept
    truncated: np.ndarray  # bool per sample
    rows: np.ndarray  # int64 per sample: its row of ``view``
    start: np.ndarray  # int64 per sample: where its tokens start among the view's flat values
    view: pa.Table  # the branch view of every selected branch (packed or not), as built
    view_offsets: np.ndarray  # int64 per view row + 1: its tokens among the flat values
    loss_mask: np.ndarray  # bool per view token (train-once rule applied; beyond a sample's length: unused)
    prefixes: list[list[tuple[int, int]]] | None  # per sample: (trie id, tokens up to it), with sharing
    counts: dict[str, int]
    path_off: np.ndarray | None = None  # int64 per view row + 1: its path entries in ``path_rows``
    path_rows: np.ndarray | None = None  # int64 per path entry: the node row
    importance: Weights | None = None  # per view token, with importance="tis" (tracedb.batches.importance)


def build(
    data: NodeColumns,
    seq_len: int,
    *,
    trainable: bool | None,
    branch_index: list[int] | None,
    train_once: bool,
    overflow: str,
    drop_zero_advantages: bool,
    share_prefixes: bool,
) -> Samples:
    """The samples of the branches in ``data`` (see the module docstring)."""
    if overflow not in OVERFLOW:
        raise ValueError(f"overflow must be one of {list(OVERFLOW)}, not {overflow!r}")
    view = branch_table(data, TOKEN_COLUMNS, False, trainable, branch_index)
    br = data.branches
    if trainable is not None:
        br = br.filter(pc.equal(br.column("trainable"), trainable))
    if branch_index is not None:
        br = br.filter(pc.is_in(br.column("branch_index"), value_set=pa.array(branch_index, pa.int32())))
    path_off, path_rows = branch_entries(data, br)
    counts = {"branches": view.num_rows, "skipped_never_scored": 0, "dropped_zero_advantages": 0}
    counts.update({"dropped_overflow": 0, "truncated": 0, "sampled_tokens": 0, "truncated_sampled_tokens": 0})

    full = pc.list_value_length(view.column("token_ids")).to_numpy(zero_copy_only=False).astype(np.int64)
    keep = view.column("advantages").is_valid().to_numpy(zero_copy_only=False)
    counts["skipped_never_scored"] = int((~keep).sum())
    if drop_zero_advantages:
        adv = view.column("advantages").combine_chunks()
        bounds = adv.offsets.to_numpy().astype(np.int64)
        csum = np.concatenate([[0], np.cumsum(adv.values.to_numpy(zero_copy_only=False) != 0)])
        zero = keep & (csum[bounds[1:]] == csum[bounds[:-1]])
        counts["dropped_zero_advantages"] = int(zero.sum())
        keep &= ~zero
    long = keep & (full > seq_len)
    if long.any() and overflow == "error":
        i = int(np.flatnonzero(long)[0])
        raise ValueError(
            f"trace {view.column('trace_id')[i].as_py()}, branch {view.column('branch_index')[i].as_py()}: "
            f"{full[i]} tokens, over seq_len {seq_len} (overflow='error'; 'truncate' or 'drop' packs the others)"
        )
    if overflow == "drop":
        counts["dropped_overflow"] = int(long.sum())
        keep &= ~long
    rows = np.flatnonzero(keep)
    view_offsets = np.zeros(len(keep) + 1, np.int64)
    np.cumsum(pc.list_value_length(view.column("token_ids")).to_numpy(zero_copy_only=False), out=view_offsets[1:])
    full = full[rows]
    length = np.minimum(full, seq_len)
    truncated = full > length
    counts["truncated"] = int(truncated.sum())
    # Sampled tokens (the loss before train_once) of the packed samples, and those a cut left out.
    sampled = view.column("sampled_mask").combine_chunks().flatten()  # aligned with view_offsets
    before = np.concatenate([[0], np.cumsum(sampled.to_numpy(zero_copy_only=False).astype(np.int64))])
    at = view_offsets[rows]
    counts["sampled_tokens"] = int((before[at + full] - before[at]).sum())
    counts["truncated_sampled_tokens"] = int((before[at + full] - before[at + length]).sum())

    # The samples' path entries, in view order, and each entry's token offset in its sample.
    sizes = (path_off[1:] - path_off[:-1])[rows]
    entry_off = np.zeros(len(rows) + 1, np.int64)
    np.cumsum(sizes, out=entry_off[1:])
    step = np.arange(int(entry_off[-1])) - np.repeat(entry_off[:-1], sizes)  # entry's place on its path
    entry_rows = path_rows[np.repeat(path_off[:-1][rows], sizes) + step]
    n_tok = data.n_tok[entry_rows]
    sample_of = np.repeat(np.arange(len(rows)), sizes)
    within = np.zeros(len(entry_rows), np.int64)  # token offset of each entry in its sample
    if len(entry_rows):
        csum = np.cumsum(n_tok)
        within = csum - n_tok - np.repeat(csum[entry_off[:-1]] - n_tok[entry_off[:-1]], sizes)
    start = view_offsets[rows]

    loss = view.column("sampled_mask").combine_chunks().values.to_numpy(zero_copy_only=False).astype(bool)
    if train_once:
        trainable_col = view.column("trainable").to_numpy(zero_copy_only=False).astype(bool)[rows]
        _train_once(loss, data.n_sampled, entry_rows, sample_of, within, n_tok, length, trainable_col, start)
    prefixes = None
    if share_prefixes:
        prefixes = _prefixes(data, entry_rows, entry_off, within, n_tok, length, _null_patterns(view, rows))
    return Samples(
        trace_id=view.column("trace_id").take(pa.array(rows, pa.int64())).to_pylist(),
        branch_index=view.column("branch_index").to_numpy().astype(np.int32)[rows],
        length=length,
        truncated=truncated,
        rows=rows,
        start=start,
        view=view,
        view_offsets=view_offsets,
        loss_mask=loss,
        prefixes=prefixes,
        counts=counts,
        path_off=path_off,
        path_rows=path_rows,
    )


def _train_once(
    loss: np.ndarray,
    n_sampled: np.ndarray,
    entry_rows: np.ndarray,
    sample_of: np.ndarray,
    within: np.ndarray,
    n_tok: np.ndarray,
    length: np.ndarray,
    trainable: np.ndarray,
    start: np.ndarray,
) -> None:
    """Clear from ``loss`` (the sampled mask over the view's tokens) every token of a
    shared sampled node that its sample does not own under the train-once rule.

    Entry ``e`` (a node on a sample) carries the node's first ``c_e`` tokens, what is
    left of the sample's length at the node. In the owners' order (trainable samples first,
    then view order) the entries of one node take, in turn, the tokens no earlier entry
    carried: entry ``e`` owns ``[max c before it, c_e)``. Only nodes on several samples
    that hold sampled tokens need it (the others' tokens are their one sample's)."""
    count = np.bincount(entry_rows, minlength=len(n_sampled))
    shared = np.flatnonzero((count[entry_rows] > 1) & (n_sampled[entry_rows] > 0))
    if not len(shared):
        return
    rows, samples, n = entry_rows[shared], sample_of[shared], n_tok[shared]
    carried = np.clip(length[samples] - within[shared], 0, n)
    rank = samples + np.where(trainable[samples], 0, len(length))
    order = np.lexsort((rank, rows))
    first = np.ones(len(order), bool)
    first[1:] = rows[order][1:] != rows[order][:-1]
    # Max of the carried counts of the node's earlier entries: a running max that
    # restarts at each node (each node's values lifted above the ones before it).
    c_sorted = carried[order]
    lift = np.cumsum(first) * (int(n.max()) + 1)
    before = np.maximum.accumulate(np.where(first, 0, np.concatenate([[0], c_sorted[:-1]])) + lift) - lift
    lo, hi = np.empty(len(order), np.int64), np.empty(len(order), np.int64)
    lo[order], hi[order] = before, np.maximum(before, c_sorted)
    # Each shared entry's tokens, and whether its entry owns each.
    at = np.repeat(start[samples] + within[shared], n) + (np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n))
    k = at - np.repeat(start[samples] + within[shared], n)
    owned = (k >= np.repeat(lo, n)) & (k < np.repeat(hi, n))
    loss[at] &= owned


def _prefixes(
    data: NodeColumns,
    entry_rows: np.ndarray,
    entry_off: np.ndarray,
    within: np.ndarray,
    n_tok: np.ndarray,
    length: np.ndarray,
    patterns: list[tuple[object, ...]],
) -> list[list[tuple[int, int]]]:
    """Per sample, its path as (trie id, tokens up to the end of that node) pairs, up to
    its first node the truncation cuts (a shared span is whole nodes). Samples share
    nothing unless their null patterns are the same (a shared token holds one value,
    valid or null, for every sample using it)."""
    content = _content_keys(data)
    trie: dict[tuple[int, object], int] = {}
    out = []
    for s in range(len(entry_off) - 1):
        parent = trie.setdefault((-1, ("nulls", patterns[s])), len(trie))  # a root per pattern, never a span
        pairs = []
        for e in range(int(entry_off[s]), int(entry_off[s + 1])):
            end = int(within[e] + n_tok[e])
            if end > length[s]:
                break
            row = int(entry_rows[e])
            key = (parent, content.get(row, ("row", row)))
            parent = trie.setdefault(key, len(trie))
            pairs.append((parent, end))
        out.append(pairs)
    return out


def _null_patterns(view: pa.Table, rows: np.ndarray) -> list[tuple[object, ...]]:
    """Per sample (view row ``rows[s]``): which optional streams it holds (the others are
    null on its tokens) and the loss-weight names it holds."""
    streams = [view.column(name).is_valid().to_numpy(zero_copy_only=False) for name in NULLABLE_TOKEN_COLUMNS]
    weights = view.column("loss_weights").combine_chunks()
    keys = weights.keys.to_pylist()
    offsets = weights.offsets.to_numpy()
    return [
        (tuple(bool(v[r]) for v in streams), tuple(sorted(keys[offsets[r] : offsets[r + 1]]))) for r in rows.tolist()
    ]


def _content_keys(data: NodeColumns) -> dict[int, object]:
    """Node rows whose tokens are all a sample takes from them (no sampled token, no loss
    weights): keyed by their token content, so equal prompts of different traces share.
    Segments are stored once per content, so a node's segment (where its tokens start
    among the loaded segments' values) names its content."""
    plain = (data.n_sampled == 0) & np.array([w is None for w in data.loss_weights], bool)
    return {int(row): ("segment", int(data.tok_src[row]), int(data.n_tok[row])) for row in np.flatnonzero(plain)}
