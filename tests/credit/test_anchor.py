"""Anchor-state grouping (``anchor``: GiGPO, TIGPO's history) against a plain loop over the
generated rollouts (support.state_traces): random groups with forks, shared nodes, untrainable
branches and missing, null or typed state keys; the history-key and singleton rules; TIGPO's
earlier groups; parameter refusals; ``tracedb credit anchor`` end to end."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from typer.testing import CliRunner

import tracedb
import tracedb.credit
from tracedb.cli.main import app
from tracedb.credit.anchor import anchor
from tracedb.credit.layouts import NODE_CREDIT

from support.state_traces import (
    SYSTEM,
    assert_close,
    episode_of,
    group_rewards,
    ingest,
    make_episodes,
    node,
    reference_turns,
    result,
    stored,
)


def _standardized(x: float, values: list[float], scale_std: bool, eps: float) -> float:
    if len(values) < 2 or min(values) == max(values):
        return 0.0
    out = x - sum(values) / len(values)
    return out / (statistics.stdev(values) + eps) if scale_std else out


def reference(
    episodes: list[dict],
    *,
    gamma: float = 1.0,
    omega: float = 1.0,
    scale_std: bool = False,
    eps: float = 1e-6,
    key_field: str | None = "state_key",
    episode_stats: str = "trace",
    reward_field: str | None = None,
    include_failed: bool = False,
    earlier: dict[str, list[str]] | None = None,
) -> dict[tuple[str, int], float]:
    """(trace id, node) -> A^E + omega A^S, one turn at a time; ``earlier``: group -> the
    groups whose turns join its step statistics (TIGPO)."""
    turns = reference_turns(
        episodes, gamma=gamma, reward_field=reward_field, key_field=key_field, include_failed=include_failed
    )
    rewards = group_rewards(episodes, include_failed)
    out = {}
    for turn in turns:
        if episode_stats == "trace":
            population = rewards[turn.group]
        else:
            population = [u.R for u in turns if u.group == turn.group]
        a_e = _standardized(turn.R, population, scale_std, eps)
        sources = {turn.group, *(earlier or {}).get(turn.group, [])}
        k = [u.G for u in turns if u.group in sources and u.key == turn.key]
        out[(turn.trace_id, turn.node)] = a_e + omega * _standardized(turn.G, k, scale_std, eps)
    return out


@pytest.fixture(scope="module")
def random_db(tmp_path_factory):
    episodes = make_episodes(7, n_groups=8, sizes=(1, 7))
    db = ingest(tmp_path_factory.mktemp("anchor"), episodes)
    yield db, episodes
    db.close()


CASES = [
    {},
    {"scale_std": True},
    {"gamma": 0.9, "omega": 0.5, "reward_field": "reward"},
    {"gamma": 0.8, "scale_std": True, "eps": 0.1, "episode_stats": "turn"},
    {"key_field": None, "episode_stats": "turn", "reward_field": "reward"},
    {"key_field": "role", "omega": 2.0},
    {"omega": 0.0},
    {"include_failed": True, "gamma": 0.5},
]


@pytest.mark.parametrize("params", CASES)
def test_random_groups_match_the_reference(random_db, params):
    db, episodes = random_db
    table = anchor(db, **params)
    assert table.schema == NODE_CREDIT
    assert_close(result(table), reference(episodes, **params))
    keys = [(r["trace_id"], r["node_index"]) for r in table.to_pylist()]
    assert keys == sorted(keys)


def test_the_random_groups_hold_the_cases(random_db):
    """Shared states across traces, shared nodes, untrainable branches, both key kinds."""
    db, episodes = random_db
    turns = reference_turns(episodes)
    by_state: dict[tuple, set[str]] = {}
    for t in turns:
        by_state.setdefault((t.group, t.key), set()).add(t.trace_id)
    assert sum(1 for ids in by_state.values() if len(ids) > 1) >= 10  # one state, several traces
    assert sum(1 for ids in by_state.values() if len(ids) == 1) >= 10  # singletons
    assert sum(1 for t in turns if t.key[0] == "field") >= 20
    assert sum(1 for t in turns if t.key[0] == "history" and len(t.key[1]) > 2) >= 20
    assert db.sql("SELECT count(*) n FROM branches WHERE NOT trainable").column("n")[0].as_py() >= 5
    shared = db.sql(
        "SELECT count(*) n FROM (SELECT b.trace_id, p FROM branches b, unnest(b.path) u(p) "
        "JOIN nodes n ON n.trace_id = b.trace_id AND n.node_index = p WHERE n.n_sampled > 0 "
        "GROUP BY ALL HAVING count(*) > 1)"
    )
    assert shared.column("n")[0].as_py() >= 10
    assert any(v != 0 for v in result(anchor(db, omega=1.0)).values())


def test_omega_zero_is_grpo_on_every_turn(random_db):
    db, _ = random_db
    for scale_std in (False, True):
        grpo = {r["trace_id"]: r["value"] for r in tracedb.credit.compute(db, "grpo", scale_std=scale_std).to_pylist()}
        got = result(anchor(db, omega=0.0, scale_std=scale_std))
        assert got and all(v == pytest.approx(grpo[tid], abs=1e-6) for (tid, _), v in got.items())


# --------------------------------------------------------------------------- worked examples


def _chain(*tokens: list[int], keys: dict[int, object] | None = None) -> list[dict]:
    """System, task prompt, then alternating turn / tool output segments."""
    nodes = [node(SYSTEM, None, sampled=False), node([200, 1], 0, sampled=False)]
    for k, t in enumerate(tokens):
        extra = {"state_key": keys[k]} if keys and k in keys else {}
        nodes.append(node(t, len(nodes) - 1, sampled=k % 2 == 0, **extra))
    return nodes


def test_history_keys_never_merge_histories_that_end_alike(tmp_path):
    # A and C act on the same history at their second turn; B reaches the same tool output
    # [8, 8] after another first turn: the same last observation, another state.
    eps = [
        episode_of("A", "g", _chain([7, 1], [8, 8], [7, 5]), 1.0),
        episode_of("B", "g", _chain([7, 2], [8, 8], [7, 5]), 0.0),
        episode_of("C", "g", _chain([7, 1], [8, 8], [7, 6]), 0.5),
    ]
    db = ingest(tmp_path, eps)
    got = result(anchor(db, omega=1.0))
    mean = 0.5
    # First turns: one state (system + prompt) for all three: K = {1, 0, 0.5}.
    assert got[("A", 2)] == pytest.approx((1.0 - mean) * 2)
    assert got[("B", 2)] == pytest.approx((0.0 - mean) * 2)
    # Second turns: A and C share their history; B's is its own (singleton: A^S = 0).
    assert got[("A", 4)] == pytest.approx((1.0 - mean) + (1.0 - 0.75))
    assert got[("C", 4)] == pytest.approx((0.5 - mean) + (0.5 - 0.75))
    assert got[("B", 4)] == pytest.approx(0.0 - mean)
    assert_close(got, reference(eps))


def test_key_field_overrides_the_history_and_json_types_differ(tmp_path):
    eps = [
        episode_of("A", "g", _chain([7, 1], [8, 1], [7, 5], keys={2: 1}), 1.0),
        episode_of("B", "g", _chain([7, 2], [8, 2], [7, 5], keys={2: 1}), 0.0),
        episode_of("C", "g", _chain([7, 3], [8, 3], [7, 5], keys={2: "1"}), 0.5),
        episode_of("D", "g", _chain([7, 3], [8, 3], [7, 5], keys={2: None}), 0.25),
    ]
    db = ingest(tmp_path, eps)
    got = result(anchor(db, omega=1.0))
    mean = 0.4375
    assert got[("A", 4)] == pytest.approx((1.0 - mean) + 0.5)  # K = {A, B} by the field 1
    assert got[("B", 4)] == pytest.approx((0.0 - mean) - 0.5)
    assert got[("C", 4)] == pytest.approx(0.5 - mean)  # "1" is not 1; D's null is absent, its history differs
    assert got[("D", 4)] == pytest.approx(0.25 - mean)
    assert_close(got, reference(eps))


def test_a_singleton_state_gives_zero_step_advantage(tmp_path):
    eps = [episode_of("A", "g", _chain([7, 1]), 1.0), episode_of("B", None, _chain([7, 1]), 3.0)]
    db = ingest(tmp_path, eps)
    assert result(anchor(db, omega=5.0, scale_std=True)) == {("A", 2): 0.0, ("B", 2): 0.0}


def test_invalid_traces_stay_unassigned(tmp_path):
    eps = [
        episode_of("ok", "g", _chain([7, 1]), 1.0),
        episode_of("failed", "g", _chain([7, 1]), 5.0, ok=False),
        episode_of("unscored", "g", _chain([7, 1]), None),
        episode_of("other", "g", _chain([7, 1]), 0.0),
    ]
    db = ingest(tmp_path, eps)
    got = result(anchor(db))
    assert set(got) == {("ok", 2), ("other", 2)}
    assert got[("ok", 2)] == pytest.approx(0.5 + 0.5)
    got = result(anchor(db, include_failed=True))
    assert ("failed", 2) in got and ("unscored", 2) not in got


# --------------------------------------------------------------------------- TIGPO history


def _history_db(tmp_path: Path) -> tuple[tracedb.Database, list[dict], dict[str, tuple[int, int]]]:
    """Steps 0..4 ingested with a ``step`` tag, three tasks per step, tasks sharing prompts
    across steps; group -> (task, step)."""
    db, episodes, where = None, [], {}
    for step in (3, 0, 2, 1, 4):  # ingest order is not the order
        eps = make_episodes(100 + step, n_groups=3, sizes=(1, 4), invalid=0.1, prefix=f"step{step}-")
        db = ingest(tmp_path, eps, db, tags=[f"step={step}"])
        episodes += eps
        for ep in eps:
            group = (ep.get("group") or {}).get("id") or "trace:" + ep["traces"][0]["id"]
            where[group] = (ep["traces"][0]["task"]["data"]["idx"], step)
    return db, episodes, where


def _earlier(where: dict[str, tuple[int, int]], groups: set[str], k: int) -> dict[str, list[str]]:
    out = {}
    for g in groups:
        task, step = where[g]
        before = sorted((where[h][1], h) for h in groups if where[h][0] == task and where[h][1] < step)
        out[g] = [h for _, h in before[-k:]] if k else []
    return out


@pytest.mark.parametrize("k", [1, 2, 10])
def test_history_adds_earlier_groups_of_the_task_to_the_step_statistics(tmp_path, k):
    db, episodes, where = _history_db(tmp_path)
    groups = set(group_rewards(episodes))
    earlier = _earlier(where, groups, k)
    assert sum(1 for v in earlier.values() if len(v) >= min(k, 2)) >= 5
    params = {"history": k, "task_key": "$.task.data.idx", "order_by": "step", "gamma": 0.9}
    got = result(anchor(db, **params))
    assert_close(got, reference(episodes, gamma=0.9, earlier=earlier))
    assert got != result(anchor(db, gamma=0.9))  # the history changed something
    # Only the step statistics: the episode part is unchanged (omega 0 equals no history).
    assert result(anchor(db, omega=0.0, **params)) == result(anchor(db, omega=0.0, gamma=0.9))


def test_history_orders_by_a_traces_column(tmp_path):
    # seq, the ingest sequence: the steps come as ingested (3, 0, 2, 1, 4) and the traces of
    # one ingest one after the other; a group's position is its valid traces' least seq.
    db, episodes, where = _history_db(tmp_path)
    seq = {r["trace_id"]: r["seq"] for r in db.sql("SELECT trace_id, seq FROM traces").to_pylist()}
    valid = {t.trace_id: t.group for t in reference_turns(episodes)}
    groups = set(group_rewards(episodes))
    first = {g: min(seq[t] for t, h in valid.items() if h == g) for g in groups if g in valid.values()}
    by_seq = {g: (where[g][0], first.get(g, 0)) for g in groups}
    earlier = _earlier(by_seq, groups, 2)
    got = result(anchor(db, history=2, task_key="$.task.data.idx", order_by="seq"))
    assert_close(got, reference(episodes, earlier=earlier))


def test_a_group_of_two_tasks_is_refused(tmp_path):
    eps = [
        episode_of("A", "g", _chain([7, 1]), 1.0, task=0),
        episode_of("B", "g", _chain([7, 1]), 0.0, task=1),
    ]
    db = ingest(tmp_path, eps, tags=["step=1"])
    with pytest.raises(ValueError, match="task_key: group 'g' holds traces of several tasks"):
        anchor(db, history=1, task_key="$.task.data.idx", order_by="step")


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("params", "word"),
    [
        ({"key_field": "no_such_field"}, "key_field"),
        ({"key_field": ""}, "key_field"),
        ({"gamma": 1.5}, "gamma"),
        ({"omega": float("nan")}, "omega"),
        ({"eps": -1.0}, "eps"),
        ({"episode_stats": "node"}, "episode_stats"),
        ({"history": -1}, "history"),
        ({"history": 1.5}, "history"),
        ({"history": 2}, "task_key"),
        ({"history": 2, "task_key": "$.task.data.idx"}, "order_by"),
        ({"history": 2, "task_key": "nope", "order_by": "step"}, "task_key"),
        ({"history": 2, "task_key": "$.no.such.path", "order_by": "seq"}, "task_key"),
        ({"history": 2, "task_key": "$.task.data.idx", "order_by": "nope"}, "order_by"),
        ({"group_by": "nope"}, "nope"),
        ({"reward_field": "no_such_field"}, "reward_field"),
    ],
)
def test_bad_parameters_are_refused_by_name(random_db, params, word):
    db, _ = random_db
    with pytest.raises(ValueError, match=word):
        anchor(db, **params)


def test_a_mixed_order_tag_is_refused(tmp_path):
    db = ingest(tmp_path, [episode_of("A", "g", _chain([7, 1]), 1.0)], tags=["step=1"])
    db = ingest(tmp_path, [episode_of("B", "g", _chain([7, 1]), 0.0)], db, tags=["step=late"])
    with pytest.raises(ValueError, match="order_by 'step'"):
        anchor(db, history=1, task_key="$.task.data.idx", order_by="step")


def test_the_default_key_field_may_be_absent_everywhere(tmp_path):
    db = ingest(tmp_path, [episode_of("A", "g", _chain([7, 1]), 1.0)])
    assert result(anchor(db)) == result(anchor(db, key_field=None)) == {("A", 2): 0.0}


# --------------------------------------------------------------------------- run and CLI


def test_cli_stamps_an_anchor_set(tmp_path, random_db):
    _, episodes = random_db
    path = tmp_path / "runs.duckdb"
    with tracedb.connect(path) as db:
        ingest(tmp_path, episodes, db)
    runner = CliRunner()
    out = runner.invoke(
        app,
        ["credit", "anchor", "--name", "gigpo", "-p", "gamma=0.9", "-p", "scale_std=true", "--db", str(path), "--json"],
    )
    assert out.exit_code == 0, out.output
    summary = json.loads(out.stdout)
    assert summary["algorithm"] == "anchor" and summary["params"]["gamma"] == 0.9 and summary["nodes"] > 0
    with tracedb.connect(path, read_only=True) as db:
        stored_values = stored(db, "gigpo")
    assert_close(stored_values, reference(episodes, gamma=0.9, scale_std=True))
    bad = runner.invoke(app, ["credit", "anchor", "--name", "x", "-p", "kappa=1", "--db", str(path)])
    assert bad.exit_code != 0
    bad = runner.invoke(app, ["credit", "anchor", "--name", "x", "-p", "key_field=nope", "--db", str(path)])
    assert bad.exit_code != 0 and "key_field" in bad.output
