"""Branch-variance credit (CBPO, ``tracedb.credit.branch``) against a plain loop reference:
a dict trie keyed by root-to-node token tuples, forks found by counting children, each
node scored against its nearest fork above, on random groups with forks across and within
traces, shared prefixes and nodes shared by branches."""

from __future__ import annotations

import copy
import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tracedb
import tracedb.credit
from tracedb.credit.branch import branch

from support.credit_groups import (
    EPISODE,
    TRACE,
    all_traces,
    as_dict,
    assert_same,
    groups_of,
    ingest,
    is_valid,
    key_path,
    make_episodes,
    n_sampled,
    reward_of,
    shared_sampled_nodes,
    stored,
)


def reference_branch(
    episodes: list[dict[str, Any]], beta: float = 1.0, include_failed: bool = False, name: str | None = None
) -> tuple[dict[tuple[str, int], list[float]], dict[tuple[str, int], tuple | None]]:
    """(trace id, node) -> compact credit, and (trace id, node) -> the trie key of the fork
    whose segment holds the node (None above the group's first fork)."""
    out: dict[tuple[str, int], list[float]] = {}
    fork_of: dict[tuple[str, int], tuple | None] = {}
    for traces in groups_of(episodes, name, include_failed).values():
        reward = {t["id"]: reward_of(t, name) for t in traces}
        members: dict[tuple, set[str]] = defaultdict(set)
        members[()] = set(reward)
        children: dict[tuple, set[tuple]] = defaultdict(set)
        for t in traces:
            for i in range(len(t["nodes"])):
                key = key_path(t["nodes"], i)
                members[key].add(t["id"])
                children[key[:-1]].add(key)

        def mean(key: tuple, members=members, reward=reward) -> float:
            return sum(reward[i] for i in members[key]) / len(members[key])

        def spread(key: tuple, members=members, reward=reward) -> float:
            m = mean(key)
            return math.sqrt(sum((reward[i] - m) ** 2 for i in members[key]) / len(members[key]))

        forks = [k for k in list(members) if len(children[k]) >= 2]
        mean_spread = sum(spread(k) for k in forks) / len(forks) if forks else 0.0
        flat = len(set(reward.values())) == 1
        for t in traces:
            for i, node in enumerate(t["nodes"]):
                if not n_sampled(node):
                    continue
                key = key_path(t["nodes"], i)
                above = next((key[:d] for d in range(len(key) - 1, -1, -1) if len(children[key[:d]]) >= 2), None)
                r = reward[t["id"]]
                if flat:
                    a = 0.0
                elif above is None:
                    a = r - mean(())
                else:
                    factor = 1 + beta * spread(above) / mean_spread if mean_spread > 0 else 1.0
                    a = (r - mean(above)) * factor
                out[(t["id"], i)] = [a] * n_sampled(node)
                fork_of[(t["id"], i)] = above
    return out, fork_of


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("beta", [1.0, 0.0, 2.5])
def test_branch_matches_reference(tmp_path: Path, seed: int, beta: float) -> None:
    episodes = make_episodes(1000 + seed)
    with ingest(tmp_path, episodes) as db:
        got = as_dict(branch(db, beta=beta))
        want, fork_of = reference_branch(episodes, beta)
        assert_same(got, want)
        # Above the group's first fork: exactly the GRPO credit.
        grpo = {r["trace_id"]: r["value"] for r in tracedb.credit.compute(db, "grpo").to_pylist()}
        for key, above in fork_of.items():
            if above is None:
                np.testing.assert_allclose(got[key], grpo[key[0]], rtol=1e-6, atol=1e-7)
        invalid = {t["id"] for _, t in all_traces(episodes) if not is_valid(t)}
        assert not {tid for tid, _ in got} & invalid


def test_random_groups_cover_the_cases(tmp_path: Path) -> None:
    """The generator makes forks across traces and inside one trace, nodes above the first
    fork, and sampled nodes shared by a trace's branches."""
    across = within = above_first = 0
    for seed in range(10):
        episodes = make_episodes(1000 + seed)
        _, fork_of = reference_branch(episodes)
        above_first += sum(1 for f in fork_of.values() if f is None)
        for traces in groups_of(episodes).values():
            by_key: dict[tuple, set[str]] = defaultdict(set)
            kids: dict[tuple[str, tuple], set[tuple]] = defaultdict(set)
            for t in traces:
                for i in range(len(t["nodes"])):
                    key = key_path(t["nodes"], i)
                    by_key[key[:-1]].add(t["id"])
                    kids[(t["id"], key[:-1])].add(key)
            within += sum(1 for ks in kids.values() if len(ks) >= 2)
            across += sum(1 for k, ids in by_key.items() if len(ids) >= 2 and k)
    with ingest(tmp_path, make_episodes(1003)) as db:
        shared = shared_sampled_nodes(db)
    assert across >= 20 and within >= 10 and above_first >= 20 and shared >= 3


