"""V-trace (tracedb.credit.vtrace) against the paper's recursion written out with loops, one
branch and one turn at a time, on random groups with forks, shared nodes, compaction
attempts and truncated traces; its on-policy limit; the refusal of traces without
trainer_logprobs; and what ``run`` stamps."""

from __future__ import annotations

import copy
import math
import random
from typing import Any

import numpy as np
import pytest

import tracedb
import tracedb.credit
from tracedb.credit import returns as R
from tracedb.credit import vtrace as V
from tracedb.credit.layouts import NODE_CREDIT

from support.credit_groups import reward_of, shared_sampled_nodes, stored
from support.offpolicy import episodes, ingest
from support.state_traces import assert_close, result
from support.turn_reference import Branch, credited, per_node, turn_values

# ----------------------------------------------------------------------------- reference


def _log_ratio(node: dict[str, Any]) -> float:
    k = sum(node["mask"])
    tr = np.asarray(node["trainer_logprobs"][:k], np.float32).astype(np.float64)
    lp = np.asarray(node["logprobs"][:k], np.float32).astype(np.float64)
    return float(sum(t - i for t, i in zip(tr, lp)))


def reference(
    eps: list[dict[str, Any]],
    *,
    gamma: float = 1.0,
    rho_bar: float = 1.0,
    c_bar: float = 1.0,
    reward: str | None = None,
    reward_field: str | None = None,
    value_field: str | None = None,
    bootstrap_field: str | None = None,
    terminal_reward: bool = True,
    include_failed: bool = False,
) -> dict[tuple[str, int], float]:
    """(trace_id, node) -> advantage: per branch, v_T = V_T, then for s = T-1 .. 0
    delta_s = rho_s (r_s + gamma V_{s+1} - V_s), v_s = V_s + delta_s + gamma c_s (v_{s+1} - V_{s+1}),
    A_s = rho_s (r_s + gamma v_{s+1} - V_s)."""
    out: dict[tuple[str, int], float] = {}
    for episode in eps:
        for trace in episode["traces"]:
            outcome = reward_of(trace, reward)
            if not credited(trace, outcome, terminal_reward, include_failed):
                continue

            def branch_credit(branch: Branch, nodes: list[dict], outcome: float | None) -> dict[int, float]:
                turns, credit = branch.turns, {}
                n = len(turns)
                r, values, v_end = turn_values(
                    branch,
                    nodes,
                    outcome,
                    reward_field=reward_field,
                    value_field=value_field,
                    bootstrap_field=bootstrap_field,
                    terminal_reward=terminal_reward,
                )
                ratio = [math.exp(_log_ratio(nodes[i])) for i in turns]
                rho = [min(rho_bar, x) for x in ratio]
                c = [min(c_bar, x) for x in ratio]
                big_v = values + [v_end]
                target = [0.0] * n + [v_end]
                for s in reversed(range(n)):
                    delta = rho[s] * (r[s] + gamma * big_v[s + 1] - big_v[s])
                    target[s] = big_v[s] + delta + gamma * c[s] * (target[s + 1] - big_v[s + 1])
                for s in range(n):
                    credit[turns[s]] = rho[s] * (r[s] + gamma * target[s + 1] - big_v[s])
                return credit

            per_node(trace, outcome, branch_credit, out)
    return out


# ----------------------------------------------------------------------------- random groups


