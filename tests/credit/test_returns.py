"""Turn-level returns and GAE (tracedb.credit.returns) against a plain per-branch, per-turn
reference written out with loops, on real verifiers 0.4.0 records and random traces."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tracedb
import tracedb.credit
from tracedb.credit import returns as R
from tracedb.credit.layouts import NODE_CREDIT

from support import FIXTURES, FIXTURES_041
from support.state_traces import assert_close, result
from support.turn_reference import LIMITS, Branch, credited, per_node, turn_values


def _fixture(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{name}.traces.jsonl").read_text().splitlines()[0])


def _episode(
    name: str = "linear",
    *,
    trace_id: str | None = None,
    rewards: dict | None = None,
    ok: bool = True,
    stop_condition: str | None = None,
    is_timeout: bool = False,
    nodes: list[dict] | None = None,
) -> dict[str, Any]:
    """A fixture episode with one trace, its outcome fields and nodes replaced as asked."""
    ep = _fixture(name)
    trace = ep["traces"][0]
    ep["traces"] = [trace]
    if trace_id is not None:
        ep["id"] = "ep-" + trace_id
        trace["id"] = trace_id
    trace["rewards"] = {"outcome": {"score": 1.0, "weight": 1.0}} if rewards is None else rewards
    trace["ok"] = ep["ok"] = ok
    trace["is_timeout"] = ep["is_timeout"] = is_timeout
    trace.pop("stop_condition", None)
    if stop_condition is not None:
        trace["stop_condition"] = stop_condition
    if nodes is not None:
        trace["nodes"] = nodes
    return ep


def _db(tmp_path: Path, episodes: list[dict]) -> tracedb.Database:
    path = tmp_path / f"{len(list(tmp_path.iterdir()))}.traces.jsonl"
    path.write_text("".join(json.dumps(ep) + "\n" for ep in episodes))
    db = tracedb.connect(":memory:")
    report = db.ingest(path)
    assert report.ok, report.rejected
    return db


def _set_fields(ep: dict, fields: dict[int, dict[str, Any]]) -> dict:
    for node, values in fields.items():
        ep["traces"][0]["nodes"][node].update(values)
    return ep


# ----------------------------------------------------------------------------- reference


def _outcome(trace: dict, reward: str | None) -> float | None:
    rewards = trace.get("rewards") or {}
    if reward is not None:
        return (rewards.get(reward) or {}).get("score")
    scored = [r for r in rewards.values() if r.get("score") is not None]
    return sum(r["score"] * r.get("weight", 1.0) for r in scored) if scored else None


def reference(
    episodes: list[dict],
    algorithm: str,
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
    reward: str | None = None,
    reward_field: str | None = None,
    value_field: str | None = None,
    bootstrap_field: str | None = None,
    terminal_reward: bool = True,
    subtract_values: bool = False,
    include_failed: bool = False,
) -> dict[tuple[str, int], float]:
    """(trace_id, node) -> advantage, one branch and one turn at a time."""
    out: dict[tuple[str, int], float] = {}
    for ep in episodes:
        for trace in ep["traces"]:
            outcome = _outcome(trace, reward)
            if not credited(trace, outcome, terminal_reward, include_failed):
                continue

            def branch_credit(branch: Branch, nodes: list[dict], outcome: float | None) -> dict[int, float]:
                turns, credit = branch.turns, {}
                r, v, v_end = turn_values(
                    branch,
                    nodes,
                    outcome,
                    reward_field=reward_field,
                    value_field=value_field,
                    bootstrap_field=bootstrap_field,
                    terminal_reward=terminal_reward,
                )
                g, a = v_end, 0.0
                for t in reversed(range(len(turns))):
                    g = r[t] + gamma * g
                    v_next = v[t + 1] if t + 1 < len(turns) else v_end
                    a = r[t] + gamma * v_next - v[t] + gamma * lam * a
                    if algorithm == "gae":
                        credit[turns[t]] = a
                    else:
                        credit[turns[t]] = g - v[t] if subtract_values else g
                return credit

            per_node(trace, outcome, branch_credit, out)
    return out


def _n_sampled(db: tracedb.Database) -> dict[tuple[str, int], int]:
    rows = db.sql("SELECT trace_id, node_index, n_sampled FROM nodes").to_pylist()
    return {(r["trace_id"], r["node_index"]): r["n_sampled"] for r in rows}


# ----------------------------------------------------------------------------- random traces


def _random_episode(rng: random.Random, i: int) -> dict:
    """A trace with a random message forest: shared prefixes, compaction attempts (resumed or
    not), turns without sampled tokens, and reward/value fields present, null, odd or absent."""
    nodes: list[dict] = []
    attempts: list[int] = []
    for k in range(rng.randint(1, 14)):
        node: dict[str, Any] = {"semantic_parents": []}
        if k and rng.random() < 0.9:
            node["parent"] = k - 1 if rng.random() < 0.7 else rng.randrange(k)
        sampled = rng.random() < 0.55
        n = rng.randint(0, 4)
        mask = [False] * n if not sampled else [False] * rng.randint(0, 1) + [True] * n
        if sampled and rng.random() < 0.1:
            mask = [False] * n  # sampled but no trainable tokens: not a turn
        node["message"] = {"role": "assistant" if sampled else "user", "content": f"m{k}"}
        node["sampled"] = sampled
        node["token_ids"] = [rng.randrange(1000) for _ in mask]
        node["mask"] = mask
        node["logprobs"] = [round(-rng.random(), 4) for m in mask if m]
        if k and rng.random() < 0.15:
            node["semantic_parents"] = [{"node": k - 1, "type": "compaction_attempt"}]
            attempts.append(k)
        elif attempts and rng.random() < 0.3:
            node["semantic_parents"] = [{"node": rng.choice(attempts), "type": "compaction"}]
        for field in ("reward", "value", "boot"):
            roll = rng.random()
            if roll < 0.6:
                node[field] = round(rng.uniform(-2, 2), 4)
            elif roll < 0.7:
                node[field] = None
            elif roll < 0.75:
                node[field] = "n/a"
            elif roll < 0.8:
                node[field] = rng.randint(-3, 3)
        nodes.append(node)
    rewards = rng.choice(
        [
            {"a": {"score": round(rng.uniform(-1, 1), 4), "weight": 1.0}},
            {"a": {"score": round(rng.random(), 4), "weight": 0.5}, "b": {"score": 1.0, "weight": 2.0}},
            {"b": {"score": 0.0, "weight": 1.0}},
            {},
        ]
    )
    return _episode(
        trace_id=f"t{i:03d}",
        rewards=rewards,
        ok=rng.random() < 0.85,
        is_timeout=rng.random() < 0.1,
        stop_condition=rng.choice([None, None, "max_turns", "max_total_tokens", "compaction_failed", "error"]),
        nodes=nodes,
    )


@pytest.fixture(scope="module")
def random_db(tmp_path_factory):
    rng = random.Random(20240611)
    episodes = [_random_episode(rng, i) for i in range(120)]
    db = _db(tmp_path_factory.mktemp("random"), episodes)
    yield db, episodes
    db.close()


CASES = [
    ("returns", {}),
    ("returns", {"gamma": 0.9, "reward_field": "reward", "value_field": "value"}),
    ("returns", {"gamma": 0.7, "reward_field": "reward", "value_field": "value", "subtract_values": True}),
    ("returns", {"gamma": 0.5, "value_field": "value", "bootstrap_field": "boot", "reward": "a"}),
    ("returns", {"gamma": 0.0, "reward_field": "reward", "terminal_reward": False}),
    ("gae", {}),
    ("gae", {"gamma": 0.9, "lam": 0.8, "reward_field": "reward", "value_field": "value"}),
    ("gae", {"gamma": 1.0, "lam": 1.0, "reward_field": "reward", "value_field": "value", "include_failed": True}),
    ("gae", {"gamma": 0.95, "lam": 0.0, "reward_field": "reward", "value_field": "value", "bootstrap_field": "boot"}),
    ("gae", {"gamma": 0.0, "lam": 0.5, "value_field": "value", "reward": "b"}),
    ("gae", {"gamma": 0.99, "lam": 0.9, "value_field": "value", "terminal_reward": False, "include_failed": True}),
    ("gae", {"gamma": 0.9, "lam": 0.7, "reward_field": "missing", "value_field": "absent", "bootstrap_field": "no"}),
]


@pytest.mark.parametrize(("algorithm", "params"), CASES)
def test_random_traces_match_reference(random_db, algorithm, params):
    db, episodes = random_db
    table = getattr(R, algorithm)(db, **params)
    assert table.schema == NODE_CREDIT
    got = result(table)
    assert_close(got, reference(episodes, algorithm, **params))
    sizes = _n_sampled(db)
    assert all(len(row["values"]) == sizes[(row["trace_id"], row["node_index"])] for row in table.to_pylist())
    keys = [(row["trace_id"], row["node_index"]) for row in table.to_pylist()]
    assert keys == sorted(keys)


def test_random_traces_cover_the_cases(random_db):
    """The random set really holds what the comparisons are meant to exercise."""
    db, episodes = random_db
    traces = [ep["traces"][0] for ep in episodes]
    assert sum(1 for t in traces if t.get("stop_condition") in LIMITS and t["ok"]) >= 10
    assert sum(1 for t in traces if not t["ok"] or t["is_timeout"]) >= 10
    assert sum(1 for t in traces if _outcome(t, None) is None) >= 10
    assert db.sql("SELECT count(*) n FROM branches WHERE NOT trainable").column("n")[0].as_py() >= 5
    shared = db.sql(
        "SELECT count(*) n FROM (SELECT b.trace_id, p FROM branches b, unnest(b.path) u(p) "
        "JOIN nodes n ON n.trace_id = b.trace_id AND n.node_index = p WHERE n.n_sampled > 0 "
        "GROUP BY ALL HAVING count(*) > 1)"
    )
    assert shared.column("n")[0].as_py() >= 20


# ----------------------------------------------------------------------------- worked examples


def test_terminated_vs_truncated_bootstrap(tmp_path):
    # linear: turns are nodes 2, 4, 6, 8, 10.
    values = {2: {"value": 0.5}, 4: {"value": 0.25}, 6: {"value": -1.0}, 8: {"value": 2.0}, 10: {"value": 0.75}}
    done = _set_fields(_episode(trace_id="done", rewards={"r": {"score": 1.0, "weight": 1.0}}), values)
    cut = _set_fields(_episode(trace_id="cut", stop_condition="max_turns"), values)
    boot = _set_fields(_episode(trace_id="boot", stop_condition="max_output_tokens"), values)
    boot["traces"][0]["nodes"][10]["v_end"] = 4.0
    timeout = _set_fields(_episode(trace_id="timeout", is_timeout=True), values)
    db = _db(tmp_path, [done, cut, boot, timeout])
    g = 0.5
    out = result(R.returns(db, gamma=g, value_field="value", include_failed=True))
    assert out[("done", 10)] == 1.0 and out[("done", 2)] == pytest.approx(g**4)
    assert out[("cut", 10)] == pytest.approx(1.0 + g * 0.75)  # V_T := V_{T-1}
    assert out[("timeout", 10)] == pytest.approx(1.0 + g * 0.75)
    assert out[("cut", 2)] == pytest.approx(g**4 * (1.0 + g * 0.75))
    out = result(R.returns(db, gamma=g, value_field="value", bootstrap_field="v_end"))
    assert out[("boot", 10)] == pytest.approx(1.0 + g * 4.0)
    assert ("timeout", 10) not in out  # timed out: excluded unless include_failed
    out = result(R.gae(db, gamma=g, lam=0.0, value_field="value"))
    assert out[("done", 10)] == pytest.approx(1.0 - 0.75)
    assert out[("cut", 10)] == pytest.approx(1.0 + g * 0.75 - 0.75)
    assert out[("done", 8)] == pytest.approx(g * 0.75 - 2.0)


def test_a_response_cut_at_max_turn_tokens_is_truncated(tmp_path):
    """verifiers 0.4.1's new stop condition: the trace its fixture stopped by the per-turn
    cap bootstraps from its last turn's value, as every other limit does; its kept
    neighbours, which completed, do not."""
    episodes = [json.loads(line) for line in (FIXTURES_041 / "dropped_group.traces.jsonl").read_text().splitlines()]
    stops = {}
    for ep in episodes:
        for trace in ep["traces"]:
            stops[trace["id"]] = trace.get("stop_condition")
            for node in trace["nodes"]:
                if node.get("sampled"):
                    node["value"] = 0.5
    assert "max_turn_tokens" in stops.values()
    db = _db(tmp_path, episodes)
    out = result(R.returns(db, gamma=1.0, value_field="value", reward="correct"))
    rewards = {r["trace_id"]: r["reward"] for r in R.trace_rewards(db, reward="correct").to_dicts()}
    last = {}
    for (tid, node), value in sorted(out.items()):
        last[tid] = (node, value)
    cut = next(t for t, s in stops.items() if s == "max_turn_tokens")
    assert last[cut][1] == pytest.approx(rewards[cut] + 0.5)  # V_T := V_{T-1}
    done = [t for t, s in stops.items() if s == "agent_completed" and t in last]
    assert done and all(last[t][1] == pytest.approx(rewards[t]) for t in done)  # V_T = 0


def test_compaction_attempts_are_truncated(tmp_path):
    # compaction: branch 0 = turns 2, 4, 6, 8 ending in a compaction attempt that node 10 resumes;
    # branch 1 = turns 10, 12 after the compaction.
    resumed = _set_fields(_episode("compaction", trace_id="resumed"), {8: {"value": 3.0}, 12: {"value": 5.0}})
    dropped = _set_fields(_episode("compaction", trace_id="dropped"), {8: {"value": 3.0}, 12: {"value": 5.0}})
    dropped["traces"][0]["nodes"][10]["semantic_parents"] = []  # the attempt was not resumed
    db = _db(tmp_path, [resumed, dropped])
    assert db.sql("SELECT trainable FROM branches WHERE trace_id = 'dropped' ORDER BY branch_index").column(
        "trainable"
    ).to_pylist() == [False, True]
    returns = result(R.returns(db, value_field="value"))
    gae = result(R.gae(db, gamma=0.9, lam=0.9, value_field="value"))
    for tid in ("resumed", "dropped"):
        assert returns[(tid, 8)] == pytest.approx(1.0 + 3.0)  # truncated: bootstrapped from V_{T-1}
        assert returns[(tid, 12)] == pytest.approx(1.0)  # terminated
        assert gae[(tid, 8)] == pytest.approx(1.0 + 0.9 * 3.0 - 3.0)
        assert gae[(tid, 12)] == pytest.approx(1.0 - 5.0)


def test_shared_prefix_takes_first_trainable_branch(tmp_path):
    # subagent_fork: branch 0 = turns 2, 4, 6, 8; branch 1 = turns 2, 4, 10, 12 (2 and 4 shared).
    plain = _set_fields(_episode("subagent_fork", trace_id="plain"), {6: {"reward": 1.0}, 10: {"reward": 10.0}})
    first_untrainable = copy.deepcopy(plain)
    first_untrainable["traces"][0]["id"] = "skip"
    first_untrainable["id"] = "ep-skip"
    first_untrainable["traces"][0]["nodes"][8]["semantic_parents"] = [{"node": 7, "type": "compaction_attempt"}]
    db = _db(tmp_path, [plain, first_untrainable])
    out = result(R.returns(db, gamma=0.5, reward_field="reward"))
    # plain: both branches trainable, the first (branch 0) decides the shared turns.
    assert out[("plain", 4)] == pytest.approx(0.5 * 1.0 + 0.5**2 * 1.0)
    assert out[("plain", 2)] == pytest.approx(0.5 * out[("plain", 4)])
    # skip: branch 0 is untrainable, so branch 1 decides them.
    assert out[("skip", 4)] == pytest.approx(0.5 * 10.0 + 0.5**2 * 1.0)
    assert out[("skip", 8)] == pytest.approx(1.0 + 0.0)  # truncated with V = 0
    episodes = [plain, first_untrainable]
    assert_close(out, reference(episodes, "returns", gamma=0.5, reward_field="reward"))
    # Every branch through a shared node shows the same value, whichever branch computed it.
    tracedb.credit.run(db, "returns", "shared", gamma=0.5, reward_field="reward")
    view = db.branches(credit="shared", columns=["advantages"]).to_pylist()
    skip = [row["advantages"] for row in view if row["trace_id"] == "skip"]
    sizes = [len(node["token_ids"]) for node in first_untrainable["traces"][0]["nodes"]]
    shared = sum(sizes[:5])  # nodes 0..4 are on both branches
    assert skip[0][:shared] == skip[1][:shared]
    assert skip[1][sizes[0] + sizes[1] + 3] == pytest.approx(out[("skip", 2)])  # node 2's first sampled token


def test_lambda_one_is_returns_minus_values(random_db):
    db, _ = random_db
    fields = {"reward_field": "reward", "value_field": "value", "gamma": 0.9}
    gae1 = result(R.gae(db, lam=1.0, **fields))
    returns = result(R.returns(db, subtract_values=True, **fields))
    assert_close(gae1, returns)  # lambda = 1: the return minus the value


def test_lambda_zero_is_one_step_td(tmp_path):
    values = {2: {"value": 0.5, "reward": 0.1}, 4: {"value": 0.25}, 6: {"value": -1.0, "reward": -0.2}}
    values.update({8: {"value": 2.0}, 10: {"value": 0.75, "reward": 0.3}})
    db = _db(tmp_path, [_set_fields(_episode(trace_id="x"), values)])
    out = result(R.gae(db, gamma=0.8, lam=0.0, reward_field="reward", value_field="value"))
    turns = [2, 4, 6, 8, 10]
    r = [0.1, 0.0, -0.2, 0.0, 0.3 + 1.0]
    v = [0.5, 0.25, -1.0, 2.0, 0.75, 0.0]
    for t, node in enumerate(turns):
        assert out[("x", node)] == pytest.approx(r[t] + 0.8 * v[t + 1] - v[t])


def test_missing_fields_read_zero(tmp_path):
    fields = {2: {"value": None, "reward": "high"}, 4: {"value": [1, 2]}, 6: {"value": {"x": 1}, "reward": True}}
    db = _db(tmp_path, [_set_fields(_episode(trace_id="odd"), fields)])
    out = result(R.gae(db, gamma=0.9, lam=0.9, reward_field="reward", value_field="value"))
    plain = result(R.gae(db, gamma=0.9, lam=0.9))
    assert_close(out, plain)
    assert out[("odd", 10)] == 1.0 and out[("odd", 2)] == pytest.approx(0.81**4)


def test_non_finite_field_is_refused(tmp_path):
    db = _db(tmp_path, [_set_fields(_episode(trace_id="inf"), {4: {"value": "-inf"}})])
    with pytest.raises(ValueError, match="trace inf, node 4"):
        R.gae(db, value_field="value")


def test_field_can_be_a_nodes_column(tmp_path):
    ep = _episode(trace_id="col", stop_condition="max_turns")
    db = _db(tmp_path, [ep])
    stamp = ep["traces"][0]["nodes"][10]["timestamp"]
    out = result(R.returns(db, gamma=1.0, bootstrap_field="timestamp"))
    assert out[("col", 10)] == pytest.approx(1.0 + stamp, rel=1e-6)


def test_excluded_traces_stay_unassigned(tmp_path):
    episodes = [
        _episode(trace_id="good"),
        _episode(trace_id="unscored", rewards={}),
        _episode(trace_id="failed", ok=False),
        _episode(trace_id="timeout", is_timeout=True),
    ]
    db = _db(tmp_path, episodes)
    assert {k[0] for k in result(R.gae(db))} == {"good"}
    assert {k[0] for k in result(R.gae(db, include_failed=True))} == {"good", "failed", "timeout"}
    assert {k[0] for k in result(R.gae(db, terminal_reward=False))} == {"good", "unscored"}
    assert {k[0] for k in result(R.returns(db, terminal_reward=False, include_failed=True))} == {
        "good",
        "unscored",
        "failed",
        "timeout",
    }
    tracedb.credit.run(db, "gae", "excl")
    view = {
        row["trace_id"]: row["advantages"] for row in db.branches(credit="excl", columns=["advantages"]).to_pylist()
    }
    assert view["good"] is not None
    assert view["unscored"] is None and view["failed"] is None and view["timeout"] is None


def test_empty_database_and_bad_parameters(tmp_path):
    with tracedb.connect(":memory:") as db:
        assert R.gae(db).num_rows == 0 and R.gae(db).schema == NODE_CREDIT
        assert R.returns(db).num_rows == 0
    db = _db(tmp_path, [_episode(trace_id="x")])
    with pytest.raises(ValueError, match="gamma"):
        R.returns(db, gamma=1.5)
    with pytest.raises(ValueError, match="lam"):
        R.gae(db, lam=-0.1)


# ----------------------------------------------------------------------------- numerics


def _chain(n_turns: int, rng: random.Random) -> list[dict]:
    nodes = [{"message": {"role": "system", "content": "s"}, "sampled": False, "token_ids": [1], "mask": [False]}]
    for k in range(n_turns):
        nodes.append(
            {
                "parent": len(nodes) - 1,
                "message": {"role": "assistant", "content": str(k)},
                "sampled": True,
                "token_ids": [2, 3],
                "mask": [False, True],
                "logprobs": [-0.5],
                "reward": round(rng.uniform(-1, 1), 4),
                "value": round(rng.uniform(-1, 1), 4),
            }
        )
    return nodes


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 0.9), (0.9, 1.0), (0.5, 0.6), (0.01, 0.01), (1.0, 1.0)])
def test_long_branch_against_loop(tmp_path, gamma, lam):
    rng = random.Random(7)
    episodes = [
        _episode(trace_id="long", stop_condition="max_turns", nodes=_chain(2000, rng)),
        _episode(trace_id="short", nodes=_chain(3, rng)),
    ]
    db = _db(tmp_path, episodes)
    params = {"gamma": gamma, "reward_field": "reward", "value_field": "value"}
    assert_close(result(R.gae(db, lam=lam, **params)), reference(episodes, "gae", lam=lam, **params))
    assert_close(result(R.returns(db, **params)), reference(episodes, "returns", **params))


def test_reverse_scan_segments():
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 300, size=40)
    x = rng.normal(size=int(lengths.sum()))
    ends = np.repeat(np.cumsum(lengths) - 1, lengths)
    for c in (0.0, 1e-3, 0.3, 0.97, 1.0):
        want = np.empty_like(x)
        for i in reversed(range(len(x))):
            want[i] = x[i] + (c * want[i + 1] if i < ends[i] else 0.0)
        np.testing.assert_allclose(R.reverse_scan(x, ends, c), want, rtol=1e-10, atol=1e-12)


# ----------------------------------------------------------------------------- through run()


def test_run_writes_a_set_the_view_spreads(random_db):
    db, episodes = random_db
    info = tracedb.credit.run(db, "gae", "my-gae", gamma=0.9, lam=0.8, reward_field="reward", value_field="value")
    assert info["params"]["gamma"] == 0.9 and info["params"]["lam"] == 0.8
    sets = {row["name"]: row for row in db.credit_sets().to_pylist()}
    params = json.loads(sets["my-gae"]["params"])
    assert sets["my-gae"]["algorithm"] == "gae"
    assert params["gamma"] == 0.9 and params["lam"] == 0.8 and params["value_field"] == "value"
    want = reference(episodes, "gae", gamma=0.9, lam=0.8, reward_field="reward", value_field="value")
    assert sets["my-gae"]["assigned_nodes"] == len(want)

    nodes = {ep["traces"][0]["id"]: ep["traces"][0]["nodes"] for ep in episodes}
    view = db.branches(credit="my-gae", columns=["sampled_mask", "advantages"]).to_pylist()
    paths = {
        (r["trace_id"], r["branch_index"]): r["path"]
        for r in db.sql("SELECT trace_id, branch_index, path FROM branches").to_pylist()
    }
    assigned = 0
    for row in view:
        tid = row["trace_id"]
        path = paths[(tid, row["branch_index"])]
        if not any((tid, n) in want for n in path):
            assert row["advantages"] is None  # nothing on the branch assigned
            continue
        expected = []
        for n in path:
            mask = nodes[tid][n].get("mask") or []
            expected += [want.get((tid, n), 0.0) if m else 0.0 for m in mask]
        assert row["sampled_mask"] == [bool(m) for n in path for m in nodes[tid][n].get("mask") or []]
        np.testing.assert_allclose(row["advantages"], expected, rtol=1e-5, atol=1e-5)
        assigned += 1
    assert assigned >= 30


def test_rows_come_by_trace_id_whatever_the_ingest_order(tmp_path):
    """The credit table is ordered by trace id then node index, as documented, also when
    traces were ingested in another order (node rows follow the ingest order)."""
    episodes = [_episode(trace_id=t) for t in ("t9", "t10", "a", "t2")]
    db = _db(tmp_path, episodes)
    for table in (R.returns(db), R.gae(db), R.returns_per_node(db), R.gae_per_node(db)):
        keys = [(r["trace_id"], r["node_index"]) for r in table.to_pylist()]
        assert keys == sorted(keys) and {k[0] for k in keys} == {"t9", "t10", "a", "t2"}
