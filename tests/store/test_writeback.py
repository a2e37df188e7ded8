"""Write-back of per-token streams onto nodes, and named credit sets.

Every expectation is computed here from the fixture records (``tests/fixtures``) with a
plain reference spread (loops over the record dicts, nothing shared with tracedb): a
write is applied to a per-node model of the stream, and every read path is compared
with the model's spread: ``db.branches()``, SQL ``branch_tokens()``, a Parquet export
read back, and ``db.trace()``. Atomicity is checked on the full stored state (every
writable node column, the credit table and the set registry), before and after.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import tracedb
import tracedb.credit
from tracedb.errors import WriteError

from support import FIXTURES

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
    nodes = nodes_of(tid)
    parents = {n.get("parent") for n in nodes}
    out = []
    for leaf in range(len(nodes)):
        if leaf in parents:
            continue
        path, at = [], leaf
        while at is not None:
            path.append(at)
            at = nodes[at].get("parent")
        out.append(path[::-1])
    return out


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


def _keyed(table: pa.Table, column: str) -> dict[tuple[str, int], Any]:
    return dict(
        zip(
            zip(table.column("trace_id").to_pylist(), table.column("branch_index").to_pylist()),
            table.column(column).to_pylist(),
        )
    )


def assert_reads(db: tracedb.Database, tmp: Path, model: Model, stream: str = "advantages", credit=None) -> None:
    """Every read path shows exactly the model: view, SQL, Parquet export, db.trace()."""
    tids = sorted(model)
    want = spread(model)
    view = db.branches(trace_ids=tids, credit=credit, columns=[stream])
    _same(_keyed(view, stream), want, "db.branches")
    sql = db.sql(
        f"SELECT trace_id, branch_index, {stream} FROM branch_tokens(credit := ?) "
        "WHERE trace_id IN (SELECT unnest(?::VARCHAR[]))",
        [credit, tids],
    )
    _same(_keyed(sql, stream), want, "branch_tokens()")
    out = tmp / f"export-{stream}-{credit}.parquet"
    db.export(out, trace_ids=tids, credit=credit)
    _same(_keyed(pq.read_table(out), stream), want, "export")
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
        got = {k: dict(v) for k, v in _keyed(table, "loss_weights").items()}
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


@pytest.fixture
def db():
    """The fixtures without the 32-episode groups file (credit algorithms use fixture_db)."""
    with tracedb.connect(":memory:") as database:
        assert database.ingest(SMALL).ok
        yield database


@pytest.fixture(scope="module")
def shared_db():
    """One database for the tests that expect a refusal. Each of them compares the full
    state before and after, so a write that leaks fails the test that leaked it."""
    with tracedb.connect(":memory:") as db:
        assert db.ingest(FIXTURES).ok
        db.create_credit_set("manual")
        db.write_traces([{"trace_id": LINEAR, "value": 3.0}], credit="manual")
        yield db


# =========================================================================== inputs


@pytest.mark.parametrize("kind", ["arrow", "polars", "dicts"])
def test_every_layout_accepts_arrow_polars_and_dicts(db, kind):
    rng = np.random.default_rng(2)
    rows = [
        {"trace_id": LINEAR, "node_index": n, "values": rand(rng, n_sampled(LINEAR, n))} for n in sampled_nodes(LINEAR)
    ]
    db.write_nodes(as_kind(rows, kind))
    db.write_traces(as_kind([{"trace_id": FORK, "value": 0.5}, {"trace_id": FOREST, "value": -2.0}], kind))
    (_, mask), *_ = branch_layout(db, ODD_MASK)
    full = np.where(mask, 0.75, 0.0).tolist()
    db.write_branches(as_kind([{"trace_id": ODD_MASK, "branch_index": 0, "values": full}], kind))
    got = stored(db, LINEAR)
    for row in rows:
        assert f32(got[row["node_index"]]) == row["values"]
    for tid, value in ((FORK, 0.5), (FOREST, -2.0), (ODD_MASK, 0.75)):
        got = stored(db, tid)
        for node in sampled_nodes(tid):
            assert got[node] == [value] * n_sampled(tid, node), (tid, node)


# =========================================================================== per node


@pytest.mark.parametrize("stream", COMPACT)
def test_write_nodes_shows_on_every_read_path(db, tmp_path, stream):
    rng = np.random.default_rng(1)
    model = ingested(stream, list(TARGETS))
    rows = []
    for tid in TARGETS:
        for k, node in enumerate(sampled_nodes(tid)):
            values = [0.0] * n_sampled(tid, node) if k % 3 == 1 else rand(rng, n_sampled(tid, node))
            if k % 3 == 2:
                values = None  # back to unassigned
            rows.append({"trace_id": tid, "node_index": node, "values": values})
            model[tid][node] = values
    assert db.write_nodes(rows, stream=stream) == len(rows)
    assert_reads(db, tmp_path, model, stream)


def test_write_nodes_misaligned_names_trace_node_and_lengths(shared_db):
    node = sampled_nodes(LINEAR)[1]
    expected = n_sampled(LINEAR, node)
    before = state(shared_db)
    with pytest.raises(WriteError) as err:
        shared_db.write_nodes([{"trace_id": LINEAR, "node_index": node, "values": [0.5] * (expected + 2)}])
    msg = str(err.value)
    assert LINEAR in msg and re.search(rf"\bnode {node}\b", msg), msg
    assert re.search(rf"\b{expected}\b", msg) and re.search(rf"\b{expected + 2}\b", msg), msg
    assert state(shared_db) == before


def test_write_nodes_unknown_trace_refused(shared_db):
    before = state(shared_db)
    with pytest.raises(tracedb.TraceDBError, match="no-such-trace"):
        shared_db.write_nodes([{"trace_id": "no-such-trace", "node_index": 0, "values": []}])
    assert state(shared_db) == before


def test_write_nodes_unknown_node_refused(shared_db):
    missing = len(nodes_of(LINEAR))
    before = state(shared_db)
    with pytest.raises(tracedb.TraceDBError) as err:
        shared_db.write_nodes([{"trace_id": LINEAR, "node_index": missing, "values": [1.0]}])
    assert LINEAR in str(err.value) and re.search(rf"\bnode {missing}\b", str(err.value)), str(err.value)
    assert state(shared_db) == before


@pytest.mark.parametrize(
    "stream,bad",
    list(zip(COMPACT, [float("nan"), float("inf"), float("-inf"), float("nan")])),
)
def test_write_nodes_nonfinite_refused(shared_db, stream, bad):
    node = sampled_nodes(LINEAR)[0]
    values = [0.25] * n_sampled(LINEAR, node)
    values[3] = bad
    before = state(shared_db)
    with pytest.raises(WriteError, match=LINEAR):
        shared_db.write_nodes([{"trace_id": LINEAR, "node_index": node, "values": values}], stream=stream)
    assert state(shared_db) == before


def test_write_nodes_one_node_two_values_refused(shared_db):
    node = sampled_nodes(LINEAR)[0]
    n = n_sampled(LINEAR, node)
    before = state(shared_db)
    with pytest.raises(WriteError, match=rf"node {node}\b"):
        shared_db.write_nodes(
            [
                {"trace_id": LINEAR, "node_index": node, "values": [1.0] * n},
                {"trace_id": LINEAR, "node_index": node, "values": [2.0] * n},
            ]
        )
    assert state(shared_db) == before


# =========================================================================== per trace


@pytest.mark.parametrize("credit", [None, "manual"])
def test_write_traces_scalar_broadcasts_over_every_sampled_token(db, tmp_path, credit):
    if credit:
        db.create_credit_set(credit)
    model = ingested("advantages", list(TARGETS)) if credit is None else unassigned(list(TARGETS))
    rows = []
    for k, tid in enumerate(TARGETS):
        value = [0.0, -1.5, 2.25, 0.125][k]
        rows.append({"trace_id": tid, "value": value})
        for node in sampled_nodes(tid):
            model[tid][node] = [value] * n_sampled(tid, node)
    db.write_traces(rows, credit=credit)
    assert_reads(db, tmp_path, model, credit=credit)
    view = db.branches(trace_ids=list(TARGETS), credit=credit, columns=["sampled_mask", "advantages"])
    value_of = {r["trace_id"]: r["value"] for r in rows}
    for tid, mask, adv in zip(*(view.column(c).to_pylist() for c in ("trace_id", "sampled_mask", "advantages"))):
        mask = np.asarray(mask, bool)
        assert (np.asarray(adv)[mask] == value_of[tid]).all() and (np.asarray(adv)[~mask] == 0).all()


@pytest.mark.parametrize("stream", COMPACT)
def test_write_traces_values_list_split_over_nodes_in_order(db, tmp_path, stream):
    rng = np.random.default_rng(3)
    model = ingested(stream, list(TARGETS))
    rows = []
    for tid in TARGETS:
        total = sum(n_sampled(tid, n) for n in range(len(nodes_of(tid))))
        values = rand(rng, total)
        rows.append({"trace_id": tid, "values": values})
        offset = 0
        for node in sampled_nodes(tid):
            model[tid][node] = values[offset : offset + n_sampled(tid, node)]
            offset += n_sampled(tid, node)
    db.write_traces(rows, stream=stream)
    assert_reads(db, tmp_path, model, stream)


def test_write_traces_misaligned_names_trace_and_lengths(shared_db):
    total = sum(n_sampled(LINEAR, n) for n in range(len(nodes_of(LINEAR))))
    before = state(shared_db)
    with pytest.raises(WriteError) as err:
        shared_db.write_traces([{"trace_id": LINEAR, "values": [0.0] * (total - 1)}])
    msg = str(err.value)
    assert LINEAR in msg and re.search(rf"\b{total}\b", msg) and re.search(rf"\b{total - 1}\b", msg), msg
    assert state(shared_db) == before


@pytest.mark.parametrize("column,bad", [("value", float("nan")), ("value", float("-inf")), ("values", float("inf"))])
def test_write_traces_nonfinite_refused(shared_db, column, bad):
    row = {"trace_id": LINEAR, "value": bad}
    if column == "values":
        total = sum(n_sampled(LINEAR, n) for n in range(len(nodes_of(LINEAR))))
        row = {"trace_id": LINEAR, "values": [0.5] * 7 + [bad] + [0.5] * (total - 8)}
    before = state(shared_db)
    with pytest.raises(WriteError, match=LINEAR):
        shared_db.write_traces([row])
    assert state(shared_db) == before


def test_write_traces_unknown_trace_refused(shared_db):
    before = state(shared_db)
    with pytest.raises(tracedb.TraceDBError, match="no-such-trace"):
        shared_db.write_traces([{"trace_id": "no-such-trace", "value": 1.0}])
    assert state(shared_db) == before


# =========================================================================== per branch


@pytest.mark.parametrize("stream", COMPACT)
def test_write_branches_project_onto_sampled_positions(db, tmp_path, stream):
    rng = np.random.default_rng(4)
    model = ingested(stream, [ODD_MASK, FOREST, FORK])
    rows = []
    for tid in (ODD_MASK, FOREST):
        for b, (_, mask) in enumerate(branch_layout(db, tid)):
            full = np.where(mask, np.round(rng.normal(size=len(mask)), 3), 0.0).astype(np.float32)
            rows.append({"trace_id": tid, "branch_index": b, "values": full.tolist()})
            for node, values in node_model_from_branch(tid, b, full, compact=True).items():
                model[tid][node] = values
    # FORK: both branches written, agreeing on their shared nodes.
    per_node = {n: rand(rng, n_sampled(FORK, n)) for n in range(len(nodes_of(FORK)))}
    for b, path in enumerate(paths(FORK)):
        full = [x for n in path for x in widen(nodes_of(FORK)[n]["mask"], per_node[n])]
        rows.append({"trace_id": FORK, "branch_index": b, "values": full})
        for n in path:
            model[FORK][n] = per_node[n]
    db.write_branches(rows, stream=stream)
    assert_reads(db, tmp_path, model, stream)
    # What went in per branch is what a view gives back.
    view = _keyed(db.branches(trace_ids=[ODD_MASK, FOREST, FORK], columns=[stream]), stream)
    for row in rows:
        assert f32(view[(row["trace_id"], row["branch_index"])]) == f32(row["values"])


def test_write_branches_nonzero_on_unsampled_token_refused(shared_db):
    (_, mask), *_ = branch_layout(shared_db, ODD_MASK)
    full = np.where(mask, 1.0, 0.0)
    full[np.flatnonzero(~mask)[-1]] = 0.5  # an unsampled position inside a sampled node
    before = state(shared_db)
    with pytest.raises(WriteError, match=ODD_MASK):
        shared_db.write_branches([{"trace_id": ODD_MASK, "branch_index": 0, "values": full.tolist()}])
    assert state(shared_db) == before


def test_write_branches_shared_node_with_two_values_names_node_and_branches(shared_db):
    shared = sorted(set(paths(FORK)[0]) & set(paths(FORK)[1]))
    conflicted = [n for n in shared if n_sampled(FORK, n)][-1]
    per_node = {n: [0.5] * n_sampled(FORK, n) for n in range(len(nodes_of(FORK)))}
    rows = []
    for b, path in enumerate(paths(FORK)):
        values = dict(per_node)
        if b == 1:
            values[conflicted] = [-0.5] * n_sampled(FORK, conflicted)
        full = [x for n in path for x in widen(nodes_of(FORK)[n]["mask"], values[n])]
        rows.append({"trace_id": FORK, "branch_index": b, "values": full})
    before = state(shared_db)
    with pytest.raises(WriteError) as err:
        shared_db.write_branches(rows)
    msg = str(err.value)
    assert FORK in msg and re.search(rf"\bnode {conflicted}\b", msg), msg
    assert re.search(r"branch\w*\s+0\b\D+\b1\b", msg), msg
    assert state(shared_db) == before


def test_write_branches_misaligned_names_trace_branch_and_lengths(shared_db):
    (tokens, _), *_ = branch_layout(shared_db, LINEAR)
    before = state(shared_db)
    with pytest.raises(WriteError) as err:
        shared_db.write_branches([{"trace_id": LINEAR, "branch_index": 0, "values": [0.0] * (len(tokens) + 3)}])
    msg = str(err.value)
    assert LINEAR in msg and re.search(rf"\b{len(tokens)}\b", msg) and re.search(rf"\b{len(tokens) + 3}\b", msg)
    assert state(shared_db) == before


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_write_branches_nonfinite_refused(shared_db, bad):
    (_, mask), *_ = branch_layout(shared_db, LINEAR)
    full = np.where(mask, 1.0, 0.0)
    full[np.flatnonzero(mask)[2]] = bad
    before = state(shared_db)
    with pytest.raises(WriteError, match=LINEAR):
        shared_db.write_branches([{"trace_id": LINEAR, "branch_index": 0, "values": full.tolist()}])
    assert state(shared_db) == before


def test_write_branches_unknown_branch_refused(shared_db):
    before = state(shared_db)
    with pytest.raises(tracedb.TraceDBError, match=LINEAR):
        shared_db.write_branches([{"trace_id": LINEAR, "branch_index": 5, "values": [0.0]}])
    assert state(shared_db) == before


@pytest.mark.parametrize("layout", ["nodes", "traces", "branches"])
def test_null_inside_a_values_list_refused(shared_db, layout):
    """A missing value inside a list is not a value: it would read back as NaN."""
    if layout == "nodes":
        node = sampled_nodes(LINEAR)[0]
        row = {"trace_id": LINEAR, "node_index": node, "values": [0.5] * n_sampled(LINEAR, node)}
        row["values"][3] = None
    elif layout == "traces":
        total = sum(n_sampled(LINEAR, n) for n in range(len(nodes_of(LINEAR))))
        row = {"trace_id": LINEAR, "values": [0.5] * total}
        row["values"][3] = None
    else:
        (_, mask), *_ = branch_layout(shared_db, LINEAR)
        row = {"trace_id": LINEAR, "branch_index": 0, "values": np.where(mask, 0.5, 0.0).tolist()}
        row["values"][int(np.flatnonzero(mask)[3])] = None
    before = state(shared_db)
    with pytest.raises(WriteError, match=LINEAR):
        getattr(shared_db, f"write_{layout}")([row], stream="entropies")
    assert state(shared_db) == before


# =========================================================================== atomic batches


def _good_rows(layout: str, db: tracedb.Database) -> list[dict[str, Any]]:
    rng = np.random.default_rng(5)
    if layout == "nodes":
        return [
            {"trace_id": tid, "node_index": n, "values": rand(rng, n_sampled(tid, n))}
            for tid in TARGETS
            for n in sampled_nodes(tid)
        ]
    if layout == "traces":
        return [{"trace_id": tid, "value": float(k) + 0.5} for k, tid in enumerate(TARGETS)]
    rows = []
    for tid in (LINEAR, ODD_MASK, FOREST):
        for b, (_, mask) in enumerate(branch_layout(db, tid)):
            rows.append({"trace_id": tid, "branch_index": b, "values": np.where(mask, 0.25 * (b + 1), 0.0).tolist()})
    return rows


def _bad_row(layout: str, bad: str, db: tracedb.Database) -> dict[str, Any]:
    node = sampled_nodes(ZERO)[0]
    size = n_sampled(ZERO, node)
    if layout == "nodes":
        values = {
            "misaligned": [1.0] * (size - 1),
            "nan": [float("nan")] * size,
            "unknown_node": [1.0],
            "unknown_trace": [1.0],
        }[bad]
        index = len(nodes_of(ZERO)) if bad == "unknown_node" else node
        return {"trace_id": "nope" if bad == "unknown_trace" else ZERO, "node_index": index, "values": values}
    if layout == "traces":
        total = sum(n_sampled(ZERO, n) for n in range(len(nodes_of(ZERO))))
        row = {"trace_id": "nope" if bad == "unknown_trace" else ZERO, "value": None, "values": None}
        if bad == "nan":
            row["value"] = float("nan")
        else:
            row["values"] = [1.0] * (total + (1 if bad == "misaligned" else 0))
        return row
    (_, mask), *_ = branch_layout(db, ZERO)
    full = np.where(mask, 1.0, 0.0)
    if bad == "nan":
        full[np.flatnonzero(mask)[0]] = float("nan")
    if bad == "unsampled_nonzero":
        full[0] = 1.0
    if bad == "misaligned":
        full = full[:-1]
    return {
        "trace_id": "nope" if bad == "unknown_trace" else ZERO,
        "branch_index": 9 if bad == "unknown_branch" else 0,
        "values": full.tolist(),
    }


ATOMIC = [
    *[("nodes", b) for b in ("misaligned", "nan", "unknown_node", "unknown_trace")],
    *[("traces", b) for b in ("misaligned", "nan", "unknown_trace")],
    *[("branches", b) for b in ("misaligned", "nan", "unsampled_nonzero", "unknown_branch", "unknown_trace")],
]


@pytest.mark.parametrize("credit", [None, "manual"])
@pytest.mark.parametrize("layout,bad", ATOMIC)
def test_batch_with_one_bad_row_writes_nothing(shared_db, layout, bad, credit):
    good = _good_rows(layout, shared_db)
    if layout == "traces":
        good = [{**r, "values": None} for r in good]
    bad_row = _bad_row(layout, bad, shared_db)
    middle = len(good) // 2
    before = state(shared_db)
    with pytest.raises(tracedb.TraceDBError) as err:
        getattr(shared_db, f"write_{layout}")([*good[:middle], bad_row, *good[middle:]], credit=credit)
    assert bad_row["trace_id"] in str(err.value)  # refused for the bad row, not a good one
    assert state(shared_db) == before


# =========================================================================== clear


@pytest.mark.parametrize("stream", COMPACT)
def test_clear_returns_nodes_to_none_and_zeros_stay_zeros(db, tmp_path, stream):
    model = ingested(stream, [LINEAR, FORK, ZERO])
    db.write_traces([{"trace_id": LINEAR, "value": 0.0}, {"trace_id": FORK, "value": 1.5}], stream=stream)
    for tid, value in ((LINEAR, 0.0), (FORK, 1.5)):
        for node in sampled_nodes(tid):
            model[tid][node] = [value] * n_sampled(tid, node)
    db.clear(stream=stream, trace_ids=[FORK])
    model[FORK] = [None] * len(nodes_of(FORK))
    assert_reads(db, tmp_path, model, stream)


@pytest.mark.parametrize("credit", [None, "manual"])
def test_write_null_clears_a_node_or_a_trace(db, tmp_path, credit):
    model = ingested("advantages", [ZERO, FORK])
    if credit:  # a named set with the same credit as the default one, to clear
        db.create_credit_set(credit)
        db.write_nodes(
            [{"trace_id": t, "node_index": i, "values": v} for t in model for i, v in enumerate(model[t])],
            credit=credit,
        )
    node = sampled_nodes(ZERO)[0]
    assert model[ZERO][node] is not None  # ingested zeros
    db.write_nodes(pa.table({"trace_id": [ZERO], "node_index": [node], "values": pa.nulls(1)}), credit=credit)
    model[ZERO][node] = None
    db.write_traces(pa.table({"trace_id": [FORK], "value": pa.nulls(1, pa.float64())}), credit=credit)
    model[FORK] = [None if n_sampled(FORK, i) else v for i, v in enumerate(model[FORK])]
    assert_reads(db, tmp_path, model, credit=credit)


def test_clear_one_stream_keeps_the_others(db):
    rows = [{"trace_id": LINEAR, "value": 0.5}]
    for stream in COMPACT:
        db.write_traces(rows, stream=stream)
    db.clear(stream="entropies", trace_ids=[LINEAR])
    node = sampled_nodes(LINEAR)[0]
    assert stored(db, LINEAR, "entropies")[node] is None
    for stream in COMPACT[:-1]:
        assert stored(db, LINEAR, stream)[node] == [0.5] * n_sampled(LINEAR, node)


# =========================================================================== loss_weights


def test_loss_weights_per_node_full_layout_keeps_other_names(db, tmp_path):
    rng = np.random.default_rng(6)
    model = ingested("loss_weights", [WEIGHTED, LINEAR])
    model = {tid: [dict(v) if v else None for v in nodes] for tid, nodes in model.items()}
    rows = []
    for tid in (WEIGHTED, LINEAR):
        for node in (0, *sampled_nodes(tid)[:2]):  # an unsampled node takes weights too
            values = rand(rng, n_tokens(tid, node))
            rows.append({"trace_id": tid, "node_index": node, "values": values})
            model[tid][node] = {**(model[tid][node] or {}), "kl": values}
    db.write_nodes(rows, stream="loss_weights", name="kl")
    assert_weight_reads(db, tmp_path, model)


def test_loss_weights_per_branch_take_every_position(db, tmp_path):
    model = ingested("loss_weights", [WEIGHTED, FORK])
    model = {tid: [dict(v) if v else None for v in nodes] for tid, nodes in model.items()}
    rows = []
    for tid in (WEIGHTED, FORK):
        for b, (tokens, _) in enumerate(branch_layout(db, tid)):
            full = np.asarray(f32(np.linspace(-1, 1, len(tokens)) if tid == WEIGHTED else np.full(len(tokens), 0.5)))
            rows.append({"trace_id": tid, "branch_index": b, "values": full.tolist()})
            for node, values in node_model_from_branch(tid, b, full, compact=False).items():
                model[tid][node] = {**(model[tid][node] or {}), "sft": values}
    db.write_branches(rows, stream="loss_weights", name="sft")
    assert_weight_reads(db, tmp_path, model)


def test_loss_weights_misaligned_names_trace_node_and_lengths(shared_db):
    node = sampled_nodes(WEIGHTED)[0]
    expected, wrong = n_tokens(WEIGHTED, node), n_sampled(WEIGHTED, node)  # compact length is wrong here
    before = state(shared_db)
    with pytest.raises(WriteError) as err:
        shared_db.write_nodes(
            [{"trace_id": WEIGHTED, "node_index": node, "values": [1.0] * wrong}], stream="loss_weights", name="kl"
        )
    msg = str(err.value)
    assert WEIGHTED in msg and re.search(rf"\bnode {node}\b", msg), msg
    assert re.search(rf"\b{expected}\b", msg) and re.search(rf"\b{wrong}\b", msg), msg
    assert state(shared_db) == before


def test_loss_weights_nonfinite_refused(shared_db):
    node = sampled_nodes(WEIGHTED)[0]
    values = [1.0] * n_tokens(WEIGHTED, node)
    values[0] = float("inf")
    before = state(shared_db)
    with pytest.raises(WriteError, match=WEIGHTED):
        shared_db.write_nodes(
            [{"trace_id": WEIGHTED, "node_index": node, "values": values}], stream="loss_weights", name="kl"
        )
    assert state(shared_db) == before


def test_loss_weights_need_a_name(shared_db):
    node = sampled_nodes(WEIGHTED)[0]
    before = state(shared_db)
    with pytest.raises(WriteError):
        shared_db.write_nodes(
            [{"trace_id": WEIGHTED, "node_index": node, "values": [1.0] * n_tokens(WEIGHTED, node)}],
            stream="loss_weights",
        )
    assert state(shared_db) == before


def test_clear_one_loss_weight_name_keeps_the_others(db, tmp_path):
    model = ingested("loss_weights", [WEIGHTED, LINEAR])
    model = {tid: [dict(v) if v else None for v in nodes] for tid, nodes in model.items()}
    rows = []
    for tid in (WEIGHTED, LINEAR):
        for node in sampled_nodes(tid):
            rows.append({"trace_id": tid, "node_index": node, "values": [0.0] * n_tokens(tid, node)})
    db.write_nodes(rows, stream="loss_weights", name="kl")
    db.clear(stream="loss_weights", name="rl")
    for row in rows:  # "kl" stays (zeros, not gone); "rl" is gone; nodes with neither are None
        model[row["trace_id"]][row["node_index"]] = {"kl": row["values"]}
    model = {tid: [None if not v or set(v) == {"rl"} else v for v in nodes] for tid, nodes in model.items()}
    assert_weight_reads(db, tmp_path, model)


# =========================================================================== credit sets


def test_credit_sets_side_by_side_with_algorithm_params_and_time(fixture_db):
    tracedb.credit.run(fixture_db, "grpo", "grpo", scale_std=True)
    tracedb.credit.run(fixture_db, "rloo", "rloo")
    fixture_db.create_credit_set("manual", params={"note": "by hand"}, description="hand-written")
    fixture_db.write_traces([{"trace_id": LINEAR, "value": 1.0}], credit="manual")
    sets = {r["name"]: r for r in fixture_db.credit_sets().to_pylist()}
    assert set(sets) == {"default", "grpo", "rloo", "manual"}
    assert all(fixture_db.has_credit_set(name) for name in sets) and not fixture_db.has_credit_set("nope")
    assert sets["grpo"]["algorithm"] == "grpo" and sets["rloo"]["algorithm"] == "rloo"
    assert sets["manual"]["algorithm"] == "manual" and sets["manual"]["description"] == "hand-written"
    assert json.loads(sets["grpo"]["params"])["scale_std"] is True
    assert json.loads(sets["manual"]["params"]) == {"note": "by hand"}
    for name in ("grpo", "rloo", "manual"):
        assert sets[name]["created_at"] is not None
    assert sets["manual"]["assigned_nodes"] == len(sampled_nodes(LINEAR))
    grpo = _keyed(fixture_db.branches(credit="grpo", columns=["advantages"]), "advantages")
    rloo = _keyed(fixture_db.branches(credit="rloo", columns=["advantages"]), "advantages")
    assert any(g is not None and not np.allclose(g, r) for g, r in zip(grpo.values(), rloo.values()))


def test_named_set_writes_leave_the_default_set_untouched(fixture_db):
    before_nodes = state(fixture_db)["nodes"]
    before_view = fixture_db.branches()
    fixture_db.create_credit_set("manual")
    fixture_db.write_traces([{"trace_id": tid, "value": 2.0} for tid in TARGETS], credit="manual")
    fixture_db.write_nodes(
        [{"trace_id": ZERO, "node_index": n, "values": [1.0] * n_sampled(ZERO, n)} for n in sampled_nodes(ZERO)],
        credit="manual",
    )
    (_, mask), *_ = branch_layout(fixture_db, ODD_MASK)
    fixture_db.write_branches(
        [{"trace_id": ODD_MASK, "branch_index": 0, "values": np.where(mask, -1.0, 0.0).tolist()}], credit="manual"
    )
    tracedb.credit.run(fixture_db, "grpo", "g")
    fixture_db.clear(credit="manual", trace_ids=[FORK])
    assert state(fixture_db)["nodes"] == before_nodes
    assert fixture_db.branches().equals(before_view)
    assert fixture_db.credit_sets().to_pylist()[0]["name"] == "default"


def test_named_set_is_read_by_view_sql_export_and_trace(db, tmp_path):
    rng = np.random.default_rng(7)
    db.create_credit_set("manual")
    tids = [FORK, ODD_MASK, LINEAR, ZERO]
    model = unassigned(tids)  # the set assigns nothing until written
    db.write_traces([{"trace_id": LINEAR, "value": 0.0}], credit="manual")  # zeros, not None
    for node in sampled_nodes(LINEAR):
        model[LINEAR][node] = [0.0] * n_sampled(LINEAR, node)
    rows = [{"trace_id": FORK, "node_index": n, "values": rand(rng, n_sampled(FORK, n))} for n in sampled_nodes(FORK)]
    rows += [{"trace_id": ODD_MASK, "node_index": sampled_nodes(ODD_MASK)[1], "values": None}]
    db.write_nodes(rows, credit="manual")
    for row in rows:
        model[row["trace_id"]][row["node_index"]] = row["values"]
    assert_reads(db, tmp_path, model, credit="manual")  # ZERO's ingested zeros are not in the set
    assert_reads(db, tmp_path, ingested("advantages", tids))  # the default set is as ingested


def test_every_layout_writes_a_named_set(db, tmp_path):
    rng = np.random.default_rng(8)
    db.create_credit_set("manual")
    model = unassigned([LINEAR, ODD_MASK, FORK])
    rows = [
        {"trace_id": LINEAR, "node_index": n, "values": rand(rng, n_sampled(LINEAR, n))} for n in sampled_nodes(LINEAR)
    ]
    db.write_nodes(rows, credit="manual")
    for row in rows:
        model[LINEAR][row["node_index"]] = row["values"]
    total = sum(n_sampled(ODD_MASK, n) for n in range(len(nodes_of(ODD_MASK))))
    values = rand(rng, total)
    db.write_traces([{"trace_id": ODD_MASK, "values": values}], credit="manual")
    for node in sampled_nodes(ODD_MASK):
        model[ODD_MASK][node], values = values[: n_sampled(ODD_MASK, node)], values[n_sampled(ODD_MASK, node) :]
    (_, mask), *_ = branch_layout(db, FORK)
    full = np.where(mask, np.round(rng.normal(size=len(mask)), 3), 0.0).astype(np.float32)
    db.write_branches([{"trace_id": FORK, "branch_index": 0, "values": full.tolist()}], credit="manual")
    for node, node_values in node_model_from_branch(FORK, 0, full, compact=True).items():
        model[FORK][node] = node_values
    assert_reads(db, tmp_path, model, credit="manual")


@pytest.mark.parametrize(
    "call",
    [
        lambda db, tmp: db.branches(credit="nope"),
        lambda db, tmp: db.export(tmp / "x.parquet", credit="nope"),
        lambda db, tmp: db.trace(LINEAR, credit="nope"),
        lambda db, tmp: db.write_traces([{"trace_id": LINEAR, "value": 1.0}], credit="nope"),
        lambda db, tmp: db.write_nodes([{"trace_id": LINEAR, "node_index": 2, "values": None}], credit="nope"),
        lambda db, tmp: db.clear(credit="nope"),
        lambda db, tmp: db.drop_credit_set("nope"),
    ],
    ids=["branches", "export", "trace", "write_traces", "write_nodes", "clear", "drop"],
)
def test_unknown_credit_set_is_not_found(shared_db, tmp_path, call: Callable):
    before = state(shared_db)
    with pytest.raises(tracedb.NotFound, match="nope"):
        call(shared_db, tmp_path)
    assert state(shared_db) == before
    assert not (tmp_path / "x.parquet").exists()


def test_create_existing_set_refused_unless_replace(db):
    db.create_credit_set("manual", params={"v": 1})
    db.write_traces([{"trace_id": LINEAR, "value": 1.0}], credit="manual")
    before = state(db)
    with pytest.raises(WriteError, match="manual"):
        db.create_credit_set("manual", params={"v": 2})
    assert state(db) == before
    db.create_credit_set("manual", algorithm="other", params={"v": 2}, replace=True)
    row = [r for r in db.credit_sets().to_pylist() if r["name"] == "manual"]
    assert len(row) == 1 and row[0]["algorithm"] == "other" and json.loads(row[0]["params"]) == {"v": 2}
    assert row[0]["assigned_nodes"] == 0  # the old credit went with the old set
    assert db.sql("SELECT count(*) AS n FROM credit WHERE credit_set = 'manual'").to_pylist()[0]["n"] == 0
    view = db.branches(trace_ids=[LINEAR], credit="manual", columns=["advantages"])
    assert view.column("advantages").to_pylist() == [None]


def test_run_refuses_an_existing_set_unless_replace(fixture_db):
    tracedb.credit.run(fixture_db, "grpo", "g")
    before = state(fixture_db)
    with pytest.raises(WriteError, match="g"):
        tracedb.credit.run(fixture_db, "rloo", "g")
    assert state(fixture_db) == before
    tracedb.credit.run(fixture_db, "rloo", "g", replace=True)
    assert [r["algorithm"] for r in fixture_db.credit_sets().to_pylist() if r["name"] == "g"] == ["rloo"]


def test_drop_credit_set(fixture_db):
    tracedb.credit.run(fixture_db, "grpo", "g")
    tracedb.credit.run(fixture_db, "rloo", "r")
    kept = fixture_db.branches(credit="r")
    fixture_db.drop_credit_set("g")
    assert [r["name"] for r in fixture_db.credit_sets().to_pylist()] == ["default", "r"]
    assert fixture_db.sql("SELECT DISTINCT credit_set FROM credit").to_pylist() == [{"credit_set": "r"}]
    with pytest.raises(tracedb.NotFound):
        fixture_db.branches(credit="g")
    assert fixture_db.branches(credit="r").equals(kept)


def test_credit_sets_hold_advantages_only(shared_db):
    before = state(shared_db)
    with pytest.raises(WriteError):
        shared_db.write_traces([{"trace_id": LINEAR, "value": 1.0}], stream="entropies", credit="manual")
    assert state(shared_db) == before


def test_credit_compare_matches_numpy_sums_of_the_views(fixture_db):
    tracedb.credit.run(fixture_db, "grpo", "grpo", scale_std=True)
    tracedb.credit.run(fixture_db, "rloo", "rloo")
    cleared = fixture_db.sql("SELECT min(trace_id) AS t FROM credit WHERE credit_set = 'rloo'").to_pylist()[0]["t"]
    fixture_db.clear(credit="rloo", trace_ids=[cleared])  # assigned in one set, not in the other

    def masses(credit: str) -> dict[str, tuple[float, float] | None]:
        # train_once keeps each node's sampled tokens in one branch: every node counted once
        view = fixture_db.branches(credit=credit, train_once=True, columns=["sampled_mask", "advantages"])
        out: dict[str, Any] = {}
        for tid, mask, adv in zip(*(view.column(c).to_pylist() for c in ("trace_id", "sampled_mask", "advantages"))):
            out.setdefault(tid, None)
            if adv is not None:
                picked = np.asarray(adv, np.float64)[np.asarray(mask, bool)]
                signed, absolute = out[tid] or (0.0, 0.0)
                out[tid] = (signed + picked.sum(), absolute + np.abs(picked).sum())
        return out

    want_a, want_b = masses("grpo"), masses("rloo")
    rows = fixture_db.sql("SELECT * FROM credit_compare('grpo', 'rloo')").to_pylist()
    assert sorted(r["trace_id"] for r in rows) == sorted(RECORDS)
    assert any(r["mass_a"] is not None and abs(r["mass_a"]) > 0 for r in rows)
    assert any(r["mass_b"] is None and r["mass_a"] is not None for r in rows)
    for row in rows:
        for want, mass, abs_mass in ((want_a, "mass_a", "abs_mass_a"), (want_b, "mass_b", "abs_mass_b")):
            expected = want[row["trace_id"]]
            if expected is None:
                assert row[mass] is None and row[abs_mass] is None, row
            else:
                assert row[mass] == pytest.approx(expected[0], rel=1e-6, abs=1e-6), row
                assert row[abs_mass] == pytest.approx(expected[1], rel=1e-6, abs=1e-6), row
