"""A reference model of the trainer feed (``db.micro_batches``) for ``tests/batches``.

Plain loops over verifiers records (the dicts of a ``traces.jsonl``) and over the golden
``NAME.branches.json`` files; nothing here calls ``tracedb.batches``. The packing rules it
shares with the trainer-feed benchmark's peer come from the one reference packer,
``benchmarks/reference_packer.py`` (first-fit decreasing, :func:`ffd`; the train-once rule).
It states:

- the branches of a trace (leaves in node order, root-to-leaf paths, a compaction attempt
  trainable only when accepted) and their spread (docs: token_ids and sampled_mask
  concatenate along the path, a compact stream lands on the sampled positions, 0.0
  elsewhere; a stream is None when no node of the path holds it);
- which branches become samples (never scored: skipped; all-zero advantages: dropped on
  request; longer than ``seq_len``: cut, dropped or refused);
- which sample's loss holds a token that several samples carry (:func:`loss_masks`: the
  reference packer's train-once rule, in the order trainable samples first);
- what a plan says about each sample, rebuilt from its spans.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.reference_packer import apply_train_once
from benchmarks.reference_packer import ffd as ffd  # the tests' FFD is the peer's

from support import FIXTURES

STREAMS = ("reference_logprobs", "trainer_logprobs", "entropies")
NAMES = sorted(p.name.removesuffix(".traces.jsonl") for p in FIXTURES.glob("*.traces.jsonl"))
Key = tuple[str, int]
"""A branch: (trace id, branch index)."""


def f32(values: Any) -> list[float] | None:
    """Values at float32 precision as plain floats (None stays None)."""
    if values is None:
        return None
    return np.asarray(values, dtype=np.float64).astype(np.float32).tolist()


def episodes_of(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def traces_of(eps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [t for ep in eps for t in ep["traces"]]


def fixture_traces(name: str) -> list[dict[str, Any]]:
    return traces_of(episodes_of(FIXTURES / f"{name}.traces.jsonl"))


def golden(name: str) -> dict[Key, dict[str, Any]]:
    """verifiers' own branch views of a fixture, by (trace id, index)."""
    rows = json.loads((FIXTURES / f"{name}.branches.json").read_text())
    return {(r["trace_id"], r["index"]): r for r in rows}


# --------------------------------------------------------------------------- branches


@dataclass
class Branch:
    """One branch of a trace, spread by the reference rule."""

    trace_id: str
    index: int
    trainable: bool
    path: list[int]
    sizes: list[int]  # tokens per path node
    shares: list[object]  # per path node: what makes two samples' nodes the same
    origin: list[tuple[int, int]]  # per token: (node, its k-th token)
    token_ids: list[int]
    sampled_mask: list[bool]
    logprobs: list[float]
    advantages: list[float] | None
    streams: dict[str, list[float] | None]
    loss_weights: dict[str, list[float]]

    @property
    def key(self) -> Key:
        return (self.trace_id, self.index)

    @property
    def nulls(self) -> tuple[object, ...]:
        """Which optional streams and loss-weight names the branch holds: a shared token
        has one value, valid or null, so only samples alike in this can share one."""
        return (tuple(self.streams[name] is not None for name in STREAMS), tuple(sorted(self.loss_weights)))


def branch_paths(trace: dict[str, Any]) -> list[tuple[int, bool, list[int]]]:
    """(index, trainable, root-to-leaf path) per branch, in leaf order."""
    nodes = trace.get("nodes") or []
    has_child = {n.get("parent") for n in nodes if n.get("parent") is not None}
    accepted = {link["node"] for n in nodes for link in n.get("semantic_parents") or [] if link["type"] == "compaction"}
    out: list[tuple[int, bool, list[int]]] = []
    for leaf in range(len(nodes)):
        if leaf in has_child:
            continue
        path = []
        at: int | None = leaf
        while at is not None:
            path.append(at)
            at = nodes[at].get("parent")
        path.reverse()
        attempt = any(link["type"] == "compaction_attempt" for link in nodes[leaf].get("semantic_parents") or [])
        out.append((len(out), not attempt or leaf in accepted, path))
    return out


