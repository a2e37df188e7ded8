"""The reference model of the write-back tests (``tests/store/test_writeback_*.py``): per-token
streams onto nodes, and named credit sets.

Every expectation is computed here from the fixture records (``tests/fixtures``) with a
plain reference spread (loops over the record dicts, nothing shared with tracedb): a
write is applied to a per-node model of the stream, and every read path is compared
with the model's spread: ``db.branches()``, SQL ``branch_tokens()``, a Parquet export
read back, and ``db.trace()``. Atomicity is checked on the full stored state (every
writable node column, the credit table and the set registry), before and after.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

import tracedb

from support import FIXTURES
from support.credit_groups import leaf_paths

COMPACT = ("advantages", "reference_logprobs", "trainer_logprobs", "entropies")

# --------------------------------------------------------------------------- records


def _records() -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    records, by_file = {}, {}
    for path in sorted(FIXTURES.glob("*.traces.jsonl")):
        for line in path.read_text().splitlines():
            for trace in json.loads(line)["traces"]:
                records[trace["id"]] = trace
                by_file.setdefault(path.name.removesuffix(".traces.jsonl"), trace["id"])
    return records, by_file


RECORDS, FIRST_TRACE = _records()
"""Every fixture trace by id; the first trace id of each fixture file by file name."""

FORK = FIRST_TRACE["subagent_fork"]  # two branches sharing nodes 0-4
ODD_MASK = FIRST_TRACE["noncanonical_mask"]  # sampled tokens scattered inside nodes
LINEAR = FIRST_TRACE["linear"]  # no credit ingested
ZERO = FIRST_TRACE["zero_credit"]  # zeros ingested
FOREST = FIRST_TRACE["forest"]  # two roots
WEIGHTED = FIRST_TRACE["loss_weights"]  # loss_weights {"rl": ...} ingested
TARGETS = (FORK, ODD_MASK, LINEAR, FOREST)


def nodes_of(tid: str) -> list[dict[str, Any]]:
    return RECORDS[tid]["nodes"]


def n_sampled(tid: str, node: int) -> int:
    return sum(nodes_of(tid)[node].get("mask") or [])


def n_tokens(tid: str, node: int) -> int:
    return len(nodes_of(tid)[node].get("token_ids") or [])


def sampled_nodes(tid: str) -> list[int]:
    return [i for i in range(len(nodes_of(tid))) if n_sampled(tid, i)]


def paths(tid: str) -> list[list[int]]:
    """Root-to-leaf node paths, one per leaf in node order."""
    return leaf_paths(nodes_of(tid))


def widen(mask: list[bool], values: list[float] | None) -> list[float]:
    values = values or []
    out, k = [], 0
    for sampled in mask:
        out.append(float(values[k]) if sampled and k < len(values) else 0.0)
        k += bool(sampled)
    return out


Model = dict[str, list[Any]]
"""trace id -> per-node value (compact list / None, or a loss_weights dict / None)."""


def ingested(stream: str, tids: list[str]) -> Model:
    return {tid: [n.get(stream) for n in nodes_of(tid)] for tid in tids}


def unassigned(tids: list[str]) -> Model:
    return {tid: [None] * len(nodes_of(tid)) for tid in tids}


def spread(model: Model) -> dict[tuple[str, int], np.ndarray | None]:
    """Compact stream model -> per-branch full layout, None when no node on the path holds it."""
    out = {}
    for tid in sorted(model):
        for b, path in enumerate(paths(tid)):
            if all(model[tid][n] is None for n in path):
                out[(tid, b)] = None
            else:
                flat = [x for n in path for x in widen(nodes_of(tid)[n].get("mask") or [], model[tid][n])]
                out[(tid, b)] = np.asarray(flat, np.float32)
    return out


def spread_weights(model: Model) -> dict[tuple[str, int], dict[str, np.ndarray]]:
    """loss_weights model -> per-branch {name: full layout}, zeros on nodes lacking a name."""
    out = {}
    for tid in sorted(model):
        for b, path in enumerate(paths(tid)):
            names = sorted({k for n in path for k in (model[tid][n] or {})})
            out[(tid, b)] = {
                name: np.asarray(
                    [x for n in path for x in ((model[tid][n] or {}).get(name) or [0.0] * n_tokens(tid, n))],
                    np.float32,
                )
                for name in names
            }
    return out


def f32(values: Any) -> list[float]:
    """Values as exact float32 numbers (what tracedb stores), as Python floats."""
    return np.asarray(values, np.float32).tolist()


def rand(rng: np.random.Generator, n: int) -> list[float]:
    return f32(np.round(rng.normal(size=n), 3))


# --------------------------------------------------------------------------- read paths


def _same(got: dict, want: dict, where: str) -> None:
    assert sorted(got) == sorted(want), where
    for key in want:
        g, w = got[key], want[key]
        if w is None:
            assert g is None, f"{where} {key}: expected None (unassigned), got {g}"
        else:
            assert g is not None, f"{where} {key}: expected values, got None"
            np.testing.assert_array_equal(np.asarray(g, np.float32), w, err_msg=f"{where} {key}")


def keyed(table: pa.Table, column: str) -> dict[tuple[str, int], Any]:
    return dict(
        zip(
            zip(table.column("trace_id").to_pylist(), table.column("branch_index").to_pylist()),
            table.column(column).to_pylist(),
        )
    )


def assert_reads(
    db: tracedb.Database, tmp: Path, model: Model, stream: str = "advantages", credit: str | None = None
) -> None:
    """Every read path shows exactly the model: view, SQL, Parquet export, db.trace()."""
    tids = sorted(model)
    want = spread(model)
    view = db.branches(trace_ids=tids, credit=credit, columns=[stream])
    _same(keyed(view, stream), want, "db.branches")
    sql = db.sql(
        f"SELECT trace_id, branch_index, {stream} FROM branch_tokens(credit := ?) "
        "WHERE trace_id IN (SELECT unnest(?::VARCHAR[]))",
        [credit, tids],
    )
    _same(keyed(sql, stream), want, "branch_tokens()")
    out = tmp / f"export-{stream}-{credit}.parquet"
    db.export(out, trace_ids=tids, credit=credit)
    _same(keyed(pq.read_table(out), stream), want, "export")
    for tid in tids:
        got = [n.get(stream) for n in db.trace(tid, credit=credit)["nodes"]]
        for i, (g, w) in enumerate(zip(got, model[tid], strict=True)):
            where = f"db.trace({tid}) node {i}"
            assert (g is None) == (w is None), f"{where}: {g} vs {w}"
            if w is not None:
                assert f32(g) == f32(w), where


def assert_weight_reads(db: tracedb.Database, tmp: Path, model: Model) -> None:
    tids = sorted(model)
    want = spread_weights(model)
    views = {
        "db.branches": db.branches(trace_ids=tids, columns=["loss_weights"]),
        "branch_tokens()": db.sql(
            "SELECT trace_id, branch_index, loss_weights FROM branch_tokens() "
            "WHERE trace_id IN (SELECT unnest(?::VARCHAR[]))",
            [tids],
        ),
    }
    db.export(tmp / "weights.parquet", trace_ids=tids)
    views["export"] = pq.read_table(tmp / "weights.parquet")
    for where, table in views.items():
        got = {k: dict(v) for k, v in keyed(table, "loss_weights").items()}
        assert sorted(got) == sorted(want), where
        for key in want:
            assert sorted(got[key]) == sorted(want[key]), f"{where} {key}"
            for name in want[key]:
                np.testing.assert_array_equal(np.asarray(got[key][name], np.float32), want[key][name], f"{where} {key}")
    for tid in tids:
        got = [n.get("loss_weights") for n in db.trace(tid)["nodes"]]
        assert [None if g is None else {k: f32(v) for k, v in g.items()} for g in got] == [
            None if w is None else {k: f32(v) for k, v in w.items()} for w in model[tid]
        ], f"db.trace({tid})"


def state(db: tracedb.Database) -> dict[str, list[dict[str, Any]]]:
    """Everything a write may touch."""
    return {
        "nodes": db.sql(
            "SELECT trace_id, node_index, advantages, reference_logprobs, trainer_logprobs, entropies, "
            "map_entries(loss_weights) AS loss_weights, present FROM nodes ORDER BY trace_id, node_index"
        ).to_pylist(),
        "credit": db.sql("SELECT * FROM credit ORDER BY credit_set, trace_id, node_index").to_pylist(),
        "trace_credit": db.sql("SELECT * FROM trace_credit ORDER BY credit_set, trace_id").to_pylist(),
        "credit_sets": db.sql("SELECT * FROM credit_sets ORDER BY name").to_pylist(),
    }


def stored(db: tracedb.Database, tid: str, stream: str = "advantages", credit: str | None = None) -> list[Any]:
    """Per-node compact values of one trace, from SQL (None = unassigned)."""
    rows = db.sql(
        f"SELECT node_index, {stream} AS v FROM nodes WHERE trace_id = ? ORDER BY node_index"
        if credit is None
        else "SELECT node_index, advantages AS v FROM credit_advantages(?) WHERE trace_id = ? ORDER BY node_index",
        [tid] if credit is None else [credit, tid],
    ).to_pylist()
    return [r["v"] for r in rows]


def as_kind(rows: list[dict[str, Any]], kind: str) -> Any:
    if kind == "dicts":
        return rows
    if kind == "polars":
        return pl.DataFrame(rows)
    return pa.Table.from_pylist(rows)


def branch_layout(db: tracedb.Database, tid: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """(token_ids, sampled_mask) of each branch of a trace, from the view."""
    view = db.branches(trace_ids=[tid], columns=["token_ids", "sampled_mask"])
    return [
        (np.asarray(t), np.asarray(m, bool))
        for t, m in zip(view.column("token_ids").to_pylist(), view.column("sampled_mask").to_pylist())
    ]


def node_model_from_branch(tid: str, branch: int, full: np.ndarray, compact: bool) -> dict[int, list[float]]:
    """Reference projection of full-layout branch values onto the path's nodes."""
    out, offset = {}, 0
    for node in paths(tid)[branch]:
        size = n_tokens(tid, node)
        piece = full[offset : offset + size]
        mask = np.asarray(nodes_of(tid)[node].get("mask") or [], bool)
        out[node] = f32(piece[mask] if compact else piece)
        offset += size
    return out


SMALL = [p for p in sorted(FIXTURES.glob("*.traces.jsonl")) if not p.name.startswith("groups.")]
