"""Counterfactual edit credit in the database: the plan (selection reasons, verifier-blind
choice, complete spans), the four stamped arms read back through ``db.branches`` /
``db.trace``, the identity check, the report on a hand-computed case, and random traces.

The traces and records: :mod:`support.cec_records`; record ingest and the ``tracedb cec``
commands: ``test_db_records.py``."""

from __future__ import annotations

import copy
import hashlib
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tracedb
import tracedb.credit
import tracedb.writeback
from tracedb import cec

from support import FIXTURES
from support.cec_records import (
    EPISODES,
    G0,
    G1,
    G2,
    TRACES,
    assistant_nodes,
    hand_records,
    trace_record,
    turn_records,
    verification,
    write,
)


@pytest.fixture
def hand_db(db, tmp_path):
    assert cec.ingest_records(db, write(tmp_path / "cec.jsonl", hand_records())).ok
    cec.stamp(db, lam=0.1, cap=0.5)
    return db


def selection(db, trace_id: str) -> dict[str, Any]:
    return db.sql("SELECT * FROM cec_selection WHERE trace_id = ?", [trace_id]).to_pylist()[0]


def test_plan_on_the_hand_computed_case(hand_db) -> None:
    i0, i1, i2, i3, i4, i5, i6, i7 = G0
    row = selection(hand_db, i0)
    assert row["selection"] == "selected" and row["selected"] == 0 and row["selected_nodes"] == [4, 6]
    assert (row["generated_tokens"], row["edit_tokens"]) == (145, 58)
    assert (row["d"], row["d_y"], row["d_f"], row["d_g"]) == (1.125, 1.0, 0.125, 0.0)
    assert (row["u_orig"], row["u_int"]) == (1.25, 0.125)
    assert row["s"] == 1.0  # 0.5*58 = 29 >= 0.1*1.125*145 = 16.3
    assert row["coef_m"] == pytest.approx(0.1 * 1.125 * 145 / 58) == pytest.approx(0.28125)
    assert row["coef_b"] == pytest.approx(0.1125)
    assert row["advantage"] == 0.375 and row["coef_e"] == pytest.approx(0.1 * 0.375 * 145 / 58)
    assert row["pre_block_tree"] == f"{i0[:6]}-t0" and row["final_tree"] == f"{i0[:6]}-t2"
    assert json.loads(row["blocks"])[0]["paths"] == ["src/a.py", "src/b.py"]

    row = selection(hand_db, i4)
    assert (row["generated_tokens"], row["edit_tokens"], row["d"]) == (158, 27, -1.5)
    assert row["s"] == pytest.approx(0.5 * 27 / (0.1 * 1.5 * 158))  # capped: 13.5 < 23.7
    assert (row["coef_m"], row["coef_b"]) == (-0.5, pytest.approx(-0.5 * 27 / 158))
    assert row["credit_m"] == -0.5

    expected = {
        i1: ("selected", "format_error", None),
        i2: ("no_eligible_block", "no_selection", None),
        i3: ("selected", "original_unavailable", None),
        i5: ("selected", "planned", "usable"),
        i6: ("selected", "planned", "pending"),
        i7: ("selected", "planned", "lists_differ"),
        G1[0]: ("selected", "planned", "unparseable"),
        G1[1]: ("no_trace_record", "no_selection", None),
    }
    for trace_id, (sel, query, intervention) in expected.items():
        row = selection(hand_db, trace_id)
        assert (row["selection"], row["query"], row["intervention"]) == (sel, query, intervention), trace_id
    assert selection(hand_db, i1)["coef_e"] is None and selection(hand_db, i1)["credit_e"] == 0.0
    assert json.loads(selection(hand_db, i2)["blocks"])[0]["reasons"] == ["test_path"]
    assert selection(hand_db, i5)["d"] == 0.0 and selection(hand_db, i5)["coef_m"] == 0.0


