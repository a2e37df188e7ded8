"""The reference packer: a trainer's step in plain Python (prime-rl style), the rules of
``db.micro_batches`` written once, apart from tracedb.

Two users: the trainer-feed benchmark times it as the peer (``benchmarks/batches.py``), and
the tests' reference model of the feed (``tests/support/batches.py``) takes its rules from it.

- **The rules** (plain numbers, no verifiers, no tracedb): :func:`apply_train_once` (a token
  shared by several samples of a trace is in the loss once), :func:`ffd` (first-fit
  decreasing bins), :func:`lpt` (bins over ranks, longest first, equal counts).
- **The peer** over the objects verifiers' ``read_episodes`` returns: one sample per trainable
  branch (:func:`peer_samples`: never-scored branches skipped, cut to ``seq_len``, the
  train-once rule), FFD bins of ``seq_len`` tokens, each bin's numpy arrays
  (:func:`peer_bin`), padding bins so that every rank gets as many, LPT over the ranks
  (:func:`peer_pack`); :func:`peer_read_pack` reads the run's file first.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness import peer_read

DTYPES = {
    "input_ids": np.int32,
    "position_ids": np.int32,
    "loss_mask": np.bool_,
    "advantages": np.float32,
    "inference_logprobs": np.float32,
}
"""A bin's arrays and their dtypes."""
PAD_TOKEN_ID = 0


# ------------------------------------------------------------------ the rules


def apply_train_once(loss: np.ndarray, nodes: Iterable[tuple[Hashable, int]], trained: dict[Hashable, int]) -> int:
    """The train-once rule on one sample: take out of ``loss`` (the sample's loss mask, its
    branch cut to ``len(loss)`` tokens) the tokens an earlier sample of the same trace trained,
    and record the ones this sample trains. ``nodes``: the branch's path, ``(node, tokens)``
    per node from the root; ``trained``: per node of the trace, how many of its leading tokens
    an earlier sample carried (a sample cut inside a node trains the part it carries, and the
    next sample holding the node trains the rest). Samples go through in the order that
    decides who trains a shared token. Returns the sampled tokens taken out."""
    n = len(loss)
    shared = offset = 0
    for node, size in nodes:
        if offset >= n:
            break
        carried = min(size, n - offset)
        done = trained.get(node, 0)
        if done:
            cut = loss[offset : offset + min(done, carried)]
            shared += int(cut.sum())
            cut[:] = False
        if carried > done:
            trained[node] = carried
        offset += size
    return shared


