"""The policy mismatch (the ``policy_mismatch()`` macro, ``tracedb.offpolicy.mismatch``,
``db.policy_mismatch``) against numpy, one trace and one node at a time, on random groups
whose streams are cut short, run long, are empty or absent, under non-canonical masks."""

from __future__ import annotations

import json
import math

import duckdb
import numpy as np
import pyarrow as pa
import pytest

import tracedb
from tracedb import offpolicy
from tracedb.selection import Selection

from support.offpolicy import assert_figures, episode_with, episodes, figures, ingest, reference_mismatch


@pytest.fixture(scope="module")
def ragged(tmp_path_factory):
    eps = episodes(11, n_groups=14)
    db = ingest(tmp_path_factory.mktemp("mismatch"), eps)
    yield db, eps
    db.close()


def _rows(table: pa.Table) -> dict[tuple, dict]:
    return {(r["trace_id"], r["node_index"]): r for r in table.to_pylist()}


def _check(table: pa.Table, want: dict[tuple, dict]) -> None:
    got = _rows(table)
    assert set(got) == set(want)
    for key, expected in want.items():
        assert_figures(got[key], expected, key)


@pytest.mark.parametrize("per", ["trace", "turn"])
@pytest.mark.parametrize("c", [2.0, 1.5, 1.0, 10.0])
def test_macro_matches_numpy(ragged, per, c):
    db, eps = ragged
    table = db.sql("SELECT * FROM policy_mismatch(c := ?, per := ?)", [c, per])
    assert table.column_names == offpolicy.MISMATCH_SCHEMA.names
    _check(table, reference_mismatch(eps, per, c))
    keys = [(r["trace_id"], -1 if r["node_index"] is None else r["node_index"]) for r in table.to_pylist()]
    assert keys == sorted(keys)


def test_the_random_data_holds_every_case(ragged):
    """Nodes with one stream missing, empty, short or long, and tokens off-sample, so the
    comparisons above exercise what they are meant to."""
    _, eps = ragged
    nodes = [n for e in eps for n in e["traces"][0]["nodes"] if sum(n["mask"])]
    k = [sum(n["mask"]) for n in nodes]
    tr = [n.get("trainer_logprobs") for n in nodes]
    lp = [n["logprobs"] for n in nodes]
    assert sum(t is None for t in tr) >= 5 and sum(t == [] for t in tr) >= 3
    assert sum(t is not None and 0 < len(t) < n for t, n in zip(tr, k)) >= 3
    assert sum(t is not None and len(t) > n for t, n in zip(tr, k)) >= 3
    assert sum(len(x) == 0 for x in lp) >= 3 and sum(len(x) > n for x, n in zip(lp, k)) >= 3
    assert sum(not all(n["mask"]) and n["mask"] != sorted(n["mask"]) for n in nodes) >= 5  # off-sample tokens inside
    want = reference_mismatch(eps, "trace")
    assert sum(w["tokens"] == 0 for w in want.values()) >= 1 and sum(w["tokens"] > 0 for w in want.values()) >= 20
    shares = [w["outside_share"] for w in want.values() if w["tokens"]]
    assert 0 < np.mean(shares) < 1


