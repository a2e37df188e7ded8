"""Prefix-tree credit and mean-preserving reweighting against plain reference loops.

Random groups of verifiers v1 rollouts are written as ``traces.jsonl`` (non-node fields
copied from a real verifiers 0.4.0 record) and ingested. The rollouts of a group draw
their message tokens from a small pool, so they share exact prefixes, diverge, share
nodes between branches and hold identical sibling segments. The references below work on
the generated dicts only: a dict trie keyed by root-to-node token tuples for ``tree`` and
per-token loops for ``reweight``.
"""

from __future__ import annotations

import copy
import json
import math
import random
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tracedb
import tracedb.credit
from tracedb.errors import NotFound

from support.credit_groups import (
    EPISODE,
    TRACE,
    all_traces,
    forest,
    ingest,
    key_path,
    leaf_paths,
    n_sampled,
    reward_of,
)

# --------------------------------------------------------------------------- data


def _node(rng: random.Random, parent: int | None, tokens: list[int], assign: bool) -> dict[str, Any]:
    n = len(tokens)
    sampled = n > 0 and rng.random() < 0.6
    if not sampled:
        mask = [False] * n
    elif rng.random() < 0.6:
        k = rng.randint(0, n)
        mask = [False] * (n - k) + [True] * k
    else:
        mask = [rng.random() < 0.6 for _ in range(n)]
    k = sum(mask)

    def floats(lo: float, hi: float) -> list[float]:
        return [round(rng.uniform(lo, hi), 4) for _ in range(k)]

    node: dict[str, Any] = {
        "semantic_parents": [],
        "message": {"role": "assistant" if sampled else "user", "content": f"m{len(tokens)}"},
        "sampled": sampled,
        "token_ids": tokens,
        "mask": mask,
        "is_content": [],
        "logprobs": floats(-4.0, 0.0) if rng.random() < 0.8 else [],
    }
    if parent is not None:
        node["parent"] = parent
    if rng.random() < 0.7:
        node["entropies"] = floats(0.0, 3.0)
    if rng.random() < 0.6:
        node["trainer_logprobs"] = floats(-4.0, 0.0)
    if rng.random() < 0.6:
        node["loss_weights"] = {"rl": [round(rng.uniform(0.0, 3.0), 4) for _ in range(n)]}
    if assign and rng.random() < 0.8:
        node["advantages"] = floats(-2.0, 2.0)
    return node


def _rewards(rng: random.Random, value: float | None) -> Any:
    if value is None:
        return None if rng.random() < 0.5 else {}
    if rng.random() < 0.3:  # two scored rewards: the weighted sum
        return {"a": {"score": value, "weight": 0.5}, "b": {"score": value, "weight": 0.5}}
    return {"r": {"score": value, "weight": 1.0}}


def make_episodes(
    seed: int,
    *,
    n_groups: int = 4,
    sizes: tuple[int, int] = (1, 6),
    rewards: tuple[float, ...] = (0.0, 0.5, 1.0, 2.0),
    invalid: float = 0.2,
    assign: bool = True,
) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    episodes = []
    for g in range(n_groups):
        # Few, short segments: shared prefixes, shared siblings, the same segment at
        # several depths, an empty segment now and then.
        pool = [[rng.randint(0, 6) for _ in range(rng.choice([0, 1, 2, 3, 4]))] for _ in range(rng.randint(2, 3))]
        grouped = rng.random() < 0.9
        for t in range(rng.randint(*sizes)):
            trace = copy.deepcopy(TRACE)
            trace["id"] = f"s{seed}-g{g}-t{t}"
            kind = rng.random()
            trace["ok"], trace["is_timeout"] = True, False
            reward: float | None = rng.choice(rewards)
            if kind < invalid / 3:
                trace["ok"] = False
            elif kind < 2 * invalid / 3:
                trace["is_timeout"] = True
            elif kind < invalid:
                reward = None
            trace["rewards"] = _rewards(rng, reward)
            trace["nodes"] = forest(rng, pool, lambda parent, tokens: _node(rng, parent, tokens, assign))
            episode = copy.deepcopy(EPISODE)
            episode["id"] = f"e-{trace['id']}"
            if grouped:
                episode["group"] = {"id": f"s{seed}-group-{g}"}
            else:
                episode.pop("group", None)
            episode["traces"] = [trace]
            episodes.append(episode)
    return episodes


# --------------------------------------------------------------------------- references