def _chain_episode(tid: str, chain: tuple[list[int], ...], reward: float, group: str = "g") -> dict[str, Any]:
    trace = copy.deepcopy(TRACE)
    trace.update(id=tid, ok=True, is_timeout=False, rewards={"r": {"score": reward, "weight": 1.0}})
    nodes = []
    for i, tokens in enumerate(chain):
        sampled = i >= 1
        node = {"semantic_parents": [], "message": {"role": "assistant" if sampled else "user", "content": "."}}
        node.update(sampled=sampled, token_ids=tokens, mask=[sampled] * len(tokens), is_content=[], logprobs=[])
        if i:
            node["parent"] = i - 1
        nodes.append(node)
    trace["nodes"] = nodes
    return {**copy.deepcopy(EPISODE), "id": "e" + tid, "group": {"id": group}, "traces": [trace]}


def test_branch_known_values(tmp_path: Path) -> None:
    """a and b share [1, 2, 3] and fork there; c leaves them after [1, 2]."""
    episodes = [
        _chain_episode("a", ([1], [2], [3], [4]), 1.0),
        _chain_episode("b", ([1], [2], [3], [5]), 0.0),
        _chain_episode("c", ([1], [2], [6]), 0.0),
    ]
    beta = 1.5
    with ingest(tmp_path, episodes) as db:
        got = {k: v[0] for k, v in as_dict(branch(db, beta=beta)).items()}
    mean = 1 / 3
    cbv_12 = math.sqrt(((1 - mean) ** 2 + 2 * mean**2) / 3)  # fork [1, 2]: a, b, c
    cbv_123 = 0.5  # fork [1, 2, 3]: a, b
    m = (cbv_12 + cbv_123) / 2
    assert got[("a", 1)] == pytest.approx(1 - mean) and got[("b", 1)] == pytest.approx(-mean)  # above: grpo
    for tid, r in (("a", 1.0), ("b", 0.0), ("c", 0.0)):
        assert got[(tid, 2)] == pytest.approx((r - mean) * (1 + beta * cbv_12 / m), rel=1e-6)
    assert got[("a", 3)] == pytest.approx((1 - 0.5) * (1 + beta * cbv_123 / m), rel=1e-6)
    assert got[("b", 3)] == pytest.approx((0 - 0.5) * (1 + beta * cbv_123 / m), rel=1e-6)
    assert ("a", 0) not in got


def test_no_fork_is_grpo_and_flat_forks_scale_one(tmp_path: Path) -> None:
    """A group that never forks (each trace a different root) is grpo: the virtual root is the
    fork; a group whose only forks hold equal rewards (mean spread 0) gets factor 1."""
    episodes = [
        _chain_episode("x", ([7], [1]), 1.0, "chain"),
        _chain_episode("y", ([7], [1]), 0.0, "chain"),  # same tokens: one path, no fork below the root
        _chain_episode("p", ([9], [1], [2]), 1.0, "flat"),
        _chain_episode("q", ([9], [1], [3]), 1.0, "flat"),
    ]
    with ingest(tmp_path, episodes) as db:
        got = {k: v[0] for k, v in as_dict(branch(db, beta=3.0)).items()}
    assert got[("x", 1)] == pytest.approx(0.5) and got[("y", 1)] == pytest.approx(-0.5)
    assert got[("p", 2)] == 0.0 and got[("q", 2)] == 0.0


def test_equal_rewards_and_single_traces_give_zeros(tmp_path: Path) -> None:
    episodes = make_episodes(1100, rewards=(1.0,), n_groups=4, sizes=(2, 5))
    episodes += make_episodes(1101, sizes=(1, 1), n_groups=3, invalid=0.0)
    with ingest(tmp_path, episodes) as db:
        # The score of one named reward: every trace scores "resolved" 1.0 (the weights differ).
        got = as_dict(branch(db, beta=2.0, reward="resolved"))
        assert got and set(got) == set(reference_branch(episodes, name="resolved")[0])
        assert all(v == 0.0 for values in got.values() for v in values)


def test_include_failed_and_json_group(tmp_path: Path) -> None:
    episodes = make_episodes(1200, invalid=0.5)
    with ingest(tmp_path, episodes) as db:
        got = as_dict(branch(db, include_failed=True))
        assert_same(got, reference_branch(episodes, include_failed=True)[0])
        merged = copy.deepcopy(episodes)
        for e in merged:
            e["group"] = {"id": "all"}  # the fixture's task index is 0 everywhere
        got = as_dict(branch(db, group_by="$.task.data.idx", beta=0.5))
        assert_same(got, reference_branch(merged, beta=0.5)[0])


def test_run_stores_the_set(tmp_path: Path) -> None:
    episodes = make_episodes(1300)
    with ingest(tmp_path, episodes) as db:
        result = tracedb.credit.run(db, "branch", "cbpo", beta=0.25)
        want, _ = reference_branch(episodes, 0.25)
        assert result["rows"] == len(want)
        assert_same(stored(db, "cbpo"), want)
        sets = {r["name"]: r for r in db.credit_sets().to_pylist()}
        assert json.loads(sets["cbpo"]["params"]) == {
            "beta": 0.25,
            "reward": None,
            "group_by": "group_id",
            "include_failed": False,
        }


@pytest.mark.parametrize("beta", [-0.1, math.nan, math.inf, "1", True])
def test_bad_beta_is_refused_naming_it(tmp_path: Path, beta: Any) -> None:
    with ingest(tmp_path, make_episodes(1400, n_groups=1)) as db:
        with pytest.raises(ValueError, match="beta"):
            branch(db, beta=beta)


def test_empty_database() -> None:
    with tracedb.connect(":memory:") as db:
        assert branch(db).num_rows == 0
