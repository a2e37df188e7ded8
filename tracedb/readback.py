"""The stored records read back out: a trace or an episode exactly as it was ingested,
the traces of a selection in arrival order (what a consumer of a live run polls), and
the database's counts and sizes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from tracedb import credit_sets
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
    credit = credit_sets.resolve(handle, credit)
    nodes = handle.sql(
        "SELECT n.* EXCLUDE (advantages), a.advantages, s.token_ids FROM nodes n "
        "JOIN segments s USING (segment_id) "
        "JOIN credit_advantages(?) a USING (trace_id, node_index) "
        "WHERE trace_id = ? ORDER BY node_index",
        [credit, trace_id],
    )
    if "nodes" in record:
        record["nodes"] = [_node_record(row, named_credit=credit is not None) for row in _rows(nodes)]
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


def _rows(table: pa.Table) -> list[dict[str, Any]]:
    cols = {name: table.column(name) for name in table.column_names}
    return [{name: col[i] for name, col in cols.items()} for i in range(table.num_rows)]


def _floats(scalar: pa.Scalar) -> list[float] | None:
    if not scalar.is_valid:
        return None
    return shortest(scalar.values.to_numpy(zero_copy_only=False))


def _node_record(row: dict[str, pa.Scalar], named_credit: bool = False) -> dict[str, Any]:
    present = row["present"].as_py()
    if named_credit:  # a named set decides by itself whether the node has advantages
        present = present | BIT["advantages"] if row["advantages"].is_valid else present & ~BIT["advantages"]

    def has(key: str) -> bool:
        return bool(present & BIT[key])

    node: dict[str, Any] = {}
    if has("parent"):
        node["parent"] = row["parent"].as_py()
    if has("semantic_parents"):
        kept = row["semantic_parents_record"].as_py()
        node["semantic_parents"] = json.loads(kept) if kept else row["semantic_parents"].as_py()
    if has("message"):
        node["message"] = json.loads(row["message"].as_py())
    if has("sampled"):
        node["sampled"] = row["sampled"].as_py()
    if has("timestamp"):
        node["timestamp"] = row["timestamp"].as_py()
    if has("token_ids"):
        node["token_ids"] = row["token_ids"].as_py()
    if has("mask"):
        n = row["n_tokens"].as_py()
        prefix = row["mask_prefix"].as_py()
        if prefix is not None:
            node["mask"] = [False] * prefix + [True] * (n - prefix)
        else:
            node["mask"] = [k > 0 for k in row["mask_slots"].as_py()]
    if has("is_content"):
        node["is_content"] = row["is_content"].as_py()
    for name in COMPACT_STREAMS:
        if has(name):
            node[name] = _floats(row[name])
    if has("loss_weights"):
        lw = row["loss_weights"]
        node["loss_weights"] = (
            None if not lw.is_valid else {k: shortest(np.asarray(v, np.float32)) for k, v in lw.as_py()}
        )
    if present & WEIGHT_VERSIONS_BIT:
        node["weight_versions"] = row["weight_versions"].as_py()
    extra = row["extra"].as_py()
    if extra:
        node.update(json.loads(extra))  # spans with keys of their own are here, whole
    return node
