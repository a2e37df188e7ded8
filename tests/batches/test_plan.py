"""``db.micro_batches`` end to end against the reference of ``support.batches``: every
packed sample rebuilt from its spans is verifiers' branch cut to ``seq_len``, the loss
follows the train-once rule, bins and ranks are laid out as promised, and the same
store gives the same plan."""

from __future__ import annotations

import dataclasses
import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tracedb

from support import FIXTURES
from support.batches import (
    NAMES,
    Branch,
    all_branches,
    check_plan,
    check_spans,
    expect,
    fixture_traces,
    golden,
    golden_values,
    loss_masks,
    rebuild,
    values_of,
)
from support.strategies import all_traces as traces_of
from support.strategies import episodes, write_jsonl

SETTINGS = settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
Loader = Callable[[list[dict[str, Any]]], tracedb.Database]


def reference_matches_golden(name: str, branches: list[Branch]) -> None:
    """The reference spread of the records is verifiers' own view (so the loss masks the
    reference builds from the records are about the same branches)."""
    rows = golden(name)
    assert sorted(rows) == [b.key for b in branches]
    for b in branches:
        row = rows[b.key]
        assert (row["trainable"], row["token_ids"], row["sampled_mask"]) == (b.trainable, b.token_ids, b.sampled_mask)
        assert golden_values(row, len(b.token_ids)) == values_of(b, len(b.token_ids)), b.key


# --------------------------------------------------------------------------- fixtures

