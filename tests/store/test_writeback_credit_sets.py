"""Named credit sets: created side by side with the default set, written and read through
every path, refused when unknown or already there, replaced, dropped and compared.

Expectations come from the reference model in :mod:`support.writeback_model`; the
databases (``db``, ``shared_db``) from ``tests/store/conftest.py``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import tracedb
import tracedb.credit
from tracedb.errors import WriteError

from support.writeback_model import (
    FORK,
    LINEAR,
    ODD_MASK,
    RECORDS,
    TARGETS,
    ZERO,
    assert_reads,
    branch_layout,
    ingested,
    keyed,
    n_sampled,
    node_model_from_branch,
    nodes_of,
    rand,
    sampled_nodes,
    state,
    unassigned,
)

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
    grpo = keyed(fixture_db.branches(credit="grpo", columns=["advantages"]), "advantages")
    rloo = keyed(fixture_db.branches(credit="rloo", columns=["advantages"]), "advantages")
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


BAD_NAMES = ["", " ", "  \t", " grpo", "grpo ", "a\nb", "tab\there", "default"]
"""Names no credit set may have: empty, whitespace only, whitespace at an end, control
characters, the default set's."""


@pytest.mark.parametrize("name", BAD_NAMES, ids=repr)
def test_a_bad_credit_set_name_is_refused_on_every_path(fixture_db, name: str):
    """``credit.run`` (an empty name used to become the algorithm's), ``create_credit_set``
    and ``writeback.stamp`` (what cec writes through) refuse it, saying why, and write
    nothing; None still means the algorithm's name."""
    from tracedb import writeback

    before = state(fixture_db)
    for call in (
        lambda: tracedb.credit.run(fixture_db, "grpo", name),
        lambda: fixture_db.create_credit_set(name),
        lambda: fixture_db.create_credit_set(name, layout="trace", replace=True),
        lambda: writeback.stamp(fixture_db.handle, name, tracedb.credit.compute(fixture_db, "grpo"), algorithm="x"),
    ):
        with pytest.raises(WriteError, match="cannot name a credit set") as refused:
            call()
        assert repr(name) in str(refused.value)
    assert state(fixture_db) == before
    assert [r["name"] for r in fixture_db.credit_sets().to_pylist()] == ["default"]
    assert tracedb.credit.run(fixture_db, "grpo")["name"] == "grpo"


def test_drop_credit_set(fixture_db):
    tracedb.credit.run(fixture_db, "grpo", "g")
    tracedb.credit.run(fixture_db, "rloo", "r")
    kept = fixture_db.branches(credit="r")
    fixture_db.drop_credit_set("g")
    assert [r["name"] for r in fixture_db.credit_sets().to_pylist()] == ["default", "r"]
    stored = "SELECT credit_set FROM credit UNION SELECT credit_set FROM trace_credit"  # either layout's rows
    assert fixture_db.sql(f"SELECT DISTINCT credit_set FROM ({stored})").to_pylist() == [{"credit_set": "r"}]
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
    first = "SELECT min(trace_id) AS t FROM trace_credit WHERE credit_set = 'rloo'"
    cleared = fixture_db.sql(first).to_pylist()[0]["t"]
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
