"""Reward channels (``tracedb.credit.channels``) against a plain per-token loop: each
sampled token asks every channel whether it selects it (role, tool call, nonzero
loss_weights) and takes that reward's group advantage, on random groups with branches,
shared nodes, both tool-call spellings and traces missing some rewards; grpo equality;
clashes and bad maps refused."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tracedb
import tracedb.credit
from tracedb.credit.channels import channels as channel_credit

from support.credit_groups import (
    all_traces,
    as_dict,
    assert_same,
    ingest,
    make_episodes,
    n_sampled,
    reference_grpo,
    stored,
)


def tool_names(node: dict[str, Any]) -> list[str]:
    calls = node["message"].get("tool_calls") or []
    return [n for c in calls for n in (c.get("name"), (c.get("function") or {}).get("name")) if n is not None]


def selects(node: dict[str, Any], k: int, selector: str) -> bool:
    """Whether ``selector`` picks the node's k-th sampled token."""
    kind, _, name = selector.partition(":")
    if kind == "role":
        return node["message"]["role"] == name
    if kind == "tool":
        return name in tool_names(node)
    stream = (node.get("loss_weights") or {}).get(name)
    return stream is not None and [w for w, m in zip(stream, node["mask"]) if m][k] != 0


def reference_channels(
    episodes: list[dict[str, Any]], channels: dict[str, str], **grpo: Any
) -> tuple[dict[tuple[str, int], list[float]], set[tuple[str, int]]]:
    """(trace id, node) -> compact credit, and the nodes holding a token two channels select."""
    adv = {r: reference_grpo(episodes, None if r == "*" else r, **grpo) for r in set(channels.values())}
    credited = set().union(*adv.values())
    out: dict[tuple[str, int], list[float]] = {}
    clashes: set[tuple[str, int]] = set()
    for _, trace in all_traces(episodes):
        if trace["id"] not in credited:
            continue
        for i, node in enumerate(trace["nodes"]):
            values = []
            for k in range(n_sampled(node)):
                hits = [reward for selector, reward in channels.items() if selects(node, k, selector)]
                if len(hits) > 1:
                    clashes.add((trace["id"], i))
                values.append(adv[hits[0]].get(trace["id"], 0.0) if hits else 0.0)
            if values:
                out[(trace["id"], i)] = values
    return out, clashes


DISJOINT = [
    ({"tool:read_skill": "skill_ok", "tool:bash": "resolved", "loss_weights:think": "judge"}, {}),
    ({"tool:read_skill": "skill_ok", "loss_weights:think": "*"}, {"scale_std": True}),
    ({"loss_weights:rl": "judge"}, {"include_failed": True}),
    ({"role:assistant": "resolved"}, {"scale_std": True, "eps": 0.01}),
]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(("config", "grpo"), DISJOINT)
def test_matches_reference(tmp_path: Path, seed: int, config: dict[str, str], grpo: dict[str, Any]) -> None:
    episodes = make_episodes(4000 + seed)
    want, clashes = reference_channels(episodes, config, **grpo)
    assert not clashes
    with ingest(tmp_path, episodes) as db:
        got = as_dict(channel_credit(db, channels=config, **grpo))
        assert_same(got, want)


def test_the_random_groups_cover_the_cases() -> None:
    """Both tool-call spellings, think streams with zero and nonzero sampled tokens, traces
    valid for the weighted reward but missing skill_ok, and unselected sampled tokens."""
    flat = nested = think_zero = think_on = missing = 0
    for seed in range(6):
        episodes = make_episodes(4000 + seed)
        valid = set(reference_grpo(episodes))
        missing += len(valid - set(reference_grpo(episodes, "skill_ok")))
        for _, t in all_traces(episodes):
            for n in t["nodes"]:
                for c in n["message"].get("tool_calls") or []:
                    flat += "name" in c
                    nested += "function" in c
                if "think" in (n.get("loss_weights") or {}) and n_sampled(n):
                    on = [w for w, m in zip(n["loss_weights"]["think"], n["mask"]) if m]
                    think_zero += on.count(0.0)
                    think_on += len(on) - on.count(0.0)
    assert flat >= 10 and nested >= 5 and think_zero >= 20 and think_on >= 20 and missing >= 3


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("grpo", [{}, {"scale_std": True}, {"include_failed": True, "group_by": "$.task.data.idx"}])
def test_all_assistant_tokens_on_the_weighted_reward_is_grpo(tmp_path: Path, seed: int, grpo: dict) -> None:
    episodes = make_episodes(4100 + seed)
    assert all(n["message"]["role"] == "assistant" for _, t in all_traces(episodes) for n in t["nodes"] if n_sampled(n))
    with ingest(tmp_path, episodes) as db:
        tracedb.credit.run(db, "grpo", "g", **grpo)
        tracedb.credit.run(db, "channels", "c", channels={"role:assistant": "*"}, **grpo)
        g, c = stored(db, "g"), stored(db, "c")
        assert g and c == g  # exactly: the same float32 on every token of every node


