"""Prefix sharing: a prefix several samples of a bin share is stored once, every sample
still rebuilds exactly from its spans, the spans form a tree whose attention mask is the
samples' causal masks OR-ed, and the loss is the loss without sharing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tracedb
from tracedb.batches import MicroBatch
from tracedb.batches.plan import SAMPLES_SCHEMA

from support import FIXTURES
from support.batches import (
    NAMES,
    all_branches,
    check_plan,
    check_spans,
    episodes_of,
    expect,
    fixture_traces,
    golden,
    golden_values,
    loss_masks,
    rebuild,
    values_of,
)
from support.strategies import EPISODE_TEMPLATE, TRACE_TEMPLATE, all_traces, episodes, write_jsonl


def ids(*names: str) -> list[str]:
    return [t["id"] for name in names for t in fixture_traces(name)]


@pytest.mark.parametrize(
    ("seq_len", "ranks", "multiple", "trainable"),
    [(4096, 1, 1, True), (700, 2, 8, True), (400, 3, 1, None), (120, 2, 4, None), (90, 1, 1, True)],
)
def test_fixtures_rebuild_with_sharing(
    golden_db: tracedb.Database, seq_len: int, ranks: int, multiple: int, trainable: Any
) -> None:
    traces = [t for name in NAMES for t in fixture_traces(name)]
    rows = {k: v for name in NAMES for k, v in golden(name).items()}
    expected = expect(all_branches(traces), seq_len, trainable=trainable)
    plan = golden_db.micro_batches(
        seq_len, ranks=ranks, trainable=trainable, pad_to_multiple_of=multiple, share_prefixes=True
    )
    values = {b.key: golden_values(rows[b.key], expected.length[b.key]) for b in expected.samples}
    loss = loss_masks(expected)
    check_plan(plan, expected, values, loss, seq_len=seq_len, ranks=ranks, pad_to_multiple_of=multiple, share=True)
    for batches in plan:
        for mb in batches:
            check_spans(mb)


def test_groups_store_shared_prefixes_once(golden_db: tracedb.Database) -> None:
    """groups: traces with several branches share their first nodes; with sharing fewer
    tokens are stored than the samples hold, and the space saved packs more per bin."""
    plain = golden_db.micro_batches(4096, trace_ids=ids("groups"))
    shared = golden_db.micro_batches(4096, trace_ids=ids("groups"), share_prefixes=True)
    assert plain.report.physical_tokens == plain.report.logical_tokens
    assert shared.report.logical_tokens == plain.report.logical_tokens
    assert shared.report.physical_tokens < shared.report.logical_tokens
    assert shared.report.micro_batches < plain.report.micro_batches


def spans_across_traces(plan: Any) -> list[set[str]]:
    """Per span serving several traces: those traces."""
    out = []
    for batches in plan:
        for mb in batches:
            users: dict[tuple[int, int], set[str]] = {}
            for row in mb.samples.to_pylist():
                for s in row["spans"]:
                    users.setdefault((s["start"], s["length"]), set()).add(row["trace_id"])
            out += [u for u in users.values() if len(u) > 1]
    return out


def test_equal_prompts_of_different_traces_are_shared(tmp_path: Path) -> None:
    """Three copies of linear_assigned under new ids: their prompts (no sampled token, no
    loss weights) are the same tokens, stored once for the two copies alike in which
    streams they hold; the copy without reference_logprobs shares nothing (its tokens
    are null there, the others' are not)."""
    (episode,) = episodes_of(FIXTURES / "linear_assigned.traces.jsonl")
    copies = []
    for k in range(3):
        ep = json.loads(json.dumps(episode))
        ep["id"] += f"-{k}"
        for t in ep["traces"]:
            t["id"] += f"-{k}"
            if k == 2:
                for node in t["nodes"]:
                    node.pop("reference_logprobs", None)
        copies.append(ep)
    traces = [t for ep in copies for t in ep["traces"]]
    n_prompt = 0
    for node in traces[0]["nodes"]:
        if any(node.get("mask") or []):
            break
        n_prompt += len(node["token_ids"])
    assert n_prompt > 0
    with tracedb.connect(":memory:") as db:
        assert db.ingest(write_jsonl(tmp_path / "copies.traces.jsonl", copies)).ok
        plan = db.micro_batches(4096, share_prefixes=True)
        expected = expect(all_branches(traces), 4096)
        values = {b.key: values_of(b, expected.length[b.key]) for b in expected.samples}
        check_plan(plan, expected, values, loss_masks(expected), seq_len=4096, ranks=1, share=True)
        (mb,) = plan[0]
        check_spans(mb)
    assert spans_across_traces(plan) == [{traces[0]["id"], traces[1]["id"]}]
    assert plan.report.physical_tokens == 3 * 320 - n_prompt


def test_subagent_fork_by_hand(golden_db: tracedb.Database) -> None:
    """subagent_fork: branches 0 and 1 (262 tokens each) share nodes 0-4 (146 tokens)."""
    (tid,) = ids("subagent_fork")
    plan = golden_db.micro_batches(600, trace_ids=[tid], share_prefixes=True)
    ((mb,),) = plan
    assert len(mb) == 262 + 262 - 146 == plan.report.physical_tokens
    assert mb.samples.column("spans").to_pylist() == [
        [{"start": 0, "length": 146}, {"start": 146, "length": 116}],
        [{"start": 0, "length": 146}, {"start": 262, "length": 116}],
    ]
    assert mb.span_parents().tolist() == [-1, 0, 0]
    assert mb.span_ancestors().tolist() == [[True, False, False], [True, True, False], [True, False, True]]
    seg = mb.segment_ids()
    assert seg.tolist() == [0] * 146 + [1] * 116 + [2] * 116
    mask = mb.attention_mask()
    assert mask[300, 0] and mask[300, 145] and mask[300, 262] and mask[300, 300]
    assert not mask[300, 150] and not mask[300, 301] and not mask[200, 300] and not mask[10, 11]
    assert mask.sum() == 146 * 147 // 2 + 2 * (116 * 146 + 116 * 117 // 2)
    rows = golden("subagent_fork")
    for key, (got,) in rebuild(plan).items():
        assert got.columns["input_ids"] == rows[key]["token_ids"]
        assert got.columns["position_ids"] == list(range(262))


def test_a_cut_node_is_not_shared(golden_db: tracedb.Database) -> None:
    """subagent_fork, node 2 at tokens 60-87. Cut at 88, both samples are nodes 0-2, whole
    and shared: one span of 88 tokens serves both. Cut at 87, node 2 is cut, so only
    nodes 0-1 could be shared; that saves too little to put both in one bin."""
    (tid,) = ids("subagent_fork")
    plan = golden_db.micro_batches(88, trace_ids=[tid], share_prefixes=True)
    ((mb,),) = plan
    assert len(mb) == plan.report.physical_tokens == 88 and plan.report.logical_tokens == 176
    assert mb.samples.column("spans").to_pylist() == [[{"start": 0, "length": 88}]] * 2
    assert mb.segment_ids().tolist() == [0] * 88
    assert mb.attention_mask().tolist() == np.tril(np.ones((88, 88), bool)).tolist()
    assert sum(mb.tokens.column("loss_mask").to_pylist()) == sum(fixture_traces("subagent_fork")[0]["nodes"][2]["mask"])
    plan = golden_db.micro_batches(87, trace_ids=[tid], share_prefixes=True)
    assert plan.report.micro_batches == 2 and plan.report.physical_tokens == 174
    for mb in plan[0]:
        assert mb.samples.column("spans").to_pylist() == [[{"start": 0, "length": 87}]]


def test_loss_with_sharing_is_the_loss_without(golden_db: tracedb.Database) -> None:
    """Sample by sample, the tokens in the loss are the same: a shared row is in the loss
    iff one of its samples has that token in the loss without sharing, and no loss token
    is gained or lost."""
    for seq_len in (4096, 300, 100):
        plain = rebuild(golden_db.micro_batches(seq_len, trainable=None))
        plan = golden_db.micro_batches(seq_len, trainable=None, share_prefixes=True)
        total = 0
        for batches in plan:
            for mb in batches:
                loss = mb.tokens.column("loss_mask").to_pylist()
                total += sum(loss)
                want: dict[int, bool] = {}
                for row in mb.samples.to_pylist():
                    key = (row["trace_id"], row["branch_index"])
                    (alone,) = plain[key]
                    rows = [p for s in row["spans"] for p in range(s["start"], s["start"] + s["length"])]
                    assert len(rows) == len(alone.rows)
                    for p, on in zip(rows, alone.columns["loss_mask"]):
                        want[p] = want.get(p, False) or on
                assert [want.get(p, False) for p in range(len(loss))] == loss
        assert total == sum(sum(g.columns["loss_mask"]) for (g,) in plain.values())


def test_sharing_needs_train_once(golden_db: tracedb.Database) -> None:
    with pytest.raises(ValueError, match="train_once"):
        golden_db.micro_batches(100, share_prefixes=True, train_once=False)


def test_padding_micro_batch_masks() -> None:
    """A micro-batch without samples (rank padding): every token is padding, attends to
    itself only, has segment id -1 and no span."""
    tokens = pa.RecordBatch.from_pydict({"input_ids": pa.array([0, 0, 0], pa.int32())})
    mb = MicroBatch(tokens, SAMPLES_SCHEMA.empty_table())
    assert mb.spans() == [] and mb.span_parents().tolist() == []
    assert mb.segment_ids().tolist() == [-1, -1, -1]
    assert np.array_equal(mb.attention_mask(), np.eye(3, dtype=bool))


def test_token_less_nodes_make_no_spans(load: Any) -> None:
    """Nodes without tokens (scored with []) on shared paths: every sample is empty, and
    the spans still form a tree (a run of token-less nodes used to become an empty span
    that collided with other empty spans at the same start)."""
    nodes = [
        {"message": {"role": "system", "content": ""}, "sampled": False, "advantages": []},
        {"parent": 0, "message": {"role": "user", "content": ""}, "sampled": False, "advantages": []},
        {"parent": 1, "message": {"role": "user", "content": ""}, "sampled": False, "advantages": []},
        {"parent": 0, "message": {"role": "user", "content": ""}, "sampled": False, "advantages": []},
    ]
    trace = {**json.loads(json.dumps(TRACE_TEMPLATE)), "id": "t-empty", "nodes": nodes}
    copy = {**json.loads(json.dumps(trace)), "id": "t-empty-copy"}
    eps = [{**json.loads(json.dumps(EPISODE_TEMPLATE)), "id": "ep-empty", "traces": [trace, copy]}]
    db = load(eps)
    plan = db.micro_batches(1, share_prefixes=True)
    expected = expect(all_branches([trace, copy]), 1)
    assert len(expected.samples) == 4
    values = {b.key: values_of(b, 0) for b in expected.samples}
    check_plan(plan, expected, values, loss_masks(expected), seq_len=1, ranks=1, share=True)
    for mb in plan[0]:
        check_spans(mb)


# --------------------------------------------------------------------------- random forests, sharing on


@st.composite
def sharing_episodes(draw: st.DrawFn) -> list[dict[str, Any]]:
    """Random forests made to share: every node scored, the optional streams and loss
    weights either on every node or on none of a trace (so its samples are alike in what
    is null), and a copy of the first trace under another id (equal prompts)."""
    eps = draw(episodes())
    for trace in all_traces(eps):
        streams = draw(st.sets(st.sampled_from(["reference_logprobs", "entropies", "rl"])))
        for node in trace.get("nodes") or []:
            k = sum(node.get("mask") or [])
            node["advantages"] = draw(st.lists(st.sampled_from([0.5, -1.0, 0.0]), min_size=k, max_size=k))
            for name in ("reference_logprobs", "trainer_logprobs", "entropies"):
                node.pop(name, None)
                if name in streams:
                    node[name] = [-0.5] * k
            node.pop("loss_weights", None)
            if "rl" in streams and any(node.get("mask") or []):
                node["loss_weights"] = {"rl": [1.0] * len(node.get("token_ids") or [])}
    copy = json.loads(json.dumps(eps[0]["traces"][0]))
    copy["id"] += "-copy"
    eps[0]["traces"].append(copy)
    return eps


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
@given(eps=sharing_episodes(), seq_len=st.integers(1, 60), ranks=st.integers(1, 3), multiple=st.sampled_from([1, 4]))
def test_random_forests_with_sharing(
    load: Any, eps: list[dict[str, Any]], seq_len: int, ranks: int, multiple: int
) -> None:
    db = load(eps)
    plan = db.micro_batches(seq_len, ranks=ranks, trainable=None, pad_to_multiple_of=multiple, share_prefixes=True)
    expected = expect(all_branches(all_traces(eps)), seq_len, trainable=None)
    values = {b.key: values_of(b, expected.length[b.key]) for b in expected.samples}
    loss = loss_masks(expected)
    check_plan(plan, expected, values, loss, seq_len=seq_len, ranks=ranks, pad_to_multiple_of=multiple, share=True)
    for batches in plan:
        for mb in batches:
            check_spans(mb)