def widen(node: dict[str, Any], values: list[float] | None) -> list[float]:
    """A compact stream over the node's tokens: the k-th value on the k-th sampled token."""
    values = values or []
    out, k = [], 0
    for sampled in node.get("mask") or []:
        if sampled:
            out.append(float(values[k]) if k < len(values) else 0.0)
            k += 1
        else:
            out.append(0.0)
    return out


def is_plain(node: dict[str, Any]) -> bool:
    """No sampled token and no loss weights: a prompt whose spread is zeros everywhere."""
    return not any(node.get("mask") or []) and not node.get("loss_weights")


def branches_of(trace: dict[str, Any]) -> list[Branch]:
    nodes = trace.get("nodes") or []
    out = []
    for index, trainable, path in branch_paths(trace):
        on = [nodes[i] for i in path]
        held = {name for n in on for name in n.get("loss_weights") or {}}
        out.append(
            Branch(
                trace_id=trace["id"],
                index=index,
                trainable=trainable,
                path=path,
                sizes=[len(n.get("token_ids") or []) for n in on],
                shares=[
                    ("tokens", tuple(n.get("token_ids") or [])) if is_plain(n) else ("node", trace["id"], i)
                    for i, n in zip(path, on)
                ],
                origin=[(i, k) for i, n in zip(path, on) for k in range(len(n.get("token_ids") or []))],
                token_ids=[t for n in on for t in n.get("token_ids") or []],
                sampled_mask=[bool(m) for n in on for m in n.get("mask") or []],
                logprobs=[v for n in on for v in widen(n, n.get("logprobs"))],
                advantages=None
                if all(n.get("advantages") is None for n in on)
                else [v for n in on for v in widen(n, n.get("advantages"))],
                streams={
                    name: None
                    if all(n.get(name) is None for n in on)
                    else [v for n in on for v in widen(n, n.get(name))]
                    for name in STREAMS
                },
                loss_weights={
                    name: [
                        float(v)
                        for n in on
                        for v in ((n.get("loss_weights") or {}).get(name) or [0.0] * len(n.get("token_ids") or []))
                    ]
                    for name in sorted(held)
                },
            )
        )
    return out


def all_branches(traces: list[dict[str, Any]]) -> list[Branch]:
    return sorted((b for t in traces for b in branches_of(t)), key=lambda b: b.key)


# --------------------------------------------------------------------------- samples


@dataclass
class Expected:
    """The samples a call should pack (view order), their lengths and the report's counts."""

    samples: list[Branch]
    length: dict[Key, int]
    counts: dict[str, int] = field(default_factory=dict)


def expect(
    branches: list[Branch],
    seq_len: int,
    *,
    trainable: bool | None = True,
    branch_index: list[int] | None = None,
    overflow: str = "truncate",
    drop_zero_advantages: bool = False,
) -> Expected:
    """The samples of ``branches`` (all of the selected traces) under the feed's rules."""
    out = Expected([], {}, {"branches": 0, "skipped_never_scored": 0, "dropped_zero_advantages": 0})
    out.counts.update(dropped_overflow=0, truncated=0)
    for b in branches:
        if trainable is not None and b.trainable != trainable:
            continue
        if branch_index is not None and b.index not in branch_index:
            continue
        out.counts["branches"] += 1
        if b.advantages is None:
            out.counts["skipped_never_scored"] += 1
            continue
        if drop_zero_advantages and all(a == 0 for a in b.advantages):
            out.counts["dropped_zero_advantages"] += 1
            continue
        n = len(b.token_ids)
        if n > seq_len and overflow == "drop":
            out.counts["dropped_overflow"] += 1
            continue
        if n > seq_len:
            out.counts["truncated"] += 1
        out.samples.append(b)
        out.length[b.key] = min(n, seq_len)
    return out