def is_valid(trace: dict[str, Any], include_failed: bool = False) -> bool:
    if reward_of(trace) is None:
        return False
    return include_failed or (trace["ok"] and not trace["is_timeout"])


def reference_tree(
    episodes: list[dict[str, Any]], include_failed: bool = False
) -> tuple[dict[tuple[str, int], list[float]], dict[tuple[str, int], tuple]]:
    """(trace id, node) -> compact advantages, and (trace id, node) -> (group, trie key)."""
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for group, trace in all_traces(episodes):
        if is_valid(trace, include_failed):
            groups[group if group is not None else "trace:" + trace["id"]].append(trace)
    out: dict[tuple[str, int], list[float]] = {}
    keys: dict[tuple[str, int], tuple] = {}
    for group, traces in groups.items():
        members: dict[tuple, set[str]] = defaultdict(set)
        reward = {t["id"]: reward_of(t) for t in traces}
        for t in traces:
            for i in range(len(t["nodes"])):
                members[key_path(t["nodes"], i)].add(t["id"])

        def value(key: tuple, members=members, reward=reward) -> float:
            ids = members[key] if key else reward.keys()
            return sum(reward[i] for i in ids) / len(ids)

        v_root = value(())
        for t in traces:
            for i, node in enumerate(t["nodes"]):
                key = key_path(t["nodes"], i)
                v = value(key)
                adv = ((v - v_root) + (v - value(key[:-1]))) / math.sqrt(len(members[key]))
                keys[(t["id"], i)] = (group, key)
                if n_sampled(node):
                    out[(t["id"], i)] = [adv] * n_sampled(node)
    return out, keys


def reference_grpo(episodes: list[dict[str, Any]]) -> dict[str, float]:
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for group, trace in all_traces(episodes):
        if is_valid(trace):
            groups[group if group is not None else "trace:" + trace["id"]].append(trace)
    out = {}
    for traces in groups.values():
        mean = sum(reward_of(t) for t in traces) / len(traces)
        for t in traces:
            out[t["id"]] = reward_of(t) - mean
    return out


def token_weight(node: dict[str, Any], k: int, weights: str, weight_name: str | None) -> float:
    """The raw weight of the node's k-th sampled token."""
    if weights == "loss_weights":
        stream = (node.get("loss_weights") or {}).get(weight_name)
        if stream is None:
            return 1.0
        return [w for w, m in zip(stream, node["mask"]) if m][k]
    stream = node.get(weights)
    if not stream or k >= len(stream):
        return 1.0
    return abs(stream[k]) if weights.endswith("logprobs") else stream[k]


def reference_reweight(
    episodes: list[dict[str, Any]],
    source: dict[tuple[str, int], list[float]],
    weights: str,
    weight_name: str | None = None,
    min_weight: float = 0.5,
    max_weight: float = 2.0,
) -> tuple[dict[tuple[str, int], list[float]], dict[str, tuple[float, int]]]:
    """(trace id, node) -> reweighted advantages, and trace id -> (sum of clipped w, L)."""
    out: dict[tuple[str, int], list[float]] = {}
    sums: dict[str, tuple[float, int]] = {}
    for _, trace in all_traces(episodes):
        tokens = []  # (node, advantage, clipped weight)
        for i, node in enumerate(trace["nodes"]):
            if (trace["id"], i) not in source:
                continue
            out[(trace["id"], i)] = []
            for k, a in enumerate(source[(trace["id"], i)]):
                w = min(max(token_weight(node, k, weights, weight_name), min_weight), max_weight)
                tokens.append((i, a, w))
        if not tokens:
            continue
        total = sum(w for _, _, w in tokens)
        sums[trace["id"]] = (total, len(tokens))
        for i, a, w in tokens:
            out[(trace["id"], i)].append(a * w * len(tokens) / total)
    return out, sums


def default_source(episodes: list[dict[str, Any]]) -> dict[tuple[str, int], list[float]]:
    return {
        (t["id"], i): n["advantages"]
        for _, t in all_traces(episodes)
        for i, n in enumerate(t["nodes"])
        if n.get("advantages") is not None
    }


def grpo_source(episodes: list[dict[str, Any]]) -> dict[tuple[str, int], list[float]]:
    adv = reference_grpo(episodes)
    return {
        (t["id"], i): [adv[t["id"]]] * n_sampled(n)
        for _, t in all_traces(episodes)
        if t["id"] in adv
        for i, n in enumerate(t["nodes"])
        if n_sampled(n)
    }