@pytest.mark.parametrize("per", ["trace", "turn"])
def test_python_agrees_with_the_macro(ragged, per):
    db, eps = ragged
    macro = db.sql("SELECT * FROM policy_mismatch(c := 3.0, per := ?)", [per])
    every = offpolicy.mismatch(db, per=per, c=3.0)
    assert every.schema.remove_metadata() == offpolicy.MISMATCH_SCHEMA
    assert every.to_pylist() == macro.cast(offpolicy.MISMATCH_SCHEMA).to_pylist()
    assert tracedb.watermark_of(every) == db.watermark()
    assert db.policy_mismatch(per=per, c=3.0).to_pylist() == every.to_pylist()

    group = eps[0]["group"]["id"]
    members = {e["traces"][0]["id"] for e in eps if (e.get("group") or {}).get("id") == group}
    chosen = offpolicy.mismatch(db, per=per, c=3.0, selection=Selection(group=group))
    want = reference_mismatch(eps, per, 3.0)
    assert {r["trace_id"] for r in chosen.to_pylist()} == {k[0] for k in want if k[0] in members}
    assert per == "turn" or {r["trace_id"] for r in chosen.to_pylist()} == members  # a row per trace, turns or not
    macro_rows = macro.cast(offpolicy.MISMATCH_SCHEMA).to_pylist()
    assert chosen.to_pylist() == [r for r in macro_rows if r["trace_id"] in members]
    assert db.policy_mismatch(per=per, c=3.0, group=group).to_pylist() == chosen.to_pylist()
    _check(chosen, {k: v for k, v in want.items() if k[0] in members})
    two = sorted(members)[:2]
    assert {r["trace_id"] for r in db.policy_mismatch(trace_ids=two).to_pylist()} == set(two)


def test_selection_reads_as_of_a_watermark(tmp_path):
    eps = episodes(5, n_groups=4, ragged=False)
    db = ingest(tmp_path, eps[:6])
    mark = db.watermark()
    path = tmp_path / "more.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in eps[6:]))
    db.ingest(path)
    before = db.policy_mismatch(through=mark)
    assert tracedb.watermark_of(before) == mark and before.num_rows == 6
    after = db.policy_mismatch(after=mark)
    assert {r["trace_id"] for r in after.to_pylist()} == {e["traces"][0]["id"] for e in eps[6:]}


def test_a_worked_example(tmp_path, fresh_db):
    """Hand-computed: a non-canonical mask, one ratio inside the band, one outside, a
    trainer stream longer than the sampled tokens, a node holding no trainer stream."""
    root = {"message": {"role": "user", "content": "q"}, "sampled": False, "token_ids": [1, 2], "mask": [False, False]}
    turn = {
        "parent": 0,
        "message": {"role": "assistant", "content": "a"},
        "sampled": True,
        "token_ids": [3, 4, 5, 6],
        "mask": [False, True, False, True],
        "logprobs": [-1.0, -2.0],
        "trainer_logprobs": [-1.0 + math.log(3.0), -2.0, -7.0],  # ratios 3 and 1; the third is no token
    }
    other = {**turn, "parent": 1, "logprobs": [-0.5, -0.5], "trainer_logprobs": None}
    other.pop("trainer_logprobs")
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps(episode_with([root, turn, other])) + "\n")
    assert fresh_db.ingest(path, allow_ragged=True).ok
    d = np.array([np.float64(np.float32(-1.0 + math.log(3.0))) + 1.0, 0.0])
    ratio = np.exp(d)
    turns = _rows(fresh_db.policy_mismatch(per="turn"))
    t = "t0"
    assert set(turns) == {(t, 1), (t, 2)}
    assert turns[(t, 2)]["tokens"] == 0 and turns[(t, 2)]["k3_mean"] is None
    one = turns[(t, 1)]
    assert one["tokens"] == 2 and one["outside_share"] == 0.5
    assert one["ratio_max"] == pytest.approx(3.0, rel=1e-6) and one["ratio_mean"] == pytest.approx(2.0, rel=1e-6)
    assert one["k3_mean"] == pytest.approx(((3.0 - 1.0) - math.log(3.0)) / 2, rel=1e-6)
    assert one["k3_mean"] == pytest.approx(float(np.mean(ratio - 1 - d)), rel=1e-12)
    assert fresh_db.policy_mismatch(c=3.0, per="turn").to_pylist()[0]["outside_share"] == pytest.approx(
        float(ratio[0] > 3.0) / 2
    )
    whole = fresh_db.policy_mismatch().to_pylist()
    assert len(whole) == 1 and whole[0]["tokens"] == 2 and whole[0]["node_index"] is None