def test_report_on_the_hand_computed_case(hand_db) -> None:
    data = cec.report(hand_db)
    assert (data["lam"], data["cap"]) == (0.1, 0.5)
    assert data["planned_trajectories"] == 32
    # Every trace without an available original utility: i3 (missing) and the 23 without records.
    assert data["unavailable_original_utility"] == 24
    assert data["not_queried"] == {"format_error": 1, "no_selection": 24, "original_unavailable": 1}
    assert data["queries"] == {
        "planned": 6,
        "issued": 5,
        "usable": 3,
        "pending": 1,
        "unusable": {"lists_differ": 1, "unparseable": 1},
    }
    assert data["contrasts"] == {"positive": 1, "negative": 1, "nonzero": 2, "zero": 1}
    assert data["failed_originals"] == {"queried": 3, "nonzero": 1}  # i4, i5, g1; only i4 nonzero
    assert data["capped_nonzero"] == 1
    assert data["decomposition"] == [
        {"d_y": 1.0, "d_f": 0.125, "d_g": 0.0, "d": 1.125, "count": 1, "failed_originals": 0},
        {"d_y": 0.0, "d_f": 0.0, "d_g": 0.0, "d": 0.0, "count": 1, "failed_originals": 1},
        {"d_y": -1.0, "d_f": -0.25, "d_g": -0.25, "d": -1.5, "count": 1, "failed_originals": 1},
    ]
    # Two nonzero contrasts: every quantile is the element at index floor(q * 1) = 0, the smaller.
    q = data["quantiles"]
    assert data["quantile_n"] == 2
    assert q["m_over_L"] == dict.fromkeys(("p05", "median", "p95"), pytest.approx(27 / 158))
    assert q["s"]["median"] == pytest.approx(0.5 * 27 / (0.1 * 1.5 * 158))
    assert q["M_magnitude"]["p95"] == pytest.approx(0.28125)
    assert q["B_magnitude"]["p05"] == pytest.approx(0.5 * 27 / 158)
    rows = {r["measurement"]: r["value"] for r in cec.report_rows(data)}
    assert rows["Issued / usable CF queries"] == "5 / 3"
    assert rows["Positive / negative contrasts"] == "1 / 1"
    assert rows["Capped nonzero contrasts (s < 1)"] == 1


def node_values(db, trace_id: str, credit: str) -> dict[int, list[float] | None]:
    """Per sampled node, its advantages in a credit set as ``db.trace`` gives them (float32
    values printed as their shortest decimal)."""
    record = db.trace(trace_id, credit=credit)
    return {i: n.get("advantages") for i, n in enumerate(record["nodes"]) if sum(n.get("mask", []))}


def f32(x: float) -> float:
    """x stored as float32, read back as ``db.trace`` prints it (the shortest decimal)."""
    return float(str(np.float32(x)))


