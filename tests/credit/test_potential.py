"""Potential-based credit (``potential``: PGPO) against a plain loop over the generated
rollouts (support.state_traces): random groups with forks, shared nodes, untrainable
branches and missing state keys; the telescoping property; kappa's shrinkage; refusals."""

from __future__ import annotations

import json
import random

import pytest

import tracedb.credit
from tracedb.credit.layouts import NODE_CREDIT
from tracedb.credit.potential import potential

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


def reference(
    episodes: list[dict],
    *,
    gamma: float = 1.0,
    kappa: float = 1.0,
    key_field: str | None = "state_key",
    reward_field: str | None = None,
    include_failed: bool = False,
) -> dict[tuple[str, int], float]:
    """(trace id, node) -> r_t + gamma Phi(s_{t+1}) - Phi(s_t), one turn at a time."""
    turns = reference_turns(
        episodes, gamma=gamma, reward_field=reward_field, key_field=key_field, include_failed=include_failed
    )
    rewards = group_rewards(episodes, include_failed)

    def phi(group: str, key: tuple | None) -> float:
        if key is None:
            return 0.0
        visits = [u.G for u in turns if u.group == group and u.key == key]
        mean = sum(rewards[group]) / len(rewards[group])
        return (sum(visits) + kappa * mean) / (len(visits) + kappa)

    return {(t.trace_id, t.node): t.r + gamma * phi(t.group, t.next_key) - phi(t.group, t.key) for t in turns}


@pytest.fixture(scope="module")
def random_db(tmp_path_factory):
    episodes = make_episodes(11, n_groups=8, sizes=(1, 7))
    db = ingest(tmp_path_factory.mktemp("potential"), episodes)
    yield db, episodes
    db.close()


CASES = [
    {},
    {"kappa": 0.0},
    {"gamma": 0.9, "kappa": 2.5, "reward_field": "reward"},
    {"gamma": 0.5, "key_field": None},
    {"key_field": "role", "kappa": 0.5},
    {"include_failed": True, "gamma": 0.7, "reward_field": "reward"},
]


@pytest.mark.parametrize("params", CASES)
def test_random_groups_match_the_reference(random_db, params):
    db, episodes = random_db
    table = potential(db, **params)
    assert table.schema == NODE_CREDIT
    got = result(table)
    assert_close(got, reference(episodes, **params))
    assert any(abs(v) > 1e-6 for v in got.values())


def test_the_random_groups_hold_the_cases(random_db):
    db, episodes = random_db
    turns = reference_turns(episodes)
    visits: dict[tuple, int] = {}
    for t in turns:
        visits[(t.group, t.key)] = visits.get((t.group, t.key), 0) + 1
    assert sum(1 for n in visits.values() if n > 1) >= 10 and sum(1 for n in visits.values() if n == 1) >= 10
    assert sum(1 for t in turns if t.next_key is not None) >= 20  # turns with a next state
    assert db.sql("SELECT count(*) n FROM branches WHERE NOT trainable").column("n")[0].as_py() >= 5


def _chains(seed: int, n_groups: int = 6) -> list[dict]:
    """Single-branch traces whose first turn acts on the group's prompt (a state each
    trace visits once: later turns have longer histories) and no state keys."""
    rng = random.Random(seed)
    eps = []
    for g in range(n_groups):
        for t in range(rng.randint(1, 6)):
            nodes = [node(SYSTEM, None, sampled=False), node([300 + g], 0, sampled=False)]
            for _ in range(rng.randint(1, 5)):
                nodes.append(node([7, rng.randint(0, 1)], len(nodes) - 1, sampled=True))
                nodes.append(node([8, rng.randint(0, 1)], len(nodes) - 1, sampled=False))
            eps.append(episode_of(f"c{g}-{t}", f"g{g}", nodes, rng.choice([0.0, 0.5, 1.0, 3.0])))
    return eps