def test_k3_estimates_kl_inference_to_trainer(tmp_path):
    """The direction: tokens sampled from the inference policy q, k3's mean is KL(q || p)
    for the trainer's p, not KL(p || q) (the two differ by far more than the noise here)."""
    rng = np.random.default_rng(0)
    q = np.array([0.9, 0.05, 0.03, 0.02])
    p = np.array([0.25, 0.25, 0.25, 0.25])
    forward, backward = float(np.sum(q * np.log(q / p))), float(np.sum(p * np.log(p / q)))
    root = {"message": {"role": "user", "content": "q"}, "sampled": False, "token_ids": [1], "mask": [False]}
    tokens = rng.choice(4, size=20000, p=q)
    turn = {
        "parent": 0,
        "message": {"role": "assistant", "content": "a"},
        "sampled": True,
        "token_ids": tokens.tolist(),
        "mask": [True] * len(tokens),
        "logprobs": np.log(q)[tokens].tolist(),
        "trainer_logprobs": np.log(p)[tokens].tolist(),
    }
    path = tmp_path / "kl.jsonl"
    path.write_text(json.dumps(episode_with([root, turn])) + "\n")
    with tracedb.connect(":memory:") as db:
        assert db.ingest(path).ok
        k3 = db.policy_mismatch().to_pylist()[0]["k3_mean"]
    assert abs(k3 - forward) < 0.05 and abs(k3 - backward) > 0.2
    assert k3 == pytest.approx(
        figures(
            np.log(p)[tokens].astype(np.float32).astype(np.float64)
            - np.log(q)[tokens].astype(np.float32).astype(np.float64),
            2.0,
        )["k3_mean"]
    )


def test_empty_and_unrecomputed_databases(tmp_path):
    with tracedb.connect(":memory:") as db:
        for per in ("trace", "turn"):
            table = db.policy_mismatch(per=per)
            assert table.num_rows == 0 and table.schema.remove_metadata() == offpolicy.MISMATCH_SCHEMA
            assert db.sql("SELECT * FROM policy_mismatch(per := ?)", [per]).num_rows == 0
        assert db.sql("SELECT * FROM node_mismatch()").num_rows == 0
    eps = episodes(3, n_groups=2, ragged=False)
    for e in eps:
        for node in e["traces"][0]["nodes"]:
            node.pop("trainer_logprobs", None)
    db = ingest(tmp_path, eps)
    rows = db.policy_mismatch().to_pylist()
    assert len(rows) == len(eps) and all(r["tokens"] == 0 and r["ratio_max"] is None for r in rows)
    assert db.policy_mismatch(group="no such group").num_rows == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"per": "node"}, "per must be one of"),
        ({"c": 0.5}, "c must be a finite number of at least 1"),
        ({"c": float("nan")}, "c must be"),
        ({"c": float("inf")}, "c must be"),
        ({"c": "2"}, "c must be"),
        ({"c": True}, "c must be"),
    ],
)
def test_bad_parameters_are_one_clear_line(fresh_db, kwargs, message):
    with pytest.raises(ValueError, match=message):
        fresh_db.policy_mismatch(**kwargs)


def test_the_macros_refuse_bad_parameters_and_run_in_plain_duckdb(tmp_path):
    eps = episodes(2, n_groups=2, ragged=False)
    path = tmp_path / "plain.duckdb"
    with tracedb.connect(path) as db:
        src = tmp_path / "in.jsonl"
        src.write_text("".join(json.dumps(e) + "\n" for e in eps))
        db.ingest(src)
        want = db.policy_mismatch(per="turn").to_pylist()
    con = duckdb.connect(str(path), read_only=True)  # no tracedb code from here on
    try:
        got = con.sql("SELECT * FROM policy_mismatch(per := 'turn')").to_arrow_table()
        assert got.cast(offpolicy.MISMATCH_SCHEMA).to_pylist() == want
        with pytest.raises(duckdb.InvalidInputException, match="per must be 'trace' or 'turn', got node"):
            con.sql("SELECT * FROM policy_mismatch(per := 'node')").fetchall()
        with pytest.raises(duckdb.InvalidInputException, match="c must be at least 1"):
            con.sql("SELECT * FROM policy_mismatch(c := 0.9)").fetchall()
    finally:
        con.close()