def _decorate(eps: list[dict[str, Any]], seed: int) -> list[dict[str, Any]]:
    """Stop conditions that truncate, compaction attempts (resumed or not) and bootstrap fields."""
    rng = random.Random(seed)
    for episode in eps:
        trace = episode["traces"][0]
        trace.pop("stop_condition", None)
        stop = rng.choice([None, None, None, "max_turns", "max_total_tokens", "error"])
        if stop is not None:
            trace["stop_condition"] = stop
        nodes = trace["nodes"]
        parents = {n.get("parent") for n in nodes}
        leaves = [i for i in range(1, len(nodes)) if i not in parents]
        if leaves and rng.random() < 0.3:
            leaf = rng.choice(leaves)
            nodes[leaf]["semantic_parents"] = [{"node": leaf - 1, "type": "compaction_attempt"}]
            later = [j for j in range(leaf + 1, len(nodes))]
            if later and rng.random() < 0.5:
                nodes[rng.choice(later)]["semantic_parents"] = [{"node": leaf, "type": "compaction"}]
        for node in nodes:
            if rng.random() < 0.7:
                node["boot"] = round(rng.uniform(-1, 1), 4)
    return eps


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    eps = _decorate(episodes(41, n_groups=16, ragged=False, spread=0.3), 41)
    db = ingest(tmp_path_factory.mktemp("vtrace"), eps)
    yield db, eps
    db.close()


CASES = [
    {},
    {"gamma": 0.9, "value_field": "v", "reward_field": "w"},
    {"gamma": 0.95, "rho_bar": 2.0, "c_bar": 0.8, "value_field": "v", "bootstrap_field": "boot"},
    {"gamma": 0.5, "rho_bar": 0.5, "c_bar": 0.5, "value_field": "v", "reward": "resolved"},
    {"gamma": 0.99, "rho_bar": 5.0, "c_bar": 5.0, "value_field": "v", "reward_field": "w", "include_failed": True},
    {"gamma": 1.0, "value_field": "v", "reward_field": "w", "terminal_reward": False},
    {"gamma": 0.0, "rho_bar": 1.5, "value_field": "v", "reward_field": "w"},
]


@pytest.mark.parametrize("params", CASES)
def test_random_groups_match_the_loop(groups, params):
    db, eps = groups
    table = V.vtrace(db, **params)
    assert table.schema == NODE_CREDIT
    assert_close(result(table), reference(eps, **params))
    keys = [(r["trace_id"], r["node_index"]) for r in table.to_pylist()]
    assert keys == sorted(keys)
    per_node = {(r["trace_id"], r["node_index"]): r["value"] for r in V.vtrace_per_node(db, **params).to_pylist()}
    assert per_node.keys() == result(table).keys()
    assert all(np.float32(per_node[k]) == np.float32(v) for k, v in result(table).items())


def test_the_groups_hold_what_the_loop_is_meant_to_check(groups):
    db, eps = groups
    assert shared_sampled_nodes(db) >= 15
    assert db.scalar("SELECT count(*) FROM branches WHERE NOT trainable") >= 2
    traces = [e["traces"][0] for e in eps]
    assert sum(t.get("stop_condition") in R.LIMITS for t in traces) >= 5
    ratios = [
        math.exp(_log_ratio(n)) for t in traces for n in t["nodes"] if sum(n["mask"]) and n.get("trainer_logprobs")
    ]
    assert min(ratios) < 0.5 and max(ratios) > 2.0  # both bars bite
    want = reference(eps, gamma=0.9, value_field="v")
    assert len(want) >= 40


