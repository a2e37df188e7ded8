"""Branch views from loaded node columns: the spreading rule, written by compiled loops.

The rule is verifiers' ``Branch.spread`` (``schema/macros.sql`` states it in SQL): along a
root-to-leaf path ``token_ids`` and ``sampled_mask`` concatenate; a compact stream lands
on its node's sampled positions in order, 0.0 elsewhere, extra values dropped and
missing ones 0.0; a stream is null for a branch when no node on its path holds it.
``loss_weights`` maps every name some node on the path holds to its spread. Each output
column is written once, by :mod:`tracedb.views._kernels`, straight from the columns
DuckDB returned: nothing is widened per node first.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tracedb import policy
from tracedb.graph import owning_branch
from tracedb.tables import BRANCH_SCHEMA
from tracedb.views import _buffers
from tracedb.views.nodes import NodeColumns, kernels


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


def branch_entries(data: NodeColumns, br: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """(path_off, path_rows): each branch's nodes as node rows, back to back."""
    path = br.column("path").combine_chunks()
    if len(path) == 0:
        return np.zeros(1, np.int64), np.zeros(0, np.int64)
    path_off = path.offsets.to_numpy().astype(np.int64)
    nodes = path.values.to_numpy(zero_copy_only=False).astype(np.int64)[path_off[0] : path_off[-1]]
    path_off = path_off - path_off[0]
    bases = np.fromiter((data.base[t] for t in br.column("trace_id").to_pylist()), np.int64, br.num_rows)
    return path_off, nodes + np.repeat(bases, np.diff(path_off))


def per_branch_sum(path_off: np.ndarray, per_entry: np.ndarray) -> np.ndarray:
    """Sum of ``per_entry`` over each branch's path entries (empty paths give 0)."""
    acc = np.zeros(len(per_entry) + 1, np.int64)
    np.cumsum(per_entry, out=acc[1:])
    return acc[path_off[1:]] - acc[path_off[:-1]]


def branch_table(
    data: NodeColumns,
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
    path_off, path_rows = branch_entries(data, br)
    out_off = np.zeros(n_branches + 1, np.int64)
    np.cumsum(per_branch_sum(path_off, data.n_tok[path_rows]), out=out_off[1:])
    total = int(out_off[-1])
    if total >= 2**31:
        raise ValueError("a view over more than 2**31 tokens: select fewer traces (or export, which streams)")
    offsets = pa.array(out_off.astype(np.int32))

    out: dict[str, pa.Array] = {
        "trace_id": br.column("trace_id").combine_chunks(),
        "branch_index": br.column("branch_index").combine_chunks(),
        "trainable": br.column("trainable").combine_chunks(),
    }
    if "token_ids" in columns or "sampled_mask" in columns:
        keep = first_use(data, br) if train_once else np.ones(len(path_rows), np.bool_)
        tokens = _buffers.empty(total, np.int32)
        mask = _buffers.empty(total, np.bool_)
        kernels().spread_tokens(
            0, n_branches, path_off, path_rows, keep, out_off, data.n_tok, data.tok_src, data.seg_values,
            data.prefix, data.slot_src, data.slots, tokens, mask,
        )  # fmt: skip
        out["token_ids"] = _list(tokens, offsets, pa.int32())
        out["sampled_mask"] = _list(mask, offsets, pa.bool_())
    for name in columns:
        if name not in data.streams:
            continue
        stream = data.streams[name]
        if name != "logprobs" and not stream.has[path_rows].any():  # no node on any path holds it: nulls
            out[name] = pa.nulls(n_branches, pa.list_(pa.float32()))
            continue
        values = _buffers.empty(total, np.float32)
        kernels().spread_stream(
            0, n_branches, path_off, path_rows, out_off, data.n_tok, data.prefix, data.slot_src, data.slots,
            stream.src, stream.take, stream.values, values,
        )  # fmt: skip
        held = None if name == "logprobs" else per_branch_sum(path_off, stream.has[path_rows]) > 0
        out[name] = _list(values, offsets, pa.float32(), held)
    if "loss_weights" in columns:
        out["loss_weights"] = _loss_weights(data, path_off, path_rows)
    if "policy_version" in columns:
        out["policy_version"] = _policy_versions(data, n_branches, path_off, path_rows, out_off, offsets, total)
    fields = [BRANCH_SCHEMA.field(c) for c in ("trace_id", "branch_index", "trainable", *columns)]
    return pa.Table.from_arrays([out[f.name] for f in fields], schema=pa.schema(fields))


def _policy_versions(
    data: NodeColumns,
    n_branches: int,
    path_off: np.ndarray,
    path_rows: np.ndarray,
    out_off: np.ndarray,
    offsets: pa.Array,
    total: int,
) -> pa.Array:
    """Each branch's tokens' policy versions (null off-sample and where unknown; None for a
    branch with no known one), gathered from ``data.versions`` along its path."""
    if data.versions is None:
        return pa.nulls(n_branches, pa.list_(pa.int32()))
    values = _buffers.empty(total, np.int32)
    scratch = _buffers.empty(total, np.bool_)
    node_starts = data.starts[:-1].astype(np.int64)
    no_prefix = np.zeros(len(data.n_tok), np.int64)  # the mask output is not used here
    kernels().spread_tokens(
        0, n_branches, path_off, path_rows, np.ones(len(path_rows), np.bool_), out_off, data.n_tok, node_starts,
        data.versions, no_prefix, data.slot_src, data.slots, values, scratch,
    )  # fmt: skip
    known = values != policy.UNKNOWN
    held = np.zeros(n_branches, np.bool_)  # a branch holds a known token (no per-token count)
    nonempty = out_off[1:] > out_off[:-1]
    if nonempty.any():
        held[nonempty] = np.logical_or.reduceat(known, out_off[:-1][nonempty])
    flat = pa.Array.from_buffers(
        pa.int32(),
        total,
        [pa.array(known).buffers()[1], values.base if isinstance(values.base, pa.Buffer) else pa.py_buffer(values)],
    )
    return pa.ListArray.from_arrays(offsets, flat, mask=None if held.all() else pa.array(~held))


def first_use(data: NodeColumns, br: pa.Table) -> np.ndarray:
    """Per path entry of ``br``: True where this branch owns the node (its first trainable
    branch, or its first branch when none holding it is trainable: :func:`owning_branch`)."""
    every = data.branches
    all_off, all_rows = branch_entries(data, every)
    owner = owning_branch(
        all_rows,
        np.repeat(np.arange(every.num_rows), np.diff(all_off)),
        every.column("trainable").to_numpy(zero_copy_only=False).astype(bool),
        len(data.n_tok),
    )
    # The number of each branch of ``br`` (possibly filtered) among all of them.
    key = {
        (t, b): i
        for i, (t, b) in enumerate(zip(every.column("trace_id").to_pylist(), every.column("branch_index").to_pylist()))
    }
    own = np.fromiter(
        (key[(t, b)] for t, b in zip(br.column("trace_id").to_pylist(), br.column("branch_index").to_pylist())),
        np.int64,
        br.num_rows,
    )
    offsets, rows = branch_entries(data, br)
    return owner[rows] == np.repeat(own, np.diff(offsets))


def _loss_weights(data: NodeColumns, path_off: np.ndarray, path_rows: np.ndarray) -> pa.Array:
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
