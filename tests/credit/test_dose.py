"""Dose-matched comparison (``tracedb.credit.dose``, the ``credit_dose`` / ``credit_agreement``
/ ``credit_compare`` macros, ``tracedb credit-compare``) and ``matched_to`` on a run, each
checked against plain loops over the credit the test wrote (a per-node model: a list, or
None for unassigned, on every node of every fixture trace)."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

import tracedb
import tracedb.credit
from tracedb.cli.main import app
from tracedb.credit import dose

from support import FIXTURES
from support.writeback_model import RECORDS, n_sampled, nodes_of

Model = dict[str, list[list[float] | None]]


def random_model(rng: np.random.Generator, *, skip: float = 0.25) -> Model:
    """Per node: None (never assigned), zeros, one value, or random values; a trace now
    and then left wholly unassigned."""
    model: Model = {}
    for tid in sorted(RECORDS):
        nodes: list[list[float] | None] = []
        whole = rng.random() < 0.15
        for i in range(len(nodes_of(tid))):
            n = n_sampled(tid, i)
            kind = rng.random()
            if whole or kind < skip:
                nodes.append(None)
            elif kind < 0.4:
                nodes.append([0.0] * n)
            elif kind < 0.6:
                nodes.append([float(np.float32(rng.normal()))] * n)
            else:
                nodes.append(np.round(rng.normal(size=n), 3).astype(np.float32).tolist())
        model[tid] = nodes
    return model


def stamp_model(db: tracedb.Database, name: str, model: Model) -> None:
    db.create_credit_set(name)
    rows = [
        {"trace_id": tid, "node_index": i, "values": values}
        for tid, nodes in model.items()
        for i, values in enumerate(nodes)
        if values is not None
    ]
    db.write_nodes(rows, credit=name)


def model_of(db: tracedb.Database, name: str) -> Model:
    """A stored set as a model (for sets an algorithm wrote), read node by node."""
    return {tid: [n.get("advantages") for n in db.trace(tid, credit=name)["nodes"]] for tid in sorted(RECORDS)}


def ref_dose(model: Model) -> dict[str, dict[str, Any]]:
    """``credit_dose`` by loops: over each trace's sampled tokens, each node once."""
    out = {}
    for tid, nodes in model.items():
        sampled = sum(n_sampled(tid, i) for i in range(len(nodes)))
        tokens = [x for values in nodes if values is not None for x in values]
        assigned = any(values is not None for values in nodes)
        mass = sum(tokens) if assigned else None
        abs_mass = sum(abs(x) for x in tokens) if assigned else None
        sq_mass = sum(x * x for x in tokens) if assigned else None
        out[tid] = {
            "sampled_tokens": sampled,
            "assigned_nodes": sum(values is not None for values in nodes),
            "assigned_tokens": len(tokens),
            "credited_tokens": sum(x != 0 for x in tokens),
            "coverage": len(tokens) / sampled if sampled else None,
            "mass": mass,
            "abs_mass": abs_mass,
            "sq_mass": sq_mass,
            "concentration": sampled * sq_mass / abs_mass**2 if abs_mass else None,
        }
    return out


def ref_pairs(a: Model, b: Model, tids: list[str]) -> tuple[int, float | None, float | None]:
    """Tokens both assign, share with equal signs, Pearson correlation (None if undefined)."""
    xs, ys = [], []
    for tid in tids:
        for va, vb in zip(a[tid], b[tid]):
            if va is not None and vb is not None:
                xs += va
                ys += vb
    if not xs:
        return 0, None, None
    agree = sum(np.sign(x) == np.sign(y) for x, y in zip(xs, ys)) / len(xs)
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    sxx, syy = sum((x - mx) ** 2 for x in xs), sum((y - my) ** 2 for y in ys)
    constant = len(set(xs)) == 1 or len(set(ys)) == 1  # exactly, not by a rounded variance
    corr = None if constant else sxy / math.sqrt(sxx * syy)
    return len(xs), agree, corr


def close(got: Any, want: Any, where: str) -> None:
    if want is None:
        assert got is None, f"{where}: expected None, got {got}"
    else:
        assert got == pytest.approx(want, rel=1e-6, abs=1e-6), where