def test_advantages_telescope_to_grpo_from_one_shared_start(tmp_path):
    """gamma 1, terminal reward only, kappa 0, one shared start visited once per trace:
    sum_t A_t = R - mean_g R."""
    episodes = _chains(5)
    db = ingest(tmp_path, episodes)
    got = result(potential(db, gamma=1.0, kappa=0.0))
    rewards = group_rewards(episodes)
    sums: dict[str, float] = {}
    for (tid, _), value in got.items():
        sums[tid] = sums.get(tid, 0.0) + value
    shared = 0
    for ep in episodes:
        trace = ep["traces"][0]
        group = rewards[ep["group"]["id"]]
        assert sums[trace["id"]] == pytest.approx(trace["rewards"]["r"]["score"] - sum(group) / len(group), abs=1e-5)
        shared += len(group) > 1 and len(trace["nodes"]) > 4
    assert shared >= 5  # groups of several traces with several turns each
    assert_close(got, reference(episodes, kappa=0.0))


def test_kappa_shrinks_a_lone_state_toward_the_group_mean(tmp_path):
    def chain(first: list[int], reward: float, tid: str) -> dict:
        nodes = [node(SYSTEM, None, sampled=False), node([300], 0, sampled=False)]
        nodes.append(node(first, 1, sampled=True))
        nodes.append(node([8, 1], 2, sampled=False))
        nodes.append(node([7, 9], 3, sampled=True))
        return episode_of(tid, "g", nodes, reward)

    eps = [chain([7, 1], 1.0, "A"), chain([7, 2], 0.0, "B")]
    db = ingest(tmp_path, eps)
    for kappa in (0.0, 1.0, 3.0):
        got = result(potential(db, kappa=kappa))
        start = (1.0 + 0.0 + kappa * 0.5) / (2 + kappa)  # both first turns act on the prompt
        lone_a = (1.0 + kappa * 0.5) / (1 + kappa)  # A's second turn: its own history
        lone_b = (0.0 + kappa * 0.5) / (1 + kappa)
        assert got[("A", 2)] == pytest.approx(lone_a - start)
        assert got[("A", 4)] == pytest.approx(1.0 - lone_a)
        assert got[("B", 2)] == pytest.approx(lone_b - start)
        assert got[("B", 4)] == pytest.approx(0.0 - lone_b)


def test_invalid_traces_stay_unassigned_and_out_of_the_potentials(tmp_path):
    nodes = [node(SYSTEM, None, sampled=False), node([300], 0, sampled=False), node([7, 1], 1, sampled=True)]
    eps = [
        episode_of("ok", "g", nodes, 1.0),
        episode_of("also", "g", nodes, 0.0),
        episode_of("failed", "g", nodes, 9.0, is_timeout=True),
        episode_of("unscored", "g", nodes, None),
    ]
    db = ingest(tmp_path, eps)
    assert result(potential(db, kappa=0.0)) == {("ok", 2): 0.5, ("also", 2): -0.5}


@pytest.mark.parametrize(
    ("params", "word"),
    [
        ({"kappa": -0.5}, "kappa"),
        ({"kappa": float("inf")}, "kappa"),
        ({"kappa": "1"}, "kappa"),
        ({"gamma": -0.1}, "gamma"),
        ({"key_field": "no_such_field"}, "key_field"),
        ({"key_field": 3}, "key_field"),
        ({"group_by": "nope"}, "nope"),
        ({"reward_field": "no_such_field"}, "reward_field"),
    ],
)
def test_bad_parameters_are_refused_by_name(random_db, params, word):
    db, _ = random_db
    with pytest.raises(ValueError, match=word):
        potential(db, **params)


def test_run_stamps_a_set(random_db):
    db, episodes = random_db
    info = tracedb.credit.run(db, "potential", "pgpo", gamma=0.9, kappa=0.5)
    assert info["params"]["kappa"] == 0.5 and info["params"]["key_field"] == "state_key"
    sets = {row["name"]: row for row in db.credit_sets().to_pylist()}
    assert sets["pgpo"]["algorithm"] == "potential" and json.loads(sets["pgpo"]["params"])["gamma"] == 0.9
    stored_values = stored(db, "pgpo")
    assert_close(stored_values, reference(episodes, gamma=0.9, kappa=0.5))