def test_stamped_arms_read_back(hand_db) -> None:
    i0, i1, i2, i3, i4, i5, i6, i7 = G0
    a = 0.375
    expect = {
        # arm -> node -> per-token value on i0 (E = nodes 4, 6)
        "cec-O": dict.fromkeys([2, 4, 6, 8, 10], a),
        "cec-B": dict.fromkeys([2, 4, 6, 8, 10], a + 0.1125),
        "cec-M": {2: a, 4: a + 0.28125, 6: a + 0.28125, 8: a, 10: a},
        "cec-E": {2: a, 4: a + 0.09375, 6: a + 0.09375, 8: a, 10: a},
    }
    for credit, per_node in expect.items():
        got = node_values(hand_db, i0, credit)
        assert got == {n: [f32(v)] * 29 for n, v in per_node.items()}, credit
    # The trainer's view: one branch, A + C on E's sampled tokens, A on the other sampled tokens, 0 off-sample.
    (branch,) = hand_db.branches(trace_ids=[i0], credit="cec-M").to_pylist()
    expected = []
    for i, node in enumerate(TRACES[i0]["nodes"]):
        value = float(np.float32(expect["cec-M"].get(i, 0.0)))  # the view holds float32 values
        expected += [value if m else 0.0 for m in node["mask"]]
    assert branch["advantages"] == expected
    assert sum(branch["sampled_mask"]) == 145

    a4 = -0.625  # i4: capped, negative
    m4 = node_values(hand_db, i4, "cec-M")
    assert m4[10] == [f32(a4 - 0.5)] * 27 and m4[2] == [f32(a4)] * 35
    assert node_values(hand_db, i4, "cec-B")[2] == [f32(a4 - 0.5 * 27 / 158)] * 35
    assert node_values(hand_db, i4, "cec-E")[10] == [f32(a4 - 0.1 * 0.625 * 158 / 27)] * 27
    # D = 0 (i5): M and B add nothing; E still concentrates A on the block.
    assert set(map(tuple, node_values(hand_db, i5, "cec-M").values())) == {(f32(-0.625),) * 15}
    assert node_values(hand_db, i5, "cec-E")[2] == [f32(-0.625 - 0.25)] * 15
    # Format error (i1): no auxiliary term in any arm.
    for credit in ("cec-M", "cec-B", "cec-E"):
        assert {v[0] for v in node_values(hand_db, i1, credit).values()} == {f32(0.375)}
    # Pending query (i6): M, B = A; E has its own term.
    assert {v[0] for v in node_values(hand_db, i6, "cec-M").values()} == {f32(0.375)}
    assert node_values(hand_db, i6, "cec-E")[2] == [f32(0.375 + 0.1 * 0.375 * 76 / 17)] * 17


def test_terminal_advantage_matches_grpo_and_excluded_members_get_zero(hand_db) -> None:
    tracedb.credit.run(hand_db, "grpo", "grpo")
    failed = {t for t, tr in TRACES.items() if not tr["ok"]}
    assert {G2[0], G2[2]} <= failed
    for trace_id in TRACES:
        o = node_values(hand_db, trace_id, "cec-O")
        g = node_values(hand_db, trace_id, "grpo")
        if trace_id in failed:  # grpo leaves it unassigned; CEC stamps A = 0 (and C = 0)
            assert all(v is None for v in g.values())
            for credit in cec.CREDIT_SETS.values():
                assert all(set(v) == {0.0} for v in node_values(hand_db, trace_id, credit).values())
        else:
            assert o == g, trace_id
    assert node_values(hand_db, G2[1], "cec-O")[2][0] == 0.5  # 1 - mean of the six valid members (0.5)


def test_check_passes_and_catches_tampering(hand_db) -> None:
    result = cec.check(hand_db)
    assert result.ok and result.checked == 3  # i0, i4, i5: usable contrasts on valid members
    hand_db.con.execute(
        "UPDATE credit SET value = value + 0.01 WHERE credit_set = 'cec-M' AND trace_id = ? AND node_index = 4", [G0[0]]
    )
    result = cec.check(hand_db)
    assert not result.ok
    failed = {f["identity"] for f in result.failures}
    assert "sum C^M = lam*D*s*L" in failed and "sum C^M = sum C^B" in failed
    assert {f["trace_id"] for f in result.failures} == {G0[0]}
    hand_db.con.execute("DELETE FROM credit WHERE credit_set = 'cec-B' AND trace_id = ? AND node_index = 2", [G0[4]])
    failed = {f["identity"] for f in cec.check(hand_db).failures if f["trace_id"] == G0[4]}
    assert "every sampled node assigned in cec-B" in failed