@pytest.fixture
def sets_db(fixture_db):
    rng = np.random.default_rng(15)
    models = {"x": random_model(rng), "y": random_model(rng)}
    for name, model in models.items():
        stamp_model(fixture_db, name, model)
    tracedb.credit.run(fixture_db, "grpo", "g")  # stored per trace
    models["g"] = model_of(fixture_db, "g")
    return fixture_db, models


# =========================================================================== dose


@pytest.mark.parametrize("name", ["x", "y", "g", "default"])
def test_credit_dose_macro_against_loops(sets_db, name):
    db, models = sets_db
    model = models.get(name) or model_of(db, "default")
    want = ref_dose(model)
    rows = db.sql("SELECT * FROM credit_dose(credit := ?)", [name]).to_pylist()
    assert [r["trace_id"] for r in rows] == sorted(RECORDS)
    assert any(r["mass"] is None for r in rows) and any(r["mass"] is not None for r in rows)
    for row in rows:
        for key, value in want[row["trace_id"]].items():
            close(row[key], value, f"{name} {row['trace_id']} {key}")


def test_set_totals_and_pairs_against_loops(sets_db):
    db, models = sets_db
    table = dose.dose(db, ["x", "y", "g"]).to_pylist()
    assert [r["credit_set"] for r in table] == ["x", "y", "g"]
    for row in table:
        per = ref_dose(models[row["credit_set"]]).values()
        sampled = sum(p["sampled_tokens"] for p in per)
        assigned = [p for p in per if p["mass"] is not None]
        sq = sum(p["sq_mass"] for p in assigned)
        absolute = sum(p["abs_mass"] for p in assigned)
        assert row["traces"] == len(RECORDS) and row["traces_assigned"] == len(assigned)
        close(row["abs_mass"], absolute, "abs_mass")
        close(row["coverage"], sum(p["assigned_tokens"] for p in per) / sampled, "coverage")
        close(row["concentration"], sampled * sq / absolute**2, "concentration")
    pairs = dose.agreement(db, ["x", "y", "g"]).to_pylist()
    assert [(p["set_a"], p["set_b"]) for p in pairs] == [("x", "y"), ("x", "g"), ("y", "g")]
    for p in pairs:
        shared, agree, corr = ref_pairs(models[p["set_a"]], models[p["set_b"]], sorted(RECORDS))
        assert p["shared_tokens"] == shared > 0
        close(p["sign_agreement"], agree, "sign_agreement")
        close(p["correlation"], corr, "correlation")


def test_credit_compare_per_trace_against_loops(sets_db):
    db, models = sets_db
    rows = db.sql("SELECT * FROM credit_compare('x', 'g')").to_pylist()
    per = dose.agreement(db, ["x", "g"], per_trace=True).to_pylist()
    assert {r["trace_id"] for r in per} == {r["trace_id"] for r in rows if r["shared_tokens"]}
    want_a, want_b = ref_dose(models["x"]), ref_dose(models["g"])
    for row in rows:
        tid = row["trace_id"]
        for key in ("mass", "abs_mass", "sq_mass", "assigned_tokens", "credited_tokens", "coverage", "concentration"):
            close(row[f"{key}_a"], want_a[tid][key], f"{tid} {key}_a")
            close(row[f"{key}_b"], want_b[tid][key], f"{tid} {key}_b")
        shared, agree, corr = ref_pairs(models["x"], models["g"], [tid])
        assert row["shared_tokens"] == shared
        close(row["sign_agreement"], agree, f"{tid} sign_agreement")
        close(row["correlation"], corr, f"{tid} correlation")  # grpo is constant in a trace: None
    assert all(r["correlation"] is None for r in rows)
    assert any(r["sign_agreement"] is not None for r in rows)