def test_a_token_two_channels_select_is_refused_naming_the_node(tmp_path: Path) -> None:
    config = {"loss_weights:think": "resolved", "role:assistant": "judge"}
    episodes = make_episodes(4200, n_groups=6)
    _, clashes = reference_channels(episodes, config)
    assert clashes
    with ingest(tmp_path, episodes) as db:
        with pytest.raises(ValueError, match="selected by both") as info:
            channel_credit(db, channels=config)
    where = re.search(r"trace (\S+), node (\d+):", str(info.value))
    assert where and (where.group(1), int(where.group(2))) in clashes
    assert "'loss_weights:think'" in str(info.value) and "'role:assistant'" in str(info.value)


def test_unselected_tokens_are_zero_and_unscored_traces_unassigned(tmp_path: Path) -> None:
    episodes = make_episodes(4300, invalid=0.4)
    with ingest(tmp_path, episodes) as db:
        got = as_dict(channel_credit(db, channels='{"tool:read_skill": "skill_ok"}'))  # JSON text, as the CLI passes
    want, _ = reference_channels(episodes, {"tool:read_skill": "skill_ok"})
    assert_same(got, want)
    nodes = {t["id"]: t["nodes"] for _, t in all_traces(episodes)}
    unselected = [v for (t, i), v in got.items() if "read_skill" not in tool_names(nodes[t][i])]
    assert unselected and all(x == 0.0 for v in unselected for x in v)
    assert any(np.any(np.asarray(v) != 0) for v in got.values())
    credited = set(reference_grpo(episodes, "skill_ok"))
    assert {t for t, _ in got} <= credited and len({t for t, _ in got}) >= 3


def test_run_records_the_map(tmp_path: Path) -> None:
    config = {"tool:read_skill": "skill_ok", "loss_weights:think": "judge"}
    with ingest(tmp_path, make_episodes(4400)) as db:
        tracedb.credit.run(db, "channels", "sk", channels=config)
        params = json.loads({r["name"]: r for r in db.credit_sets().to_pylist()}["sk"]["params"])
        assert params["channels"] == config and params["scale_std"] is False


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (None, "channels must be a JSON map"),
        ({}, "channels must be a JSON map"),
        ("{not json", "channels must be a JSON map.*not JSON"),
        (["role:assistant"], "channels must be a JSON map"),
        ({"node:3": "*"}, "channels: selector 'node:3' is not KIND:NAME"),
        ({"role:": "*"}, "channels: selector 'role:' is not KIND:NAME"),
        ({"role:robot": "*"}, "channels: selector 'role:robot': no node has role 'robot'"),
        ({"loss_weights:nope": "*"}, "channels: selector 'loss_weights:nope': no node holds"),
        ({"role:assistant": "nope"}, "channels: selector 'role:assistant': no trace has a reward named 'nope'"),
        ({"role:assistant": 1}, "channels: selector 'role:assistant' maps to 1"),
    ],
)
def test_bad_maps_are_refused_naming_the_parameter(tmp_path: Path, value: Any, match: str) -> None:
    with ingest(tmp_path, make_episodes(4500, n_groups=2)) as db:
        with pytest.raises(ValueError, match=match):
            channel_credit(db, channels=value)


def test_a_tool_nobody_called_selects_nothing(tmp_path: Path) -> None:
    episodes = make_episodes(4600)
    with ingest(tmp_path, episodes) as db:
        got = as_dict(channel_credit(db, channels={"tool:never_called": "resolved"}))
    assert got and all(x == 0.0 for v in got.values() for x in v)
    assert set(got) == set(reference_channels(episodes, {"tool:never_called": "resolved"})[0])


def test_empty_database() -> None:
    with tracedb.connect(":memory:") as db:
        assert channel_credit(db, channels={"tool:x": "*"}).num_rows == 0
