"""The stored records read back out: a trace or an episode exactly as it was ingested,
the traces of a selection in arrival order (what a consumer of a live run polls), and
the database's counts and sizes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from tracedb import codec, credit_sets
from tracedb.errors import NotFound
from tracedb.handle import Handle
from tracedb.migrations import SCHEMA_VERSION
from tracedb.records import BIT, COMPACT_STREAMS, WEIGHT_VERSIONS_BIT
from tracedb.selection import Selection, completions, resolve, with_watermark


def trace_record(handle: Handle, trace_id: str, *, credit: str | None = None) -> dict[str, Any]:
    """The trace record exactly as ingested (per-token floats at float32 precision), with
    later write-backs; see :meth:`tracedb.Database.trace`."""
    row = handle.row("SELECT record FROM traces WHERE trace_id = ?", [trace_id])
    if row is None:
        raise NotFound(f"trace {trace_id!r} is not in {handle.path}")
    record = json.loads(row[0])
    if "nodes" not in record:
        return record
    credit = credit_sets.resolve(handle, credit)
    # The stored rows (token ids and streams as text, tracedb.codec), decoded here: a
    # named set's advantages come from its own tables, as a list.
    if credit is None:
        nodes = handle.sql(
            "SELECT n.*, s.token_ids AS segment_list, s.tokens AS segment_text FROM node_store n "
            "JOIN segment_store s USING (segment_id) WHERE n.trace_id = ? ORDER BY n.node_index",
            [trace_id],
        )
    else:
        nodes = handle.sql(
            "SELECT n.* EXCLUDE (advantages, advantages_list), a.advantages, s.token_ids AS segment_list, "
            "s.tokens AS segment_text FROM node_store n JOIN segment_store s USING (segment_id) "
            "JOIN credit_advantages(?) a USING (trace_id, node_index) WHERE n.trace_id = ? ORDER BY n.node_index",
            [credit, trace_id],
        )
    record["nodes"] = _node_records(nodes, named_credit=credit is not None)
    return record


def episode_record(handle: Handle, episode_id: str) -> dict[str, Any]:
    """The episode record exactly as ingested, with its traces."""
    row = handle.row("SELECT record FROM episodes WHERE episode_id = ?", [episode_id])
    if row is None:
        raise NotFound(f"episode {episode_id!r} is not in {handle.path}")
    record = json.loads(row[0])
    ids = handle.con.execute(
        "SELECT trace_id FROM traces WHERE episode_id = ? ORDER BY position", [episode_id]
    ).fetchall()
    record["traces"] = [trace_record(handle, r[0]) for r in ids]
    return record


def stats(handle: Handle) -> dict[str, Any]:
    """Counts and sizes: episodes, traces, nodes, branches, tokens, bytes, dedup ratio."""
    one = handle.scalar
    stored_tokens = one("SELECT coalesce(sum(n_tokens), 0) FROM segments")
    branch_tokens = one("SELECT coalesce(sum(n_tokens), 0) FROM branches")
    size = None
    if handle.path != ":memory:":
        size = sum(p.stat().st_size for p in (Path(handle.path), Path(handle.path + ".wal")) if p.exists())
    return {
        "path": handle.path,
        "schema_version": SCHEMA_VERSION,
        "episodes": one("SELECT count(*) FROM episodes"),
        "traces": one("SELECT count(*) FROM traces"),
        "nodes": one("SELECT count(*) FROM nodes"),
        "branches": one("SELECT count(*) FROM branches"),
        "segments": one("SELECT count(*) FROM segments"),
        "rejects": one("SELECT count(*) FROM rejects"),
        "tokens": int(one("SELECT coalesce(sum(n_tokens), 0) FROM nodes")),
        "sampled_tokens": int(one("SELECT coalesce(sum(n_sampled), 0) FROM nodes")),
        "branch_tokens": int(branch_tokens),
        "stored_tokens": int(stored_tokens),
        "dedup_ratio": round(branch_tokens / stored_tokens, 3) if stored_tokens else None,
        "bytes": size,
        "watermark": handle.watermark(),
    }


TRACE_LISTING = (
    "seq",
    "trace_id",
    "episode_id",
    "group_id",
    "reward",
    "ok",
    "is_completed",
    "is_timeout",
    "stop_condition",
    "n_nodes",
    "n_branches",
    "n_tokens",
    "n_sampled",
    "source",
    "line",
    "ingested_at",
    "dropped",
    "policy_min",
    "policy_max",
)
"""The columns of :func:`trace_listing` (then ``work_type``, the episode's, and ``tags``, a
JSON object of the trace's tags)."""


def trace_listing(handle: Handle, selection: Selection, limit: int | None = None) -> pa.Table:
    """The selected traces in sequence order (arrival), one row each: ``TRACE_LISTING``
    and ``tags``. The table carries the watermark to pass as ``after`` next time
    (:func:`tracedb.selection.watermark_of`): the selection's, or, when ``limit`` cut the
    listing short, the last row's sequence number (with ``complete_groups``, whole groups
    are listed, at least one, and the watermark is the last one's completion), so paging
    with it misses nothing and repeats nothing."""
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise ValueError(f"limit is a number of traces (an int >= 1), not {limit!r}")
    selected = resolve(handle, selection)
    ids = [tid for tid, _ in selected.traces]
    columns = ", ".join(f"t.{c}" for c in TRACE_LISTING)
    with handle.registered("_tdb_listing", pa.table({"trace_id": pa.array(ids, pa.string())})):
        table = handle.sql(
            f"SELECT {columns}, e.work_type, (SELECT json_group_object(g.name, g.value) FROM trace_tags g "
            "WHERE g.trace_id = t.trace_id) AS tags FROM traces t LEFT JOIN episodes e USING (episode_id) "
            "WHERE t.trace_id IN (SELECT trace_id FROM _tdb_listing) ORDER BY t.seq"
        )
    mark = selected.watermark
    if limit is not None and table.num_rows > limit:
        if selection.complete_groups is None:
            table = table.slice(0, limit)
            mark = table.column("seq")[limit - 1].as_py()
        else:
            groups = table.column("group_id").to_pylist()
            completed = completions(handle, groups, selection.complete_groups, selected.watermark)
            table, mark = _whole_groups(table, completed, limit)
    return with_watermark(table, mark)


def _whole_groups(table: pa.Table, completed: dict[str, int], limit: int) -> tuple[pa.Table, int]:
    """The groups of ``table`` in the order they completed (``completed``: group id to
    sequence number), as many whole ones as fit in ``limit`` rows (at least one); and the
    completion of the last one kept."""
    members: dict[str, list[int]] = {}
    for row, group in enumerate(table.column("group_id").to_pylist()):
        members.setdefault(group, []).append(row)
    keep: list[int] = []
    mark = 0
    for group in sorted(members, key=lambda g: (completed[g], g)):
        if keep and len(keep) + len(members[group]) > limit:
            break
        keep += members[group]
        mark = completed[group]
    return table.take(sorted(keep)), mark


def shortest(values: np.ndarray) -> list[float]:
    """float32 values as the shortest decimals that read back to the same float32."""
    if not len(values):
        return []
    text = pa.array(values, pa.float32()).cast(pa.string())
    return [float(v) for v in text.to_pylist()]


def _lists(column: pa.ChunkedArray) -> list[np.ndarray | None]:
    """Per row: the float32 values of a stream column (text or a list), None when null."""
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        values, offsets, valid = codec.stream_values(column)
    else:
        arr = column.combine_chunks()
        offsets = arr.offsets.to_numpy().astype(np.int64)
        values = arr.values.to_numpy(zero_copy_only=False)
        valid = arr.is_valid().to_numpy(zero_copy_only=False)
    return [values[offsets[i] : offsets[i + 1]] if valid[i] else None for i in range(len(valid))]


def _stream(nodes: pa.Table, name: str) -> list[np.ndarray | None]:
    """Per row: a stream's values, from its text or (a batch kept so) its list."""
    text = _lists(nodes.column(name))
    if f"{name}_list" not in nodes.column_names:
        return text
    return [t if v is None else v for t, v in zip(text, _lists(nodes.column(f"{name}_list")), strict=True)]


def _node_records(nodes: pa.Table, named_credit: bool = False) -> list[dict[str, Any]]:
    streams = {name: _stream(nodes, name) for name in COMPACT_STREAMS}
    text_ids, text_off, _ = codec.token_values(nodes.column("segment_text"))
    lists = nodes.column("segment_list").to_pylist()
    weights = codec.loss_weights_values(nodes.column("loss_weights"))
    listed = [c for c in nodes.column_names if c.endswith("_list") and c != "segment_list"]
    plain = nodes.drop_columns([*COMPACT_STREAMS, *listed, "loss_weights", "segment_list", "segment_text"]).to_pylist()
    out = []
    for i, row in enumerate(plain):
        ids = lists[i] if lists[i] is not None else text_ids[text_off[i] : text_off[i + 1]].tolist()
        values = {name: streams[name][i] for name in COMPACT_STREAMS}
        out.append(_node_record(row, ids, values, weights[i], named_credit=named_credit))
    return out


def _node_record(
    row: dict[str, Any],
    token_ids: list[int],
    streams: dict[str, np.ndarray | None],
    loss_weights: list[tuple[str, np.ndarray]] | None,
    named_credit: bool = False,
) -> dict[str, Any]:
    present = row["present"]
    if named_credit:  # a named set decides by itself whether the node has advantages
        present = present | BIT["advantages"] if streams["advantages"] is not None else present & ~BIT["advantages"]

    def has(key: str) -> bool:
        return bool(present & BIT[key])

    node: dict[str, Any] = {}
    if has("parent"):
        node["parent"] = row["parent"]
    if has("semantic_parents"):
        kept = row["semantic_parents_record"]
        node["semantic_parents"] = json.loads(kept) if kept else row["semantic_parents"]
    if has("message"):
        node["message"] = json.loads(row["message"])
    if has("sampled"):
        node["sampled"] = row["sampled"]
    if has("timestamp"):
        node["timestamp"] = row["timestamp"]
    if has("token_ids"):
        node["token_ids"] = token_ids
    if has("mask"):
        n = row["n_tokens"]
        prefix = row["mask_prefix"]
        if prefix is not None:
            node["mask"] = [False] * prefix + [True] * (n - prefix)
        else:
            node["mask"] = [k > 0 for k in row["mask_slots"]]
    if has("is_content"):
        node["is_content"] = row["is_content"]
    for name in COMPACT_STREAMS:
        if has(name):
            values = streams[name]
            node[name] = None if values is None else shortest(values)
    if has("loss_weights"):
        node["loss_weights"] = None if loss_weights is None else {k: shortest(v) for k, v in loss_weights}
    if present & WEIGHT_VERSIONS_BIT:
        node["weight_versions"] = row["weight_versions"]
    extra = row["extra"]
    if extra:
        node.update(json.loads(extra))  # spans with keys of their own are here, whole
    return node