def loss_masks(expected: Expected, *, train_once: bool = True) -> dict[Key, list[bool]]:
    """Per sample, which of its kept tokens are in the loss: every sampled token, or (train
    once) a sampled token only in the first trainable sample, then the first sample, that
    carries it (order: trainable first, then trace and branch index), by the reference
    packer's :func:`~benchmarks.reference_packer.apply_train_once` over the path's nodes."""
    trained: dict[str, dict[Any, int]] = {}  # per trace: node index -> leading tokens trained
    out: dict[Key, list[bool]] = {}
    for b in sorted(expected.samples, key=lambda b: (not b.trainable, b.trace_id, b.index)):
        loss = np.array(b.sampled_mask[: expected.length[b.key]], np.bool_)
        if train_once:
            apply_train_once(loss, zip(b.path, b.sizes), trained.setdefault(b.trace_id, {}))
        out[b.key] = loss.tolist()
    return out


def values_of(b: Branch, n: int) -> dict[str, Any]:
    """What a rebuilt sample must hold, from the reference branch, cut to ``n`` tokens."""
    out: dict[str, Any] = {
        "input_ids": b.token_ids[:n],
        "inference_logprobs": f32(b.logprobs[:n]),
        "advantages": f32(None if b.advantages is None else b.advantages[:n]),
    }
    for name in STREAMS:
        values = b.streams[name]
        out[name] = f32(values[:n]) if values and n else None
    out["loss_weights"] = {name: f32(v[:n]) for name, v in b.loss_weights.items() if v and n}
    return out


def golden_values(row: dict[str, Any], n: int) -> dict[str, Any]:
    """The same from a golden branch row (verifiers' own view)."""
    out: dict[str, Any] = {
        "input_ids": row["token_ids"][:n],
        "inference_logprobs": f32(row["logprobs"][:n]),
        "advantages": None if row["advantages"] is None else f32(row["advantages"][:n]),
    }
    for name in STREAMS:
        out[name] = f32(row[name][:n]) if row[name] and n else None
    weights = sorted((row.get("loss_weights") or {}).items())
    out["loss_weights"] = {name: f32(v[:n]) for name, v in weights if v and n}
    return out


# --------------------------------------------------------------------------- plans


@dataclass
class Rebuilt:
    """One packed sample as a plan holds it."""

    rank: int
    batch: int
    spans: list[tuple[int, int]]
    rows: list[int]  # its physical rows in the micro-batch, in order
    truncated: bool
    columns: dict[str, list[Any]]  # every token column over its rows


def rebuild(plan: Any) -> dict[Key, list[Rebuilt]]:
    """Every sample of a plan (a list in case one branch came out twice)."""
    out: dict[Key, list[Rebuilt]] = {}
    for r, batches in enumerate(plan):
        for i, mb in enumerate(batches):
            columns = mb.tokens.to_pydict()
            for row in mb.samples.to_pylist():
                spans = [(s["start"], s["length"]) for s in row["spans"]]
                rows = [p for a, n in spans for p in range(a, a + n)]
                got = Rebuilt(
                    r, i, spans, rows, row["truncated"], {c: [v[p] for p in rows] for c, v in columns.items()}
                )
                out.setdefault((row["trace_id"], row["branch_index"]), []).append(got)
    return out


def _stream(values: list[Any] | None) -> list[Any] | None:
    """A token column over a sample: None when absent, empty or all null; float32 values
    when all valid; else as it is (partly null: never what a sample holds)."""
    if not values or all(v is None for v in values):
        return None
    return values if None in values else f32(values)


