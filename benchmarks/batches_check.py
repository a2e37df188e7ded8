"""The trainer-feed benchmark's check (``benchmarks/batches.py``): tracedb's micro-batches
against the reference packer's (``benchmarks/reference_packer.py``), sample by sample, and
every later plan against the first. A difference is a :class:`CorrectnessError`."""

from __future__ import annotations

from typing import Any

import numpy as np

from benchmarks.harness import CorrectnessError
from benchmarks.reference_packer import PeerPlan

COLUMNS = ("input_ids", "position_ids", "loss_mask", "advantages", "inference_logprobs")
"""The token columns every micro-batch holds."""


def _columns(mb: Any) -> dict[str, np.ndarray]:
    names = mb.tokens.schema.names
    missing = [c for c in COLUMNS if c not in names]
    if missing:
        raise CorrectnessError(f"a micro-batch lacks the columns {missing}")
    return {c: mb.tokens.column(c).to_numpy(zero_copy_only=False) for c in COLUMNS}


def verify(plan: Any, peer: PeerPlan, seq_len: int, ranks: int, *, shared: bool = False) -> dict[str, Any]:
    """tracedb's plan against the peer's, sample by sample.

    The same samples (trace, branch) on both sides, each once; each sample's tokens rebuilt
    from its spans in its micro-batch equal the peer's sample (input_ids, advantages,
    inference_logprobs exactly, as float32; position_ids 0..n-1) and its truncation flag; a
    bin's loss mask is, on every token, the peer's loss mask of the sample(s) using that token
    (with ``shared`` prefixes a shared token is in the loss when any sample using it has it
    there). Every bin within ``seq_len`` and its spans covering it; a bin without samples
    (padding) out of the loss; every rank with as many micro-batches, and (without sharing,
    where both sides run first-fit decreasing on the same lengths) as many as the peer's."""
    failures: list[str] = []
    expected = {(s.trace_id, s.branch_index): i for i, s in enumerate(peer.samples)}
    seen: set[tuple[str, int]] = set()
    per_rank = [len(rank) for rank in plan]
    want_per_rank = [len(rank) for rank in peer.ranks]
    if len(per_rank) != ranks:
        failures.append(f"{len(per_rank)} ranks, asked for {ranks}")
    if len(set(per_rank)) > 1:
        failures.append(f"micro-batches per rank differ between ranks: {per_rank}")
    if not shared and per_rank != want_per_rank:
        failures.append(f"micro-batches per rank {per_rank}, the peer's {want_per_rank}")
    bins = padding = physical = logical = loss_tokens = 0
    for r, rank in enumerate(plan):
        for k, mb in enumerate(rank):
            where = f"rank {r} micro-batch {k}"
            cols = _columns(mb)
            size = len(cols["input_ids"])
            rows = mb.samples.to_pylist()
            if not rows:
                padding += 1
                if cols["loss_mask"].any():
                    failures.append(f"{where}: a padding micro-batch with tokens in the loss")
                continue
            bins += 1
            if size > seq_len:
                failures.append(f"{where}: {size} tokens, over seq_len {seq_len}")
            covered = np.zeros(size, np.int32)
            loss = np.zeros(size, np.bool_)
            for row in rows:
                key = (row["trace_id"], row["branch_index"])
                name = f"trace {key[0]} branch {key[1]}"
                if key in seen:
                    failures.append(f"{name}: packed twice")
                    continue
                seen.add(key)
                i = expected.get(key)
                if i is None:
                    failures.append(f"{name}: in tracedb's plan, not in the peer's")
                    continue
                want = peer.samples[i]
                spans = [(s["start"], s["length"]) for s in row["spans"]]
                if any(a < 0 or n < 0 or a + n > size for a, n in spans):
                    failures.append(f"{name}: a span outside its micro-batch ({where}, {size} tokens)")
                    continue
                got_len = sum(n for _, n in spans)
                logical += got_len
                if got_len != len(want):
                    failures.append(f"{name}: {got_len} tokens in its spans, the peer's sample has {len(want)}")
                    continue
                if bool(row["truncated"]) != want.truncated:
                    failures.append(f"{name}: truncated {row['truncated']}, the peer's {want.truncated}")
                at = 0
                for a, n in spans:
                    covered[a : a + n] += 1
                    loss[a : a + n] |= want.loss_mask[at : at + n]
                    at += n
                idx = np.concatenate([np.arange(a, a + n) for a, n in spans]) if spans else np.zeros(0, np.int64)
                rebuilt = {
                    "input_ids": cols["input_ids"][idx],
                    "position_ids": cols["position_ids"][idx],
                    "advantages": cols["advantages"][idx],
                    "inference_logprobs": cols["inference_logprobs"][idx],
                }
                reference = {
                    "input_ids": want.input_ids,
                    "position_ids": np.arange(len(want), dtype=np.int32),
                    "advantages": want.advantages,
                    "inference_logprobs": want.inference_logprobs,
                }
                for column, values in rebuilt.items():
                    ref = reference[column]
                    values = values.astype(ref.dtype, copy=False)
                    floats = ref.dtype.kind == "f"
                    if not np.array_equal(values, ref, equal_nan=floats):
                        differ = values != ref
                        if floats:
                            differ &= ~(np.isnan(values) & np.isnan(ref))
                        bad = int(np.flatnonzero(differ)[0])
                        failures.append(
                            f"{name}: {column} differs at token {bad} (tracedb {values[bad]!r}, peer {ref[bad]!r})"
                        )
            if (covered == 0).any():  # only padding at the end may belong to no sample (it is out of the loss)
                hole = int(np.flatnonzero(covered == 0)[0])
                if covered[hole:].any():
                    failures.append(f"{where}: token {hole} belongs to no sample's span")
            if not shared and (covered > 1).any():
                failures.append(f"{where}: spans overlap without prefix sharing")
            physical += int((covered > 0).sum())
            mismatch = np.flatnonzero(cols["loss_mask"] != loss)
            if len(mismatch):
                t = int(mismatch[0])
                users = [
                    f"{row['trace_id']}/{row['branch_index']}"
                    for row in rows
                    if any(s["start"] <= t < s["start"] + s["length"] for s in row["spans"])
                ]
                failures.append(
                    f"{where}: loss_mask differs on {len(mismatch)} tokens, first at token {t} "
                    f"(tracedb {bool(cols['loss_mask'][t])}, peer {bool(loss[t])}; sample(s) {', '.join(users)})"
                )
            loss_tokens += int(cols["loss_mask"].sum())
    for key in [k for k in expected if k not in seen][:5]:
        failures.append(f"trace {key[0]} branch {key[1]}: in the peer's plan, missing from tracedb's")
    report = getattr(plan, "report", None)
    if report is not None:
        if report.skipped_never_scored != peer.skipped_never_scored:
            failures.append(
                f"report: {report.skipped_never_scored} branches skipped as never scored, the peer skipped "
                f"{peer.skipped_never_scored}"
            )
        if report.samples != len(peer.samples) or report.logical_tokens != sum(len(s) for s in peer.samples):
            failures.append(
                f"report: {report.samples} samples of {report.logical_tokens} tokens, the peer packed "
                f"{len(peer.samples)} of {sum(len(s) for s in peer.samples)}"
            )
    if failures:
        shown = "\n  ".join(failures[:10])
        raise CorrectnessError(f"tracedb's micro-batches differ from the peer's ({len(failures)} problems):\n  {shown}")
    peer_loss = sum(int(s.loss_mask.sum()) for s in peer.samples)
    if loss_tokens != peer_loss:
        raise CorrectnessError(f"tracedb's plan has {loss_tokens} tokens in the loss, the peer's {peer_loss}")
    return {
        "samples": len(seen),
        "micro_batches": bins + padding,
        "padding_micro_batches": padding,
        "micro_batches_per_rank": per_rank[0] if per_rank else 0,
        "logical_tokens": logical,
        "physical_tokens": physical,
        "loss_tokens": loss_tokens,
        "truncated": sum(s.truncated for s in peer.samples),
        "skipped_never_scored": peer.skipped_never_scored,
        "shared_sampled_tokens_trained_once": peer.shared_sampled_tokens,
    }


def same_plan(name: str, got: Any, reference: Any) -> None:
    """``got`` holds the same micro-batches, rank by rank, as ``reference``."""
    if [len(r) for r in got] != [len(r) for r in reference]:
        raise CorrectnessError(f"{name}: micro-batches per rank differ from the verified plan")
    for r, (mine, theirs) in enumerate(zip(got, reference)):
        for k, (a, b) in enumerate(zip(mine, theirs)):
            if not (a.tokens.equals(b.tokens) and a.samples.equals(b.samples)):
                raise CorrectnessError(f"{name}: rank {r} micro-batch {k} differs from the verified plan")