def test_concentration_is_one_for_uniform_credit_and_l_over_m_on_m_tokens(fixture_db):
    tid = max(RECORDS, key=lambda t: sum(n_sampled(t, i) for i in range(len(nodes_of(t)))))
    nodes = [i for i in range(len(nodes_of(tid))) if n_sampled(tid, i)]
    total = sum(n_sampled(tid, i) for i in nodes)
    fixture_db.create_credit_set("uniform", layout="trace")
    fixture_db.write_traces([{"trace_id": tid, "value": -0.5}], credit="uniform")
    m = n_sampled(tid, nodes[0])
    stamp_model(fixture_db, "focused", {tid: [[2.0] * m if i == nodes[0] else None for i in range(len(nodes_of(tid)))]})
    rows = {
        r["credit_set"]: r
        for r in dose.dose(fixture_db, ["uniform", "focused"], per_trace=True).to_pylist()
        if r["trace_id"] == tid
    }
    assert rows["uniform"]["concentration"] == pytest.approx(1.0)
    assert rows["focused"]["concentration"] == pytest.approx(total / m)
    assert rows["focused"]["coverage"] == pytest.approx(m / total) and rows["uniform"]["coverage"] == 1.0


def test_refusals_name_the_set(sets_db):
    db, _ = sets_db
    with pytest.raises(tracedb.NotFound, match="'nope' does not exist"):
        dose.compare(db, ["x", "nope"])
    with pytest.raises(ValueError, match="two or more"):
        dose.agreement(db, ["x"])
    with pytest.raises(ValueError, match="one or more"):
        dose.dose(db, "x")
    assert set(dose.compare(db, ["x"])) == {"dose"}


def test_trace_selection_equals_a_database_of_only_those_traces(sets_db, tmp_path):
    """``trace_ids`` gives the figures the same sets give on a database holding only those
    traces (every other episode of the fixtures, their credit stamped there as here)."""
    db, models = sets_db
    lines = [line for path in sorted(FIXTURES.glob("*.traces.jsonl")) for line in path.read_text().splitlines()]
    kept = lines[::2]
    ids = sorted(trace["id"] for line in kept for trace in json.loads(line)["traces"])
    assert 0 < len(ids) < len(RECORDS)
    (tmp_path / "some.traces.jsonl").write_text("\n".join(kept) + "\n")
    with tracedb.connect(":memory:") as only:
        assert only.ingest(tmp_path / "some.traces.jsonl").ok
        for name, model in models.items():
            stamp_model(only, name, {tid: model[tid] for tid in ids})
        sets = ["x", "y", "g", "default"]
        for per_trace in (False, True):
            got = dose.compare(db, sets, per_trace=per_trace, trace_ids=list(reversed(ids)))
            want = dose.compare(only, sets, per_trace=per_trace)
            for part in ("dose", "agreement"):
                rows, expected = got[part].to_pylist(), want[part].to_pylist()
                assert len(rows) == len(expected) > 0
                for i, (row, ref) in enumerate(zip(rows, expected)):
                    assert row.keys() == ref.keys()
                    for key, value in ref.items():
                        if isinstance(value, str):
                            assert row[key] == value, f"{part} {per_trace} row {i} {key}"
                        else:
                            close(row[key], value, f"{part} {per_trace} row {i} {key}")
    full, part = dose.dose(db, sets).to_pylist(), dose.dose(db, sets, trace_ids=ids).to_pylist()
    assert all(f["sampled_tokens"] > p["sampled_tokens"] for f, p in zip(full, part))  # a real restriction


def test_trace_selection_refusals_name_the_parameter(sets_db):
    db, _ = sets_db
    with pytest.raises(tracedb.NotFound, match="trace_ids: no trace 'nope'"):
        dose.compare(db, ["x", "y"], trace_ids=[next(iter(RECORDS)), "nope"])
    with pytest.raises(ValueError, match="trace_ids"):
        dose.dose(db, ["x"], trace_ids=[])


# =========================================================================== matched_to


def masses(model: Model) -> dict[str, float]:
    return {t: sum(abs(x) for v in nodes if v is not None for x in v) for t, nodes in model.items()}


