"""GRPO and RLOO (``tracedb.credit.run``) against a plain reference, on random groups.

Datasets are written as ``traces.jsonl`` from the real ``groups.traces.jsonl`` fixture:
episodes are copied with new ids, random groups (some episodes have none), some with
several traces, random rewards, random ``task.data.idx``, and some rollouts that must
be left out (``ok: false``, ``is_timeout``, ``rewards: {}`` or absent, no ``resolved``
score). The reference below is loops over those dicts; what it is compared with is
what a trainer reads: ``db.branches(credit=...)``.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tracedb
import tracedb.credit

from support import FIXTURES

TEMPLATES = [json.loads(line) for line in (FIXTURES / "groups.traces.jsonl").read_text().splitlines()]
GROUP_BY = ["group_id", "episode_id", "$.task.data.idx"]
REWARDS = [None, "resolved"]
SEEDS = [11, 23]
_names = itertools.count()

# --------------------------------------------------------------------------- datasets


def _rewards(rng: random.Random) -> dict[str, Any] | None:
    kind = rng.random()
    if kind < 0.08:
        return {}
    if kind < 0.14:
        return None  # key absent
    fmt = {"score": rng.choice([0.0, -0.5, 0.25]), "weight": rng.choice([1.0, 0.5])}
    if kind < 0.22:
        return {"format": fmt}  # scored, but no "resolved"
    return {"resolved": {"score": rng.choice([0.0, 1.0, 0.5, 0.3, 0.7]), "weight": 1.0}, "format": fmt}


def _trace(rng: random.Random, template: dict[str, Any], trace_id: str, broken: bool = True) -> dict[str, Any]:
    trace = copy.deepcopy(template["traces"][0])
    trace["id"] = trace_id
    idx = rng.randrange(5)
    if idx == 4:
        trace["task"]["data"].pop("idx")  # no idx: its own group under $.task.data.idx
    else:
        trace["task"]["data"]["idx"] = idx
    rewards = _rewards(rng) if broken else {"resolved": {"score": rng.choice([0.0, 1.0, 0.5]), "weight": 1.0}}
    if rewards is None:
        trace.pop("rewards", None)
    else:
        trace["rewards"] = rewards
    trace["ok"] = not (broken and rng.random() < 0.12)
    trace["is_timeout"] = broken and rng.random() < 0.08
    return trace


def random_episodes(seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    n_groups = rng.randint(3, 6)
    episodes = []
    for k in range(rng.randint(24, 32)):
        episode = copy.deepcopy(rng.choice(TEMPLATES))
        episode["id"] = f"ep-{seed}-{k}"
        group = rng.randrange(n_groups + 1)
        if group == n_groups:
            episode.pop("group", None)  # no group: each of its traces is its own group
        else:
            episode["group"] = {"id": f"grp-{group}"}
        n_traces = rng.choice([1, 1, 1, 2, 3])
        episode["traces"] = [_trace(rng, rng.choice(TEMPLATES), f"tr-{seed}-{k}-{j}") for j in range(n_traces)]
        episodes.append(episode)
    return episodes


def write_jsonl(path: Path, episodes: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(e) + "\n" for e in episodes))
    return path


def ingest(path: Path) -> tracedb.Database:
    db = tracedb.connect(":memory:")
    report = db.ingest(path)
    assert report.ok, report.rejected
    return db


@pytest.fixture(scope="module", params=SEEDS, ids=[f"seed{s}" for s in SEEDS])
def rollouts(request, tmp_path_factory):
    """(db, episodes) of one random dataset; tests only add uniquely named credit sets."""
    episodes = random_episodes(request.param)
    db = ingest(write_jsonl(tmp_path_factory.mktemp("rollouts") / "traces.jsonl", episodes))
    yield db, episodes
    db.close()


# --------------------------------------------------------------------------- reference


def reward_of(trace: dict[str, Any], name: str | None) -> float | None:
    rewards = trace.get("rewards") or {}
    if name is None:
        if not rewards:
            return None
        return sum(r["score"] * r.get("weight", 1.0) for r in rewards.values())
    return rewards[name]["score"] if name in rewards else None


def is_valid(trace: dict[str, Any], reward: str | None) -> bool:
    return reward_of(trace, reward) is not None and trace.get("ok") is True and not trace.get("is_timeout")


def group_of(episode: dict[str, Any], trace: dict[str, Any], group_by: str) -> Any:
    if group_by == "group_id":
        key = (episode.get("group") or {}).get("id")
    elif group_by == "episode_id":
        key = episode["id"]
    else:
        idx = trace["task"]["data"].get("idx")
        key = None if idx is None else str(idx)
    return ("alone", trace["id"]) if key is None else key


def groups(episodes: list[dict[str, Any]], reward: str | None, group_by: str) -> dict[Any, dict[str, float]]:
    """Valid members and their rewards, per group."""
    out: dict[Any, dict[str, float]] = {}
    for episode in episodes:
        for trace in episode["traces"]:
            if is_valid(trace, reward):
                out.setdefault(group_of(episode, trace, group_by), {})[trace["id"]] = reward_of(trace, reward)
    return out


def reference(
    episodes: list[dict[str, Any]],
    algorithm: str,
    *,
    reward: str | None = None,
    group_by: str = "group_id",
    scale_std: bool = False,
    eps: float = 1e-6,
) -> dict[str, float]:
    """Trace id -> advantage; excluded traces are absent."""
    out = {}
    for members in groups(episodes, reward, group_by).values():
        n = len(members)
        total = sum(members.values())
        mean = total / n
        std = math.sqrt(sum((r - mean) ** 2 for r in members.values()) / (n - 1)) if n > 1 else 0.0
        for tid, r in members.items():
            if algorithm == "grpo":
                out[tid] = (r - mean) / (std + eps) if scale_std else r - mean
            else:
                out[tid] = r - (total - r) / (n - 1) if n > 1 else 0.0
    return out


def all_trace_ids(episodes: list[dict[str, Any]]) -> list[str]:
    return [t["id"] for e in episodes for t in e["traces"]]


# --------------------------------------------------------------------------- reading


def stamp(db: tracedb.Database, algorithm: str, **params: Any) -> str:
    name = f"{algorithm}-{next(_names)}"
    tracedb.credit.run(db, algorithm, name, **params)
    return name


def branch_credit(db: tracedb.Database, name: str) -> dict[str, list[tuple[np.ndarray, np.ndarray | None]]]:
    """Trace id -> per branch (sampled_mask, advantages or None), from db.branches(credit=name)."""
    view = db.branches(credit=name, columns=["sampled_mask", "advantages"])
    out: dict[str, list[Any]] = {}
    for tid, mask, adv in zip(*(view.column(c).to_pylist() for c in ("trace_id", "sampled_mask", "advantages"))):
        out.setdefault(tid, []).append((np.asarray(mask, bool), None if adv is None else np.asarray(adv, np.float32)))
    return out


def per_trace(db: tracedb.Database, name: str) -> dict[str, float | None]:
    """Trace id -> the advantage on its first sampled token (None when unassigned)."""
    out = {}
    for tid, branches in branch_credit(db, name).items():
        mask, adv = branches[0]
        out[tid] = None if adv is None else float(adv[mask][0])
    return out


# =========================================================================== properties

GRPO_PARAMS = [
    {"group_by": g, "reward": r, "scale_std": s, "eps": e}
    for g in GROUP_BY
    for r in REWARDS
    for s, e in ((False, 1e-6), (True, 1e-6 if r is None else 0.5))
]


@pytest.mark.parametrize("params", GRPO_PARAMS, ids=lambda p: "-".join(str(v) for v in p.values()))
def test_grpo_matches_reference(rollouts, params):
    db, episodes = rollouts
    want = reference(episodes, "grpo", **params)
    got = branch_credit(db, stamp(db, "grpo", **params))
    assert sorted(got) == sorted(all_trace_ids(episodes))
    for tid, branches in got.items():
        for mask, adv in branches:
            if tid not in want:
                assert adv is None, tid
            else:
                assert adv is not None, tid
                np.testing.assert_allclose(adv[mask], want[tid], rtol=1e-5, atol=1e-6, err_msg=tid)


@pytest.mark.parametrize("reward", REWARDS)
@pytest.mark.parametrize("group_by", GROUP_BY)
def test_rloo_matches_reference(rollouts, group_by, reward):
    db, episodes = rollouts
    want = reference(episodes, "rloo", reward=reward, group_by=group_by)
    got = branch_credit(db, stamp(db, "rloo", reward=reward, group_by=group_by))
    assert sorted(got) == sorted(all_trace_ids(episodes))
    for tid, branches in got.items():
        for mask, adv in branches:
            if tid not in want:
                assert adv is None, tid
            else:
                assert adv is not None, tid
                np.testing.assert_allclose(adv[mask], want[tid], rtol=1e-5, atol=1e-6, err_msg=tid)


@pytest.mark.parametrize("scale_std", [False, True])
@pytest.mark.parametrize("group_by", GROUP_BY)
def test_grpo_sums_to_zero_per_group(rollouts, group_by, scale_std):
    db, episodes = rollouts
    got = per_trace(db, stamp(db, "grpo", group_by=group_by, scale_std=scale_std))
    members = groups(episodes, None, group_by)
    assert any(len(m) > 2 for m in members.values())
    for key, group in members.items():
        assert all(got[tid] is not None for tid in group), key
        assert sum(got[tid] for tid in group) == pytest.approx(0.0, abs=1e-5), key


@pytest.mark.parametrize("reward", REWARDS)
def test_excluded_rollouts_are_none_in_views(rollouts, reward):
    db, episodes = rollouts
    name = stamp(db, "grpo", reward=reward)
    got = branch_credit(db, name)
    excluded = [t for e in episodes for t in e["traces"] if not is_valid(t, reward)]
    kinds = {
        "failed": [t for t in excluded if not t.get("ok")],
        "timeout": [t for t in excluded if t.get("is_timeout")],
        "unscored": [t for t in excluded if reward_of(t, reward) is None],
    }
    assert all(kinds.values()), {k: len(v) for k, v in kinds.items()}  # the dataset has each kind
    for trace in excluded:
        assert all(adv is None for _, adv in got[trace["id"]]), trace["id"]
        assert all("advantages" not in n for n in db.trace(trace["id"], credit=name)["nodes"]), trace["id"]
    sql = db.sql(
        f"SELECT DISTINCT advantages IS NULL AS unassigned FROM branch_tokens(credit := '{name}') "
        "WHERE trace_id IN (SELECT unnest(?::VARCHAR[]))",
        [[t["id"] for t in excluded]],
    )
    assert sql.to_pylist() == [{"unassigned": True}]


@pytest.mark.parametrize("group_by", GROUP_BY)
def test_rloo_of_a_group_of_one_is_zero(rollouts, group_by):
    db, episodes = rollouts
    got = per_trace(db, stamp(db, "rloo", group_by=group_by))
    alone = [tid for m in groups(episodes, None, group_by).values() if len(m) == 1 for tid in m]
    assert alone
    for tid in alone:
        assert got[tid] == 0.0, tid


@pytest.mark.parametrize("group_by", GROUP_BY)
def test_rloo_is_grpo_times_n_over_n_minus_one(rollouts, group_by):
    db, episodes = rollouts
    grpo = per_trace(db, stamp(db, "grpo", group_by=group_by))
    rloo = per_trace(db, stamp(db, "rloo", group_by=group_by))
    sizes = [len(m) for m in groups(episodes, None, group_by).values()]
    if group_by == "group_id":
        assert max(sizes) > 2
    for members in groups(episodes, None, group_by).values():
        n = len(members)
        for tid in members:
            if n > 1:
                assert rloo[tid] == pytest.approx(grpo[tid] * n / (n - 1), rel=1e-5, abs=1e-6), tid


@pytest.mark.parametrize("algorithm", ["grpo", "rloo"])
def test_every_sampled_token_of_a_valid_trace_carries_its_advantage(rollouts, algorithm):
    db, episodes = rollouts
    name = stamp(db, algorithm, scale_std=True) if algorithm == "grpo" else stamp(db, algorithm)
    computed = {
        r["trace_id"]: r["value"]
        for r in tracedb.credit.compute(
            db, algorithm, **({"scale_std": True} if algorithm == "grpo" else {})
        ).to_pylist()
    }
    valid = {t["id"] for e in episodes for t in e["traces"] if is_valid(t, None)}
    assert set(computed) == valid
    for tid, branches in branch_credit(db, name).items():
        if tid not in valid:
            continue
        for mask, adv in branches:
            assert adv is not None and mask.any(), tid
            assert (adv[mask] == np.float32(computed[tid])).all(), tid  # every sampled token, every branch
            assert (adv[~mask] == 0).all(), tid


@pytest.mark.parametrize("algorithm,params", [("grpo", {}), ("grpo", {"scale_std": True}), ("rloo", {})])
def test_trace_without_a_group_is_its_own_group(rollouts, algorithm, params):
    db, episodes = rollouts
    ungrouped = [t for e in episodes if "group" not in e for t in e["traces"] if is_valid(t, None)]
    assert len({reward_of(t, None) for t in ungrouped}) > 1  # together they would not all get zero
    got = per_trace(db, stamp(db, algorithm, **params))
    for trace in ungrouped:
        assert got[trace["id"]] == 0.0, trace["id"]


# --------------------------------------------------------------------------- equal rewards

EQUAL = [0.0, 1.0, 0.5, 0.7, 0.1]


@pytest.fixture(scope="module")
def equal_groups(tmp_path_factory):
    """One group per reward in EQUAL, three members each, all with that reward."""
    rng = random.Random(5)
    episodes = []
    for g, value in enumerate(EQUAL):
        for k in range(3):
            episode = copy.deepcopy(TEMPLATES[(g * 3 + k) % len(TEMPLATES)])
            episode["id"] = f"eq-{g}-{k}"
            episode["group"] = {"id": f"equal-{value}"}
            trace = _trace(rng, episode, f"eq-{g}-{k}-0", broken=False)
            trace["rewards"] = {"resolved": {"score": value, "weight": 1.0}}
            episode["traces"] = [trace]
            episodes.append(episode)
    db = ingest(write_jsonl(tmp_path_factory.mktemp("equal") / "traces.jsonl", episodes))
    yield db
    db.close()


@pytest.mark.parametrize("value", EQUAL)
@pytest.mark.parametrize(
    "algorithm,params", [("grpo", {}), ("grpo", {"scale_std": True}), ("rloo", {})], ids=["grpo", "grpo-std", "rloo"]
)
def test_equal_rewards_give_zeros_not_none(equal_groups, algorithm, params, value):
    name = stamp(equal_groups, algorithm, **params)
    got = branch_credit(equal_groups, name)
    members = [f"eq-{EQUAL.index(value)}-{k}-0" for k in range(3)]
    for tid in members:
        for mask, adv in got[tid]:
            assert adv is not None, tid
            assert (adv == 0.0).all(), f"{tid}: reward {value} x3 gives {adv[mask][0]!r}, not 0"