def sample_values(got: Rebuilt) -> dict[str, Any]:
    """A rebuilt sample in the form of :func:`values_of`."""
    cols = got.columns
    out: dict[str, Any] = {
        "input_ids": cols["input_ids"],
        "inference_logprobs": f32(cols["inference_logprobs"]),
        "advantages": f32(cols["advantages"]),
    }
    for name in STREAMS:
        out[name] = _stream(cols.get(name))
    weights = {c.removeprefix("loss_weights."): _stream(v) for c, v in cols.items() if c.startswith("loss_weights.")}
    out["loss_weights"] = {name: v for name, v in weights.items() if v is not None}
    return out


def padding_rows(mb: Any) -> list[int]:
    """The rows of a micro-batch no sample's span covers."""
    covered = {
        p for row in mb.samples.to_pylist() for s in row["spans"] for p in range(s["start"], s["start"] + s["length"])
    }
    return [p for p in range(mb.tokens.num_rows) if p not in covered]


def expected_attention(mb: Any) -> np.ndarray:
    """Token q attends token k: OR over the bin's samples of the causal mask over the
    sample's tokens (its spans' rows in order); a padding token attends to itself only."""
    n = mb.tokens.num_rows
    mask = np.zeros((n, n), bool)
    for row in mb.samples.to_pylist():
        rows = np.array([p for s in row["spans"] for p in range(s["start"], s["start"] + s["length"])], np.int64)
        mask[np.ix_(rows, rows)] |= np.tril(np.ones((len(rows), len(rows)), bool))
    for p in padding_rows(mb):
        mask[p, p] = True
    return mask


def shared_physical(samples: list[Branch], length: dict[Key, int]) -> int:
    """Tokens a bin of ``samples`` stores when whole-node prefixes are stored once: each
    distinct chain of path nodes (a node: the same node of a trace, or a plain prompt
    with the same tokens) among samples with the same :attr:`Branch.nulls` counted once,
    and every sample's tokens after its last whole node (the node the cut falls in, and
    on) its own."""
    chains: dict[tuple[object, ...], int] = {}
    own = 0
    for b in samples:
        chain: tuple[object, ...] = (b.nulls,)
        at = 0
        for share, size in zip(b.shares, b.sizes):
            if at + size > length[b.key]:
                break
            chain += (share,)
            chains[chain] = size
            at += size
        own += length[b.key] - at
    return sum(chains.values()) + own


# --------------------------------------------------------------------------- the whole check

BASE_COLUMNS = ("input_ids", "position_ids", "loss_mask", "advantages", "inference_logprobs")


