"""Write-back of per-token streams onto nodes: ``write_nodes``, ``write_traces`` and
``write_branches`` in every input kind, refusals that leave the database as it was,
atomic batches, ``clear`` and ``loss_weights``.

Expectations come from the reference model in :mod:`support.writeback_model`; the
databases (``db``, ``shared_db``) from ``tests/store/conftest.py``.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

import tracedb
from tracedb.errors import WriteError

from support.writeback_model import (
    COMPACT,
    FOREST,
    FORK,
    LINEAR,
    ODD_MASK,
    TARGETS,
    WEIGHTED,
    ZERO,
    as_kind,
    assert_reads,
    assert_weight_reads,
    branch_layout,
    f32,
    ingested,
    keyed,
    n_sampled,
    n_tokens,
    node_model_from_branch,
    nodes_of,
    paths,
    rand,
    sampled_nodes,
    state,
    stored,
    unassigned,
    widen,
)

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
    view = keyed(db.branches(trace_ids=[ODD_MASK, FOREST, FORK], columns=[stream]), stream)
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