def as_dict(table) -> dict[tuple[str, int], list[float]]:
    return {(r["trace_id"], r["node_index"]): r["values"] for r in table.to_pylist()}


def assert_same(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for key, values in want.items():
        assert len(got[key]) == len(values), key
        np.testing.assert_allclose(got[key], values, rtol=1e-5, atol=1e-5, err_msg=str(key))


def spread(trace: dict[str, Any], path: list[int], credit: dict[tuple[str, int], list[float]]) -> list[float] | None:
    """Branch.spread of compact per-node credit along a path (None when nothing on it)."""
    if not any((trace["id"], i) in credit for i in path):
        return None
    out = []
    for i in path:
        values = iter(credit.get((trace["id"], i), []))
        out += [next(values, 0.0) if m else 0.0 for m in trace["nodes"][i]["mask"]]
    return out


# --------------------------------------------------------------------------- tree


@pytest.mark.parametrize("seed", range(12))
def test_tree_matches_reference(tmp_path: Path, seed: int) -> None:
    episodes = make_episodes(seed)
    with ingest(tmp_path, episodes) as db:
        got = as_dict(tracedb.credit.compute(db, "tree"))
        want, keys = reference_tree(episodes)
        assert_same(got, want)
        # One value per trie node, whichever trace (or branch) holds it.
        by_key: dict[tuple, set[float]] = defaultdict(set)
        for (tid, i), values in got.items():
            assert len(set(values)) == 1
            by_key[keys[(tid, i)]].add(values[0])
        assert all(len(v) == 1 for v in by_key.values())
        # Excluded traces get nothing.
        invalid = {t["id"] for _, t in all_traces(episodes) if not is_valid(t)}
        assert not {tid for tid, _ in got} & invalid


def test_tree_shares_prefixes_across_traces(tmp_path: Path) -> None:
    """The generator does make traces share trie nodes beyond the system prompt."""
    episodes = make_episodes(3, sizes=(4, 6))
    _, keys = reference_tree(episodes)
    holders: dict[tuple, set[str]] = defaultdict(set)
    for (tid, _), key in keys.items():
        holders[key].add(tid)
    deep = [k for k, ids in holders.items() if len(k[1]) >= 3 and len(ids) > 1]
    assert deep


@pytest.mark.parametrize("seed", range(3))
def test_tree_include_failed_and_json_group(tmp_path: Path, seed: int) -> None:
    episodes = make_episodes(100 + seed, invalid=0.5)
    with ingest(tmp_path, episodes) as db:
        got = as_dict(tracedb.credit.compute(db, "tree", include_failed=True))
        assert_same(got, reference_tree(episodes, include_failed=True)[0])
        # Grouping by a JSON path: the fixture's task index is 0 everywhere, one big group.
        merged = copy.deepcopy(episodes)
        for e in merged:
            e["group"] = {"id": "all"}
        got = as_dict(tracedb.credit.compute(db, "tree", group_by="$.task.data.idx"))
        assert_same(got, reference_tree(merged)[0])


def test_tree_equal_rewards_give_zeros(tmp_path: Path) -> None:
    episodes = make_episodes(7, rewards=(1.0,), n_groups=5, sizes=(2, 6))
    with ingest(tmp_path, episodes) as db:
        got = as_dict(tracedb.credit.compute(db, "tree"))
        assert got
        assert all(v == 0.0 for values in got.values() for v in values)


def test_tree_single_trace_groups_give_zeros(tmp_path: Path) -> None:
    episodes = make_episodes(8, sizes=(1, 1), n_groups=6, invalid=0.0)
    episodes[0].pop("group")  # a trace without a group is its own group
    with ingest(tmp_path, episodes) as db:
        got = as_dict(tracedb.credit.compute(db, "tree"))
        assert set(got) == set(reference_tree(episodes)[0])
        assert all(v == 0.0 for values in got.values() for v in values)


def test_tree_known_values(tmp_path: Path) -> None:
    """Three rollouts: a and b share [sys, u, x], c diverges after u."""

    def node(parent, tokens, sampled=False):
        n = {"semantic_parents": [], "message": {"role": "user", "content": "."}, "sampled": sampled}
        n.update(token_ids=tokens, mask=[sampled] * len(tokens), is_content=[], logprobs=[])
        if parent is not None:
            n["parent"] = parent
        return n

    chains = {"a": ([1], [2], [3], [4]), "b": ([1], [2], [3], [5]), "c": ([1], [2], [6])}
    rewards = {"a": 1.0, "b": 0.0, "c": 0.0}
    episodes = []
    for tid, chain in chains.items():
        trace = copy.deepcopy(TRACE)
        trace.update(id=tid, ok=True, is_timeout=False, rewards={"r": {"score": rewards[tid], "weight": 1.0}})
        trace["nodes"] = [node(None if i == 0 else i - 1, list(tok), sampled=i >= 1) for i, tok in enumerate(chain)]
        episodes.append({**copy.deepcopy(EPISODE), "id": "e" + tid, "group": {"id": "g"}, "traces": [trace]})
    with ingest(tmp_path, episodes) as db:
        got = as_dict(tracedb.credit.compute(db, "tree"))
    root = 1 / 3
    x = 0.5  # V([1,2,3]) over a, b
    assert got[("a", 1)] == got[("b", 1)] == got[("c", 1)] == [0.0]  # everyone passes [1, 2]
    np.testing.assert_allclose(got[("a", 2)], [((x - root) + (x - root)) / math.sqrt(2)], rtol=1e-6)
    assert got[("a", 2)] == got[("b", 2)]
    np.testing.assert_allclose(got[("c", 2)], [((0 - root) + (0 - root)) / 1], rtol=1e-6)
    np.testing.assert_allclose(got[("a", 3)], [(1 - root) + (1 - x)], rtol=1e-6)
    np.testing.assert_allclose(got[("b", 3)], [(0 - root) + (0 - x)], rtol=1e-6)
    assert ("a", 0) not in got  # no sampled tokens, no row


def test_tree_run_spreads_and_records(tmp_path: Path) -> None:
    episodes = make_episodes(21)
    with ingest(tmp_path, episodes) as db:
        result = tracedb.credit.run(db, "tree", "t")
        want, _ = reference_tree(episodes)
        assert result["rows"] == len(want)
        view = db.branches(credit="t", columns=["advantages"]).to_pylist()
        traces = {t["id"]: t for _, t in all_traces(episodes)}
        seen = set()
        for row in view:
            trace = traces[row["trace_id"]]
            path = leaf_paths(trace["nodes"])[row["branch_index"]]
            expected = spread(trace, path, want)
            if expected is None:
                assert row["advantages"] is None
            else:
                np.testing.assert_allclose(row["advantages"], expected, rtol=1e-5, atol=1e-6)
            seen.add(row["trace_id"])
        assert seen == set(traces)
        sets = {r["name"]: r for r in db.credit_sets().to_pylist()}
        assert sets["t"]["algorithm"] == "tree"
        assert json.loads(sets["t"]["params"]) == {"reward": None, "group_by": "group_id", "include_failed": False}
        assert sets["t"]["assigned_nodes"] == len(want)


def test_tree_empty_database() -> None:
    with tracedb.connect(":memory:") as db:
        assert tracedb.credit.compute(db, "tree").num_rows == 0


# --------------------------------------------------------------------------- reweight


WEIGHTS = [("entropies", None), ("logprobs", None), ("trainer_logprobs", None), ("loss_weights", "rl")]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("weights,weight_name", WEIGHTS)
def test_reweight_matches_reference_default_source(tmp_path: Path, seed: int, weights: str, weight_name) -> None:
    episodes = make_episodes(200 + seed)
    with ingest(tmp_path, episodes) as db:
        got = as_dict(tracedb.credit.compute(db, "reweight", weights=weights, weight_name=weight_name))
        want, _ = reference_reweight(episodes, default_source(episodes), weights, weight_name)
        assert_same(got, want)


@pytest.mark.parametrize("seed", range(6))
def test_reweight_conserves_grpo(tmp_path: Path, seed: int) -> None:
    episodes = make_episodes(300 + seed, assign=False)
    with ingest(tmp_path, episodes) as db:
        tracedb.credit.run(db, "grpo", "g")
        lo, hi = 0.7, 1.6
        for weights, weight_name in WEIGHTS:
            name = f"rw-{weights}"
            tracedb.credit.run(
                db, "reweight", name, source="g", weights=weights, weight_name=weight_name, min_weight=lo, max_weight=hi
            )
            source = grpo_source(episodes)
            want, sums = reference_reweight(episodes, source, weights, weight_name, lo, hi)
            got = as_dict(db.sql("SELECT trace_id, node_index, advantages AS values FROM credit_advantages(?)", [name]))
            got = {k: v for k, v in got.items() if v is not None}
            g = {
                k: v
                for k, v in as_dict(
                    db.sql("SELECT trace_id, node_index, advantages AS values FROM credit_advantages('g')")
                ).items()
                if v is not None
            }
            assert set(got) == set(g)  # unassigned stays unassigned
            assert_same(got, want)
            per_trace: dict[str, list[tuple[list[float], list[float]]]] = defaultdict(list)
            for key, values in got.items():
                per_trace[key[0]].append((g[key], values))
            for tid, pairs in per_trace.items():
                a = np.concatenate([np.asarray(p[0], np.float64) for p in pairs])
                a2 = np.concatenate([np.asarray(p[1], np.float64) for p in pairs])
                assert math.isclose(a2.sum(), a.sum(), rel_tol=1e-5, abs_tol=1e-4 * max(1, len(a)))
                if a[0] != 0:
                    w = a2 / a  # the normalized weights
                    total, length = sums[tid]
                    assert length == len(a)
                    assert math.isclose(w.sum(), length, rel_tol=1e-5)
                    assert (w >= lo * length / total - 1e-5).all() and (w <= hi * length / total + 1e-5).all()
                    assert w.max() / w.min() <= hi / lo + 1e-5


def test_reweight_run_spreads_and_records(tmp_path: Path) -> None:
    episodes = make_episodes(41)
    with ingest(tmp_path, episodes) as db:
        tracedb.credit.run(db, "grpo", "g")
        tracedb.credit.run(db, "reweight", "rw", source="g", weights="loss_weights", weight_name="rl", max_weight=3.0)
        want, _ = reference_reweight(episodes, grpo_source(episodes), "loss_weights", "rl", 0.5, 3.0)
        traces = {t["id"]: t for _, t in all_traces(episodes)}
        for row in db.branches(credit="rw", columns=["advantages"]).to_pylist():
            trace = traces[row["trace_id"]]
            expected = spread(trace, leaf_paths(trace["nodes"])[row["branch_index"]], want)
            if expected is None:
                assert row["advantages"] is None
            else:
                np.testing.assert_allclose(row["advantages"], expected, rtol=1e-5, atol=1e-6)
        sets = {r["name"]: r for r in db.credit_sets().to_pylist()}
        assert sets["rw"]["algorithm"] == "reweight"
        assert json.loads(sets["rw"]["params"]) == {
            "source": "g",
            "weights": "loss_weights",
            "weight_name": "rl",
            "min_weight": 0.5,
            "max_weight": 3.0,
        }


def test_reweight_missing_stream_weighs_one(tmp_path: Path) -> None:
    """Without any weight stream every token weighs 1: the credit comes back unchanged."""
    episodes = make_episodes(51)
    for _, t in all_traces(episodes):
        for n in t["nodes"]:
            n.pop("entropies", None)
    with ingest(tmp_path, episodes) as db:
        got = as_dict(tracedb.credit.compute(db, "reweight", weights="entropies"))
        assert_same(got, default_source(episodes))


def test_reweight_keeps_unassigned_and_empty(tmp_path: Path) -> None:
    episodes = make_episodes(61)
    with ingest(tmp_path, episodes) as db:
        got = as_dict(tracedb.credit.compute(db, "reweight"))
        source = default_source(episodes)
        assert set(got) == set(source)
        # A trace without any ingested credit has none after reweighting.
        bare = {t["id"] for _, t in all_traces(episodes) if not any("advantages" in n for n in t["nodes"])}
        assert not {tid for tid, _ in got} & bare


def test_reweight_errors(tmp_path: Path) -> None:
    episodes = make_episodes(71, n_groups=1)
    with ingest(tmp_path, episodes) as db:
        with pytest.raises(ValueError, match="weight stream"):
            tracedb.credit.compute(db, "reweight", weights="advantages")
        with pytest.raises(ValueError, match="weight_name"):
            tracedb.credit.compute(db, "reweight", weights="loss_weights")
        with pytest.raises(ValueError, match="min_weight"):
            tracedb.credit.compute(db, "reweight", min_weight=2.0, max_weight=1.0)
        with pytest.raises(NotFound):
            tracedb.credit.compute(db, "reweight", source="nope")
        # An unknown loss_weights name weighs 1 everywhere.
        got = as_dict(tracedb.credit.compute(db, "reweight", weights="loss_weights", weight_name="absent"))
        assert_same(got, default_source(episodes))