def test_on_policy_it_is_gae_with_lambda_one(tmp_path):
    """Equal policies give rho = c = 1: the V-trace advantage is G_s - V(x_s)."""
    eps = _decorate(episodes(8, n_groups=6, ragged=False), 8)
    for e in eps:
        for node in e["traces"][0]["nodes"]:
            if "trainer_logprobs" in node:
                node["trainer_logprobs"] = list(node["logprobs"])
    db = ingest(tmp_path, eps)
    params = {"gamma": 0.9, "value_field": "v", "reward_field": "w", "bootstrap_field": "boot"}
    got = result(V.vtrace(db, rho_bar=3.0, c_bar=3.0, **params))
    gae = result(R.gae(db, lam=1.0, **params))
    assert got.keys() == gae.keys() and len(got) > 10
    for key, value in gae.items():
        assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def test_traces_without_trainer_logprobs_are_refused_by_name(tmp_path):
    eps = episodes(9, n_groups=4, ragged=False)
    ids = [e["traces"][0]["id"] for e in eps]
    bare = copy.deepcopy(eps)
    for e in bare[:3]:
        for node in e["traces"][0]["nodes"]:
            node.pop("trainer_logprobs", None)
    short = next((e, i) for e in bare[3:] for i, n in enumerate(e["traces"][0]["nodes"]) if sum(n["mask"]) >= 2)
    node = short[0]["traces"][0]["nodes"][short[1]]
    node["trainer_logprobs"] = node["trainer_logprobs"][:-1]
    db = ingest(tmp_path, bare)
    credited = {k[0] for k in reference(eps, include_failed=True)}
    with pytest.raises(ValueError) as caught:
        V.vtrace(db, include_failed=True)
    message = str(caught.value)
    assert "\n" not in message and "trainer_logprobs" in message and "write_nodes" in message
    for tid in ids[:3]:
        assert (tid in message) == (tid in credited), tid
    k = sum(node["mask"])
    assert f"trace {short[0]['traces'][0]['id']}, node {short[1]}: {k} sampled tokens, {k} logprobs, {k - 1}" in message
    with pytest.raises(ValueError, match="trainer_logprobs"):
        tracedb.credit.run(db, "vtrace", "vt", include_failed=True)
    assert not db.has_credit_set("vt")  # nothing written


def test_excluded_traces_need_no_trainer_logprobs(tmp_path):
    """A failed trace gets no credit, so it needs no recompute either."""
    eps = episodes(12, n_groups=3, ragged=False)
    failed = eps[0]["traces"][0]
    failed["ok"] = False
    for node in failed["nodes"]:
        node.pop("trainer_logprobs", None)
    db = ingest(tmp_path, eps)
    got = result(V.vtrace(db, value_field="v"))
    assert failed["id"] not in {k[0] for k in got}
    assert_close(got, reference(eps, value_field="v"))


def test_run_stamps_what_compute_gives(groups):
    db, eps = groups
    params = {"gamma": 0.9, "rho_bar": 1.2, "c_bar": 1.0, "value_field": "v"}
    info = tracedb.credit.run(db, "vtrace", "vt", replace=True, **params)
    assert info["params"]["rho_bar"] == 1.2 and info["params"]["c_bar"] == 1.0 and info["params"]["gamma"] == 0.9
    want = result(tracedb.credit.compute(db, "vtrace", **params))
    got = {k: v[0] for k, v in stored(db, "vt").items()}
    assert got.keys() == want.keys()
    assert all(np.float32(got[k]) == np.float32(v) for k, v in want.items())
    assert "vtrace" in tracedb.credit.algorithms()


def test_empty_database_and_bad_parameters(groups):
    with tracedb.connect(":memory:") as empty:
        assert V.vtrace(empty).num_rows == 0 and V.vtrace(empty).schema == NODE_CREDIT
        assert V.vtrace_per_node(empty).num_rows == 0
    db, _ = groups
    for kwargs, name in [
        ({"gamma": 1.5}, "gamma"),
        ({"rho_bar": 0}, "rho_bar"),
        ({"rho_bar": -1.0}, "rho_bar"),
        ({"c_bar": float("nan")}, "c_bar"),
        ({"c_bar": float("inf")}, "c_bar"),
        ({"c_bar": True}, "c_bar"),
    ]:
        with pytest.raises(ValueError, match=name):
            V.vtrace(db, **kwargs)


def test_weighted_reverse_scan_matches_a_loop():
    rng = np.random.default_rng(5)
    lengths = rng.integers(1, 200, size=50)
    x = rng.normal(size=int(lengths.sum()))
    ends = np.repeat(np.cumsum(lengths) - 1, lengths)
    for scale in (0.0, 0.5, 1.0, 1.3):
        coef = scale * rng.uniform(0.2, 1.0, size=len(x))
        want = np.empty_like(x)
        for i in reversed(range(len(x))):
            want[i] = x[i] + (coef[i] * want[i + 1] if i < ends[i] else 0.0)
        np.testing.assert_allclose(V.weighted_reverse_scan(x, ends, coef), want, rtol=1e-10, atol=1e-12)