def ffd(lengths: list[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing: the longest sample first (ties in sample order), each into the
    first bin with room."""
    bins: list[list[int]] = []
    used: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        size = lengths[i]
        b = next((b for b, tokens in enumerate(used) if tokens + size <= capacity), None)
        if b is None:
            b = len(bins)
            bins.append([])
            used.append(0)
        bins[b].append(i)
        used[b] += size
    return bins


def lpt(costs: list[int], ranks: int) -> list[list[int]]:
    """Bins over ranks, longest processing time first with equal counts: the costliest bin
    first, each to the least loaded rank that still has room (``len / ranks`` bins each)."""
    room = len(costs) // ranks
    groups: list[list[int]] = [[] for _ in range(ranks)]
    loads = [0] * ranks
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        r = min((r for r in range(ranks) if len(groups[r]) < room), key=lambda r: loads[r])
        groups[r].append(i)
        loads[r] += costs[i]
    return groups


# ------------------------------------------------------------------ the peer


@dataclass
class PeerSample:
    """One trainable branch as a training sample, cut to ``seq_len``."""

    trace_id: str
    branch_index: int
    input_ids: np.ndarray  # int32
    loss_mask: np.ndarray  # bool: sampled and not trained in an earlier branch
    advantages: np.ndarray  # float32
    inference_logprobs: np.ndarray  # float32
    truncated: bool

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass
class PeerBin:
    """One micro-batch: its arrays, and its samples as (sample index, start, length)."""

    arrays: dict[str, np.ndarray]
    samples: list[tuple[int, int, int]]


@dataclass
class PeerPlan:
    """The peer's step: its samples, and per rank its micro-batches."""

    samples: list[PeerSample]
    ranks: list[list[PeerBin]]
    branches: int  # trainable branches seen
    skipped_never_scored: int  # of those, advantages None: not packed
    padding_bins: int
    shared_sampled_tokens: int  # sampled tokens left out of the loss by the train-once rule
    stages: dict[str, float] = field(default_factory=dict)  # seconds per stage


def peer_samples(
    episodes: list[Any], seq_len: int, *, train_once: bool = True
) -> tuple[list[PeerSample], dict[str, int]]:
    """One sample per trainable branch, in file order, with the train-once rule.

    A node shared by several branches of a trace (verifiers hands every branch the same node
    objects, so a node is known by identity) has its sampled tokens in the loss once: in the
    first trainable branch holding it (:func:`apply_train_once`). Branches whose
    advantages are None (never scored) are skipped and counted, not trained, not zero-filled.
    ``train_once=False`` (for tests) leaves every sampled token in the loss.
    """
    samples: list[PeerSample] = []
    branches = skipped = shared = 0
    for episode in episodes:
        for trace in episode.traces:
            trained: dict[Hashable, int] = {}  # id(node) -> leading tokens already in the loss
            for branch in trace.branches:
                if not branch.trainable:
                    continue
                branches += 1
                advantages = branch.advantages
                if advantages is None:
                    skipped += 1
                    continue
                ids = branch.token_ids
                full = len(ids)
                n = min(full, seq_len)
                loss = np.array(branch.sampled_mask[:n], np.bool_)
                if train_once:
                    shared += apply_train_once(
                        loss, ((id(node), len(node.token_ids)) for node in branch.nodes), trained
                    )
                samples.append(
                    PeerSample(
                        trace_id=trace.id,
                        branch_index=branch.index,
                        input_ids=np.array(ids if n == full else ids[:n], np.int32),
                        loss_mask=loss,
                        advantages=np.array(advantages[:n], np.float32),
                        inference_logprobs=np.array(branch.logprobs[:n], np.float32),
                        truncated=full > n,
                    )
                )
    return samples, {"branches": branches, "skipped_never_scored": skipped, "shared_sampled_tokens": shared}


def peer_bin(samples: list[PeerSample], members: list[int]) -> PeerBin:
    """A bin's arrays: its samples one after the other, positions restarting at each."""
    if not members:  # a padding bin: one pad token, out of the loss
        arrays = {name: np.zeros(1, dtype) for name, dtype in DTYPES.items()}
        arrays["input_ids"][:] = PAD_TOKEN_ID
        return PeerBin(arrays, [])
    parts = [samples[i] for i in members]
    placed = []
    start = 0
    for i, s in zip(members, parts):
        placed.append((i, start, len(s)))
        start += len(s)
    arrays = {
        "input_ids": np.concatenate([s.input_ids for s in parts]),
        "position_ids": np.concatenate([np.arange(len(s), dtype=np.int32) for s in parts]),
        "loss_mask": np.concatenate([s.loss_mask for s in parts]),
        "advantages": np.concatenate([s.advantages for s in parts]),
        "inference_logprobs": np.concatenate([s.inference_logprobs for s in parts]),
    }
    return PeerBin(arrays, placed)


def peer_pack(episodes: list[Any], seq_len: int, ranks: int, *, train_once: bool = True) -> PeerPlan:
    """The trainer's step from verifiers objects: samples, FFD bins, bin arrays, ranks."""
    t0 = time.perf_counter()
    samples, counts = peer_samples(episodes, seq_len, train_once=train_once)
    t1 = time.perf_counter()
    bins = ffd([len(s) for s in samples], seq_len)
    t2 = time.perf_counter()
    padding = (-len(bins)) % ranks if bins else ranks
    bins += [[] for _ in range(padding)]
    built = [peer_bin(samples, members) for members in bins]
    t3 = time.perf_counter()
    groups = lpt([sum(len(samples[i]) for i in members) for members in bins], ranks)
    plan = PeerPlan(
        samples=samples,
        ranks=[[built[b] for b in group] for group in groups],
        branches=counts["branches"],
        skipped_never_scored=counts["skipped_never_scored"],
        padding_bins=padding,
        shared_sampled_tokens=counts["shared_sampled_tokens"],
    )
    t4 = time.perf_counter()
    plan.stages = {"samples": t1 - t0, "packing": t2 - t1, "bin_arrays": t3 - t2, "ranks": t4 - t3}
    return plan


def peer_read_pack(results_dir: Path, seq_len: int, ranks: int) -> PeerPlan:
    """End to end: read the run's file with verifiers, then pack (the episodes are dropped)."""
    t0 = time.perf_counter()
    episodes = peer_read(results_dir)
    read = time.perf_counter() - t0
    plan = peer_pack(episodes, seq_len, ranks)
    plan.stages = {"read_episodes": read, **plan.stages}
    return plan