CASES = [
    # seq_len, ranks, pad_to_multiple_of, pad_token_id, trainable, train_once, overflow
    (4096, 1, 1, 0, True, True, "truncate"),
    (300, 2, 8, 7, True, True, "truncate"),
    (100, 3, 1, 0, None, True, "truncate"),
    (70, 2, 4, 0, True, True, "truncate"),
    (250, 2, 1, 1, None, False, "drop"),
    (61, 4, 16, 3, None, True, "truncate"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("name", NAMES)
def test_fixture_samples_are_verifiers_branches(golden_db: tracedb.Database, name: str, case: tuple) -> None:
    seq_len, ranks, multiple, pad_id, trainable, train_once, overflow = case
    traces = fixture_traces(name)
    branches = all_branches(traces)
    reference_matches_golden(name, branches)
    plan = golden_db.micro_batches(
        seq_len,
        ranks=ranks,
        trace_ids=[t["id"] for t in traces],
        trainable=trainable,
        train_once=train_once,
        overflow=overflow,
        pad_to_multiple_of=multiple,
        pad_token_id=pad_id,
    )
    expected = expect(branches, seq_len, trainable=trainable, overflow=overflow)
    rows = golden(name)
    values = {b.key: golden_values(rows[b.key], expected.length[b.key]) for b in expected.samples}
    loss = loss_masks(expected, train_once=train_once)
    check_plan(
        plan, expected, values, loss, seq_len=seq_len, ranks=ranks, pad_to_multiple_of=multiple, pad_token_id=pad_id
    )


@pytest.mark.parametrize("seq_len", [512, 90])
def test_all_fixtures_at_once(golden_db: tracedb.Database, seq_len: int) -> None:
    traces = [t for name in NAMES for t in fixture_traces(name)]
    rows = {k: v for name in NAMES for k, v in golden(name).items()}
    expected = expect(all_branches(traces), seq_len, trainable=None)
    plan = golden_db.micro_batches(seq_len, ranks=4, trainable=None, pad_to_multiple_of=8)
    values = {b.key: golden_values(rows[b.key], expected.length[b.key]) for b in expected.samples}
    check_plan(plan, expected, values, loss_masks(expected), seq_len=seq_len, ranks=4, pad_to_multiple_of=8)


# --------------------------------------------------------------------------- train once


def loss_by_node(plan: Any, branches: list[Branch]) -> dict[tuple[str, int, int], int]:
    """How many times each (trace, node, k) is in the loss over a whole plan."""
    by_key = {b.key: b for b in branches}
    out: dict[tuple[str, int, int], int] = {}
    for key, (got,) in rebuild(plan).items():
        for pos, on in enumerate(got.columns["loss_mask"]):
            if on:
                node, k = by_key[key].origin[pos]
                out[(key[0], node, k)] = out.get((key[0], node, k), 0) + 1
    return out


@pytest.mark.parametrize("seq_len", [40, 59, 60, 61, 70, 88, 100, 118, 150, 262, 1000])
@pytest.mark.parametrize("name", ["subagent_fork", "compaction", "partial_credit", "forest", "rejected_compaction"])
def test_train_once_with_truncation(golden_db: tracedb.Database, name: str, seq_len: int) -> None:
    """Shared sampled tokens train once, in the first trainable sample that still carries
    them; the tokens a cut removed from every sample train nowhere."""
    traces = fixture_traces(name)
    branches = all_branches(traces)
    for trainable, overflow in [(True, "truncate"), (None, "truncate"), (None, "drop")]:
        ids = [t["id"] for t in traces]
        plan = golden_db.micro_batches(seq_len, trace_ids=ids, trainable=trainable, overflow=overflow)
        expected = expect(branches, seq_len, trainable=trainable, overflow=overflow)
        loss = loss_masks(expected)
        got = rebuild(plan)
        assert {k: g.columns["loss_mask"] for k, (g,) in got.items()} == loss
        counts = loss_by_node(plan, branches)
        assert set(counts.values()) <= {1}
        carried = {
            (b.trace_id, *b.origin[p])
            for b in expected.samples
            for p in range(expected.length[b.key])
            if b.sampled_mask[p]
        }
        assert set(counts) == carried


def test_train_once_hand_checked(golden_db: tracedb.Database) -> None:
    """subagent_fork: branches 0 and 1 share nodes 0-4 (tokens 0-145); node 2 (tokens
    60-87) is 3 prompt tokens then 25 sampled ones. Cut at 70, both carry node 2's first
    10 tokens (7 sampled): branch 0 trains them, branch 1 none; alone, branch 1 does."""
    (trace,) = fixture_traces("subagent_fork")
    tid = trace["id"]
    plan = golden_db.micro_batches(70, trace_ids=[tid])
    got = {k: g.columns["loss_mask"] for k, (g,) in rebuild(plan).items()}
    mask = trace["nodes"][2]["mask"][:10]
    assert sum(mask) == 7
    assert got[(tid, 0)] == [False] * 60 + mask
    assert got[(tid, 1)] == [False] * 70
    alone = golden_db.micro_batches(70, trace_ids=[tid], branch_index=1)
    assert {k: g.columns["loss_mask"] for k, (g,) in rebuild(alone).items()} == {(tid, 1): [False] * 60 + mask}
    every = golden_db.micro_batches(70, trace_ids=[tid], train_once=False)
    assert {k: g.columns["loss_mask"] for k, (g,) in rebuild(every).items()} == {
        (tid, 0): [False] * 60 + mask,
        (tid, 1): [False] * 60 + mask,
    }


def test_untrainable_branch_trains_only_what_no_trainable_sample_carries(golden_db: tracedb.Database) -> None:
    """rejected_compaction: branch 0 (an unaccepted attempt) and branch 1 share nodes 0-3;
    with trainable=None the shared node 2 trains in branch 1, node 4 in branch 0."""
    (trace,) = fixture_traces("rejected_compaction")
    tid, nodes = trace["id"], trace["nodes"]
    for node in nodes:  # the fixture holds no advantages: give the test some
        node["advantages"] = [0.5] * sum(node.get("mask") or [])
    branches = all_branches([trace])
    paths = [(b.index, b.trainable, b.path) for b in branches]
    assert paths == [(0, False, [0, 1, 2, 3, 4]), (1, True, [0, 1, 2, 3, 5, 6, 7])]
    ep = {**json.loads((FIXTURES / "rejected_compaction.traces.jsonl").read_text()), "traces": [trace]}
    with tracedb.connect(":memory:") as db, tempfile.TemporaryDirectory() as tmp:
        assert db.ingest(write_jsonl(Path(tmp) / "a.traces.jsonl", [ep])).ok
        got = {k: g.columns["loss_mask"] for k, (g,) in rebuild(db.micro_batches(4096, trainable=None)).items()}
    lens = [len(nodes[i]["token_ids"]) for i in range(8)]
    m = [nodes[i]["mask"] for i in range(8)]
    assert got[(tid, 1)] == [False] * sum(lens[:2]) + m[2] + [False] * lens[3] + m[5] + [False] * lens[6] + m[7]
    assert got[(tid, 0)] == [False] * sum(lens[:4]) + m[4]


# --------------------------------------------------------------------------- random forests


@st.composite
def scored_episodes(draw: st.DrawFn) -> list[dict[str, Any]]:
    """Random episodes, and then advantages kept as generated, removed from a random part
    of the nodes (some branches scored, some never), or set on some nodes only."""
    eps = draw(episodes())
    how = draw(st.sampled_from(["as generated", "some removed", "some set"]))
    for trace in traces_of(eps):
        for node in trace.get("nodes") or []:
            if how == "some removed" and draw(st.booleans()):
                node.pop("advantages", None)
            elif how == "some set":
                node.pop("advantages", None)
                if draw(st.integers(0, 2)) == 0:
                    k = sum(node.get("mask") or [])
                    node["advantages"] = draw(st.lists(st.sampled_from([0.0, 0.5, -1.25]), min_size=k, max_size=k))
    return eps


@st.composite
def arguments(draw: st.DrawFn) -> dict[str, Any]:
    share = draw(st.booleans())
    return {
        "seq_len": draw(st.integers(1, 40)),
        "ranks": draw(st.integers(1, 3)),
        "pad_to_multiple_of": draw(st.sampled_from([1, 1, 3, 8])),
        "pad_token_id": draw(st.sampled_from([0, 5])),
        "trainable": draw(st.sampled_from([True, None, False])),
        "train_once": True if share else draw(st.booleans()),
        "overflow": draw(st.sampled_from(["truncate", "drop"])),
        "drop_zero_advantages": draw(st.booleans()),
        "share_prefixes": share,
    }


@SETTINGS
@given(eps=scored_episodes(), args=arguments())
def test_random_forests(load: Loader, eps: list[dict[str, Any]], args: dict[str, Any]) -> None:
    db = load(eps)
    plan = db.micro_batches(**args)
    expected = expect(
        all_branches(traces_of(eps)),
        args["seq_len"],
        trainable=args["trainable"],
        overflow=args["overflow"],
        drop_zero_advantages=args["drop_zero_advantages"],
    )
    values = {b.key: values_of(b, expected.length[b.key]) for b in expected.samples}
    check_plan(
        plan,
        expected,
        values,
        loss_masks(expected, train_once=args["train_once"]),
        seq_len=args["seq_len"],
        ranks=args["ranks"],
        pad_to_multiple_of=args["pad_to_multiple_of"],
        pad_token_id=args["pad_token_id"],
        share=args["share_prefixes"],
    )
    if args["share_prefixes"]:
        for batches in plan:
            for mb in batches:
                check_spans(mb)


# --------------------------------------------------------------------------- determinism


def same_plan(a: Any, b: Any, *, arguments: bool = True) -> None:
    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        assert len(ra) == len(rb)
        for x, y in zip(ra, rb):
            assert x.tokens.equals(y.tokens)
            assert x.samples.equals(y.samples)
    if arguments:  # the same database: the same watermark too
        assert a.report == b.report
    else:
        assert dataclasses.replace(a.report, watermark=0) == dataclasses.replace(b.report, watermark=0)
    assert a.arguments == b.arguments or not arguments


@pytest.mark.parametrize("share", [False, True])
def test_deterministic(golden_db: tracedb.Database, share: bool) -> None:
    kw = {"ranks": 3, "trainable": None, "pad_to_multiple_of": 4, "share_prefixes": share, "cost": (1.0, 0.001)}
    first = golden_db.micro_batches(200, **kw)
    same_plan(first, golden_db.micro_batches(200, **kw))
    with tracedb.connect(":memory:") as other:
        names = ["groups", "subagent_fork", "compaction", "forest"]
        for name in reversed(names):  # another ingest order, too
            assert other.ingest(FIXTURES / f"{name}.traces.jsonl").ok
        ids = [t["id"] for name in names for t in fixture_traces(name)]
        same_plan(golden_db.micro_batches(200, trace_ids=ids, **kw), other.micro_batches(200, **kw), arguments=False)