def test_stamp_is_one_transaction_and_replaces(hand_db, monkeypatch) -> None:
    before = hand_db.sql("SELECT * FROM credit ORDER BY ALL").to_pylist()
    calls = []
    real = tracedb.writeback.stamp_fresh

    def failing(db, credit, *args, **kwargs):
        calls.append(credit)
        if len(calls) == 4:  # while writing cec-E, after cec-O, cec-B and cec-M
            raise RuntimeError("disk full")
        return real(db, credit, *args, **kwargs)

    monkeypatch.setattr(tracedb.writeback, "stamp_fresh", failing)
    with pytest.raises(RuntimeError):
        cec.stamp(hand_db, lam=0.3, cap=2.0)
    assert hand_db.sql("SELECT * FROM credit ORDER BY ALL").to_pylist() == before
    assert selection(hand_db, G0[0])["lam"] == 0.1  # the plan was rolled back too
    monkeypatch.undo()
    cec.stamp(hand_db, lam=0.3, cap=2.0)
    assert selection(hand_db, G0[0])["coef_b"] == pytest.approx(0.3 * 1.125)
    assert cec.check(hand_db).ok
    params = json.loads(hand_db.sql("SELECT params FROM credit_sets WHERE name = 'cec-M'")["params"][0].as_py())
    assert params["lam"] == 0.3 and params["arm"] == "M"


# --------------------------------------------------------------------------- selection in the plan


def test_selection_is_verifier_blind_and_follows_the_hash(db, tmp_path) -> None:
    trace_id = G0[0]  # assistant nodes 2, 4, 6, 8, 10: three separate one-turn blocks
    edits = {2: ["a.py"], 6: ["b.py"], 10: ["c.py"]}
    cec.install(db)
    picks = {}
    for salt in [f"salt-{k}" for k in range(12)]:
        for resolved in (True, False):
            for table in ("cec_traces", "cec_turns", "cec_verifications"):
                db.con.execute(f"DELETE FROM {table}")
            records = [trace_record(trace_id, instance="inst", rep=5, salt=salt), *turn_records(trace_id, edits)]
            records.append(verification(trace_id, "original", resolved, {"t": "PASSED"}, {}))
            assert cec.ingest_records(db, write(tmp_path / "r.jsonl", records)).ok
            cec.plan(db)
            row = selection(db, trace_id)
            digests = [int(hashlib.sha256(f"inst|5|{salt}|{i}".encode()).hexdigest(), 16) for i in range(3)]
            assert row["eligible"] == [0, 1, 2]
            assert row["selected"] == digests.index(min(digests))
            picks.setdefault(salt, set()).add(row["selected"])
    assert all(len(p) == 1 for p in picks.values())  # the verdict never changes the choice
    assert len(set().union(*picks.values())) == 3  # the key does


def test_selection_unavailable_reasons(db, tmp_path) -> None:
    t = G0
    records = [
        *turn_records(t[0], {2: ["a.py"]}),  # turns but no trace record
        trace_record(t[1]),  # a trace record but no turns
        trace_record(t[2]),
        *turn_records(t[2], {2: ["a.py"]})[:2],  # snapshots for 2 of its 6 assistant turns
        trace_record(t[3]),
        {**turn_records(t[3], {2: ["a.py"]})[0], "tree": f"{t[3][:6]}-t0"},  # paths, but the baseline tree
        *turn_records(t[3], {2: ["a.py"]})[1:],
        trace_record(t[4]),
        *turn_records(t[4], {}),  # never edits anything
    ]
    assert cec.ingest_records(db, write(tmp_path / "r.jsonl", records)).ok
    cec.plan(db)
    assert selection(db, t[0])["selection"] == "no_trace_record"
    assert selection(db, t[1])["selection"] == "no_snapshots"
    row = selection(db, t[2])
    assert row["selection"] == "missing_snapshots" and "[6, 8, 10, 12]" in row["selection_detail"]
    row = selection(db, t[3])
    assert row["selection"] == "inconsistent_snapshots" and "node 2" in row["selection_detail"]
    row = selection(db, t[4])
    assert row["selection"] == "no_eligible_block" and row["blocks"] == "[]" and row["eligible"] == []