@pytest.mark.parametrize(("algorithm", "params"), [("grpo", {"scale_std": True}), ("gae", {"lam": 0.9})])
def test_matched_to_rescales_each_trace_to_the_reference_mass(sets_db, algorithm, params):
    db, models = sets_db
    plain = tracedb.credit.run(db, algorithm, "plain", **params)
    result = tracedb.credit.run(db, algorithm, "matched", matched_to="x", **params)
    before, after, ref = model_of(db, "plain"), model_of(db, "matched"), models["x"]
    m_before, m_ref = masses(before), masses(ref)
    rescaled = left = unassigned = 0
    for tid in sorted(RECORDS):
        if all(v is None for v in before[tid]):
            assert all(v is None for v in after[tid]), tid  # None stays None
            continue
        if all(v is None for v in ref[tid]):
            unassigned += 1
        if m_before[tid] > 0 and m_ref[tid] > 0 and not all(v is None for v in ref[tid]):
            rescaled += 1
            scale = m_ref[tid] / m_before[tid]
            for va, vb in zip(before[tid], after[tid]):
                assert (va is None) == (vb is None)
                if va is not None:
                    np.testing.assert_allclose(vb, np.float32(np.asarray(va, np.float64) * scale), rtol=1e-6, atol=1e-7)
            assert masses({tid: after[tid]})[tid] == pytest.approx(m_ref[tid], rel=1e-5)
        else:
            left += 1
            assert after[tid] == before[tid], tid
    assert rescaled > 0 and left > 0
    assert result["matched"] == {
        "matched_to": "x",
        "rescaled": rescaled,
        "left_as_is": left,
        "unassigned_in_reference": unassigned,
    }
    assert result["nodes"] == plain["nodes"] and result["params"]["matched_to"] == "x"
    (row,) = [r for r in db.credit_sets().to_pylist() if r["name"] == "matched"]
    assert json.loads(row["params"])["matched_to"] == "x"
    assert row["layout"] == ("trace" if algorithm == "grpo" else "node")  # still one value per trace
    again = tracedb.credit.compute(db, algorithm, matched_to="x", **params)
    assert again.num_rows == result["rows"]


def test_matched_to_equal_masses_through_the_macro(sets_db):
    db, _ = sets_db
    tracedb.credit.run(db, "gae", "m", matched_to="g")
    rows = db.sql("SELECT * FROM credit_compare('m', 'g') WHERE abs_mass_a > 0 AND abs_mass_b > 0").to_pylist()
    assert rows and all(r["abs_mass_a"] == pytest.approx(r["abs_mass_b"], rel=1e-5) for r in rows)


def test_matched_to_an_unknown_set_is_refused_naming_the_parameter(fixture_db):
    with pytest.raises(tracedb.NotFound, match=r"matched_to: credit set 'nope' does not exist"):
        tracedb.credit.run(fixture_db, "grpo", "g", matched_to="nope")
    assert not fixture_db.has_credit_set("g")


# =========================================================================== CLI


def test_cli_credit_compare_prints_the_library_answer(tmp_path):
    path = tmp_path / "runs.duckdb"
    with tracedb.connect(path) as db:
        assert db.ingest(FIXTURES).ok
        tracedb.credit.run(db, "grpo", "g")
        tracedb.credit.run(db, "gae", "a")
        want = {k: v.to_pylist() for k, v in dose.compare(db, ["g", "a"]).items()}
        want_trace = {k: v.to_pylist() for k, v in dose.compare(db, ["g", "a"], per_trace=True).items()}
    runner = CliRunner()
    got = runner.invoke(app, ["credit-compare", "g", "a", "--db", str(path), "--json"])
    assert got.exit_code == 0, got.output
    assert json.loads(got.output) == json.loads(json.dumps(want, default=str))
    got = runner.invoke(app, ["credit-compare", "g", "a", "--per-trace", "--db", str(path), "--json"])
    assert json.loads(got.output) == json.loads(json.dumps(want_trace, default=str))
    table = runner.invoke(app, ["credit-compare", "g", "a", "default", "--db", str(path)])
    assert table.exit_code == 0 and "concentration" in table.output and "sign_agreement" in table.output
    bad = runner.invoke(app, ["credit-compare", "g", "nope", "--db", str(path)])
    assert bad.exit_code == 1 and "'nope' does not exist" in bad.output
    run = runner.invoke(app, ["credit", "gae", "--name", "m", "-p", "matched_to=g", "--db", str(path), "--json"])
    assert run.exit_code == 0, run.output
    assert json.loads(run.output)["matched"]["matched_to"] == "g"