def check_plan(
    plan: Any,
    expected: Expected,
    values: dict[Key, dict[str, Any]],
    loss: dict[Key, list[bool]],
    *,
    seq_len: int,
    ranks: int,
    pad_to_multiple_of: int = 1,
    pad_token_id: int = 0,
    share: bool = False,
) -> None:
    """Assert everything the feed promises about ``plan`` against the reference:
    ``values`` (:func:`values_of` / :func:`golden_values` per sample) and ``loss``
    (:func:`loss_masks`)."""
    got = rebuild(plan)
    want = {b.key: b for b in expected.samples}
    assert sorted(got) == sorted(want), "the packed branches are not the expected ones"
    assert all(len(v) == 1 for v in got.values()), [k for k, v in got.items() if len(v) > 1]

    # Columns: the base ones, a stream iff a packed sample holds it, every weight name held.
    held = {name for b in expected.samples for name in STREAMS if b.streams[name] is not None}
    names = {f"loss_weights.{n}" for b in expected.samples for n in b.loss_weights}
    for batches in plan:
        for mb in batches:
            assert set(mb.tokens.schema.names) == set(BASE_COLUMNS) | held | names, mb.tokens.schema.names

    for key, (sample,) in got.items():
        n = expected.length[key]
        assert len(sample.rows) == n, (key, len(sample.rows), n)
        assert sample_values(sample) == values[key], key
        assert sample.columns["position_ids"] == list(range(n)), key
        assert sample.truncated == (len(want[key].token_ids) > seq_len), key
        if not share:
            assert len(sample.spans) == 1, (key, sample.spans)
            assert sample.columns["loss_mask"] == loss[key], key

    # Per micro-batch: capacity, padding, the loss of shared tokens, ranks.
    assert len(plan) == ranks
    assert len({len(batches) for batches in plan}) == 1, [len(b) for b in plan]
    real_bins = padding_bins = physical = padding = in_loss = 0
    rank_tokens = []
    for r, batches in enumerate(plan):
        rank_tokens.append(0)
        for i, mb in enumerate(batches):
            cols = mb.tokens.to_pydict()
            pad = padding_rows(mb)
            real = mb.tokens.num_rows - len(pad)
            assert real <= seq_len, (r, i, real)
            assert pad == list(range(real, mb.tokens.num_rows)), "padding is not the tail"
            assert mb.tokens.num_rows % pad_to_multiple_of == 0
            assert all(cols["input_ids"][p] == pad_token_id for p in pad)
            assert all(cols["position_ids"][p] == 0 for p in pad)
            assert not any(cols["loss_mask"][p] for p in pad)
            users: dict[int, list[bool]] = {}
            bin_samples = []
            for row in mb.samples.to_pylist():
                key = (row["trace_id"], row["branch_index"])
                bin_samples.append(want[key])
                for j, p in enumerate(got[key][0].rows):
                    users.setdefault(p, []).append(loss[key][j])
            assert all(cols["loss_mask"][p] == any(users[p]) for p in range(real)), (r, i)
            if mb.samples.num_rows == 0:
                padding_bins += 1
                assert real == 0 and not any(cols["loss_mask"])
            else:
                real_bins += 1
                assert mb.tokens.num_rows - real < pad_to_multiple_of
            if share:
                assert real == shared_physical(bin_samples, expected.length), (r, i)
            else:
                assert real == sum(expected.length[b.key] for b in bin_samples)
            physical += real
            padding += len(pad)
            in_loss += sum(cols["loss_mask"])
            rank_tokens[r] += real
    assert in_loss == sum(sum(m) for m in loss.values()), "a loss token is counted twice or lost"

    rep = plan.report
    assert (rep.seq_len, rep.ranks, rep.samples) == (seq_len, ranks, len(expected.samples))
    counts = {k: getattr(rep, k) for k in expected.counts}
    assert counts == expected.counts
    assert rep.micro_batches == real_bins + padding_bins
    assert rep.padding_micro_batches == padding_bins
    assert padding_bins < ranks if real_bins else padding_bins == ranks
    assert rep.logical_tokens == sum(expected.length.values())
    assert rep.physical_tokens == physical
    assert rep.padding_tokens == padding
    if tuple(plan.arguments["cost"]) == (1.0, 0.0):
        assert rep.rank_costs == [float(t) for t in rank_tokens]


def check_spans(mb: Any) -> None:
    """With prefix sharing: spans are disjoint, form a tree, and segment ids and the
    attention mask are the ones their samples' span lists give."""
    lists = [[(s["start"], s["length"]) for s in row["spans"]] for row in mb.samples.to_pylist()]
    spans = sorted({s for spans in lists for s in spans})
    for (a, n), (b, _) in zip(spans, spans[1:]):
        assert a + n <= b, f"spans {spans} overlap"
    parent: dict[tuple[int, int], tuple[int, int] | None] = {}
    for spans_of in lists:
        for before, span in zip([None, *spans_of], spans_of):
            assert parent.setdefault(span, before) == before, f"span {span} has two parents"
    index = {s: k for k, s in enumerate(spans)}
    assert mb.span_parents().tolist() == [-1 if parent[s] is None else index[parent[s]] for s in spans]
    seg = [-1] * mb.tokens.num_rows
    for k, (a, n) in enumerate(spans):
        for p in range(a, a + n):
            seg[p] = k
    assert mb.segment_ids().tolist() == seg
    assert np.array_equal(mb.attention_mask(), expected_attention(mb))