def test_incomplete_spans_make_the_selection_unavailable(tmp_path) -> None:
    base = copy.deepcopy(EPISODES[0])
    template = base["traces"][0]
    lines = []
    variants = {}
    for name in ("clipped", "masked", "ragged", "complete"):
        trace = copy.deepcopy(template)
        trace["id"] = f"span-{name}"
        node = trace["nodes"][4]
        if name == "clipped":
            trace["calls"] = [{"node": 2, "finish_reason": "stop"}, {"node": 4, "finish_reason": "length"}]
        elif name == "masked":
            node["mask"] = [False] * len(node["token_ids"])
            for key in ("logprobs", "trainer_logprobs", "reference_logprobs", "entropies", "advantages"):
                node.pop(key, None)
        elif name == "ragged":
            node["logprobs"] = node["logprobs"][:-1]
        variants[name] = trace
        lines.append({**base, "id": f"ep-{name}", "traces": [trace]})
    rejected = json.loads((FIXTURES / "rejected_compaction.traces.jsonl").read_text().splitlines()[0])
    untrainable = rejected["traces"][0]
    path = write(tmp_path / "traces.jsonl", lines)
    records = []
    for trace in [*variants.values(), untrainable]:
        records += [trace_record(trace["id"]), *turn_records(trace["id"], {4: ["fix.py"]}, trace=trace)]
    with tracedb.connect(":memory:") as db:
        assert db.ingest(path, allow_ragged=True).ok
        assert db.ingest(FIXTURES / "rejected_compaction.traces.jsonl").ok
        assert cec.ingest_records(db, write(tmp_path / "cec.jsonl", records)).ok
        cec.plan(db)
        details = {}
        for name in variants:
            row = selection(db, f"span-{name}")
            details[f"span-{name}"] = (row["selection"], row["selection_detail"])
        assert details["span-complete"] == ("selected", None)
        assert details["span-clipped"] == ("incomplete_span", "node 4 was cut at the length limit (clipped)")
        assert details["span-masked"] == ("incomplete_span", "node 4 has no sampled tokens (masked)")
        assert details["span-ragged"] == (
            "incomplete_span",
            "node 4 has 28 logprobs for 29 sampled tokens (misaligned)",
        )
        row = selection(db, untrainable["id"])
        assert (row["selection"], row["selection_detail"]) == ("incomplete_span", "node 4 is on no trainable branch")
        assert row["selected"] == 0  # selected, then found incomplete: not replaced by another block


# --------------------------------------------------------------------------- random traces


