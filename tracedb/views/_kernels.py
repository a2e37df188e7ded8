"""Compiled loops of the view path (numba, compiled once and cached on disk).

A branch view is a gather: every branch concatenates its nodes' tokens, and a compact
stream lands on each node's sampled positions. In numpy that takes an index array per
column or a copy through node-flat arrays; here each output array is written once,
straight from the columns DuckDB returns. The functions release the GIL, so callers
split the branches across threads.

Node arrays, indexed by node row: ``n_tok`` tokens, ``tok_src`` offset of its tokens
in ``seg_values``, ``prefix`` leading unsampled tokens of a canonical mask or -1, and
for the others ``slot_src`` offset into ``slots`` (per token: 0 unsampled, else the
1-based rank of the sampled token). Branches ``lo:hi`` own the path entries
``path_off[b]:path_off[b + 1]`` of ``path_rows`` and write at ``out_off[b]``.
"""

from __future__ import annotations

import numpy as np

from tracedb.jit import compiled


@compiled
def spread_tokens(
    lo: int,
    hi: int,
    path_off: np.ndarray,
    path_rows: np.ndarray,
    keep: np.ndarray,
    out_off: np.ndarray,
    n_tok: np.ndarray,
    tok_src: np.ndarray,
    seg_values: np.ndarray,
    prefix: np.ndarray,
    slot_src: np.ndarray,
    slots: np.ndarray,
    out_tok: np.ndarray,
    out_mask: np.ndarray,
) -> None:
    """Token ids and sampled mask of branches ``lo:hi``; ``keep[e]`` False clears the
    mask of path entry ``e`` (train_once)."""
    for b in range(lo, hi):
        pos = out_off[b]
        for e in range(path_off[b], path_off[b + 1]):
            r = path_rows[e]
            n = n_tok[r]
            s = tok_src[r]
            out_tok[pos : pos + n] = seg_values[s : s + n]
            p = prefix[r]
            k = keep[e]
            if p >= 0:
                out_mask[pos : pos + p] = False
                out_mask[pos + p : pos + n] = k
            else:
                q = slot_src[r]
                for i in range(n):
                    out_mask[pos + i] = k and slots[q + i] > 0
            pos += n


@compiled
def spread_stream(
    lo: int,
    hi: int,
    path_off: np.ndarray,
    path_rows: np.ndarray,
    out_off: np.ndarray,
    n_tok: np.ndarray,
    prefix: np.ndarray,
    slot_src: np.ndarray,
    slots: np.ndarray,
    v_src: np.ndarray,
    v_take: np.ndarray,
    values: np.ndarray,
    out: np.ndarray,
) -> None:
    """A compact stream spread over branches ``lo:hi``: node ``r`` puts its first
    ``v_take[r]`` values (from ``values[v_src[r]:]``) on its sampled positions in order,
    0.0 on every other position."""
    for b in range(lo, hi):
        pos = out_off[b]
        for e in range(path_off[b], path_off[b + 1]):
            r = path_rows[e]
            n = n_tok[r]
            p = prefix[r]
            t = v_take[r]
            s = v_src[r]
            if p >= 0:
                out[pos : pos + p] = 0.0
                out[pos + p : pos + p + t] = values[s : s + t]
                out[pos + p + t : pos + n] = 0.0
            else:
                q = slot_src[r]
                for i in range(n):
                    k = slots[q + i]
                    out[pos + i] = values[s + k - 1] if 0 < k <= t else 0.0
            pos += n


@compiled
def fill_runs(out: np.ndarray, first: np.ndarray, count: np.ndarray, values: np.ndarray) -> None:
    """``out[first[i] : first[i] + count[i]] = values[i]`` for each run ``i``, in order (the
    policy-version spans of :mod:`tracedb.views.versions` over node-flat sampled tokens)."""
    for i in range(len(first)):
        start = first[i]
        value = values[i]
        for j in range(count[i]):
            out[start + j] = value