def random_dataset(seed: int, tmp_path: Path) -> tuple[Path, Path]:
    """Episodes copied from the fixture with new ids, random groups and rewards (some
    failed), and harness records from a simulated repository whose tree ids are content
    hashes of its files, so blocks that restore what they changed have no net effect."""
    rng = random.Random(seed)
    paths = [f"src/m{i}.py" for i in range(12)] + ["tests/test_a.py", "src/conftest.py", "README.md"]
    episodes, records = [], []
    for k in range(rng.randint(18, 26)):
        episode = copy.deepcopy(rng.choice(EPISODES))
        episode["id"] = f"ep-{seed}-{k}"
        episode["group"] = {"id": f"g{rng.randrange(4)}"}
        trace = episode["traces"][0]
        trace_id = trace["id"] = f"tr-{seed}-{k}"
        trace["rewards"] = {"resolved": {"score": rng.choice([0.0, 1.0, 0.5]), "weight": 1.0}}
        trace["ok"] = rng.random() > 0.1
        episodes.append(episode)
        if rng.random() < 0.05:
            continue  # no records for this trace at all
        state: dict[str, int] = {}
        tree = lambda s: hashlib.sha256(json.dumps(sorted(s.items())).encode()).hexdigest()[:16]  # noqa: E731
        records.append(
            {**trace_record(trace_id, instance=f"inst-{k % 5}", rep=k, salt=f"s{seed}"), "baseline_tree": tree(state)}
        )
        for node in assistant_nodes(trace):
            fmt = rng.random() < 0.04
            changed = []
            if not fmt and rng.random() < 0.55:
                for p in rng.sample(paths, rng.randint(1, 2)):
                    new = rng.choice([v for v in range(3) if v != state.get(p, 0)])
                    state[p] = new
                    if new == 0:
                        del state[p]
                    changed.append(p)
            records.append(
                {
                    "kind": "turn",
                    "trace_id": trace_id,
                    "node": node,
                    "tree": tree(state),
                    "changed_paths": changed,
                    "format_error": fmt,
                }
            )

        def report() -> tuple[bool, dict, dict]:
            f2p = {f"f{i}": rng.choice(["PASSED", "FAILED", "SKIPPED", None]) for i in range(rng.randint(1, 4))}
            p2p = {f"p{i}": rng.choice(["PASSED", "PASSED", "FAILED"]) for i in range(rng.randint(0, 3))}
            return rng.random() < 0.4, f2p, p2p

        if rng.random() < 0.9:
            resolved, f2p, p2p = report()
            records.append(verification(trace_id, "original", resolved, f2p, p2p))
            if rng.random() < 0.85:
                outcomes = {t: rng.choice(["PASSED", "FAILED"]) for t in f2p}
                other = {t: rng.choice(["PASSED", "FAILED"]) for t in p2p}
                records.append(verification(trace_id, "intervention", rng.random() < 0.3, outcomes, other))
            elif rng.random() < 0.5:
                records.append(verification(trace_id, "intervention", status="unparseable"))
        else:
            records.append(verification(trace_id, "original", status="missing"))
    return write(tmp_path / f"traces-{seed}.jsonl", episodes), write(tmp_path / f"cec-{seed}.jsonl", records)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_identities_on_random_traces(seed: int, tmp_path: Path) -> None:
    traces, records = random_dataset(seed, tmp_path)
    rng = random.Random(seed)
    with tracedb.connect(":memory:") as db:
        assert db.ingest(traces).ok
        assert cec.ingest_records(db, records).ok
        usable_seen = 0
        for lam, cap in [(0.1, 1.0), (rng.uniform(0.01, 2), rng.uniform(0.01, 1)), (3.0, 0.05)]:
            cec.stamp(db, lam, cap)
            result = cec.check(db)
            assert result.ok, result.failures[:3]
            rows = db.sql("SELECT * FROM cec_selection").to_pylist()
            usable = [r for r in rows if r["intervention"] == "usable" and r["valid"]]
            assert result.checked == len(usable)
            usable_seen += len(usable)
            for row in rows:
                # Independently of check(): the identities from db.trace(), and each value = A + C.
                values = {c: node_values(db, row["trace_id"], cec.CREDIT_SETS[c]) for c in cec.ARMS}
                edit = set(row["selected_nodes"] or [])
                a = row["advantage"]
                for node, o in values["O"].items():
                    k = len(o)
                    assert o == [f32(a)] * k
                    assert values["B"][node] == [f32(a + row["credit_b"])] * k
                    assert values["M"][node] == [f32(a + (row["credit_m"] if node in edit else 0.0))] * k
                    assert values["E"][node] == [f32(a + (row["credit_e"] if node in edit else 0.0))] * k
                if row in usable:
                    c_m = np.concatenate([np.asarray(v, np.float64) - a for v in values["M"].values()])
                    c_b = np.concatenate([np.asarray(v, np.float64) - a for v in values["B"].values()])
                    mass = lam * row["d"] * row["s"] * row["generated_tokens"]
                    tol = 1e-6 * max(1.0, abs(mass)) + 4 * cec.F32_EPS * np.abs(a + c_b).sum()
                    assert abs(c_m.sum() - mass) <= tol and abs(c_b.sum() - mass) <= tol
                    assert abs(np.abs(c_m).sum() - np.abs(c_b).sum()) <= 2 * tol
                    if row["d"] != 0:
                        ratio = (c_m**2).sum() / (c_b**2).sum()
                        assert ratio == pytest.approx(row["generated_tokens"] / row["edit_tokens"], rel=1e-3)
        assert usable_seen > 0
