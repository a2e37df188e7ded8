"""The trainer-feed benchmark: ``db.micro_batches(seq_len, ranks=...)`` against the pipeline a
trainer runs per step in Python over verifiers objects (prime-rl style), in one run.

The peer reads ``traces.jsonl`` with verifiers (``read_episodes(dir, WireTrace)``), makes one
sample per trainable branch (``Trace.branches``, ``Branch.trainable``) under the train-once rule,
cuts it to ``seq_len``, packs the samples first-fit decreasing into bins of ``seq_len`` tokens,
builds each bin's numpy arrays and splits the bins over the ranks (LPT, equal counts, zero-loss
padding bins). tracedb opens the database file read-only in a fresh connection, calls
``db.micro_batches`` and touches every token column.

Every repeat times the peer (read + pack) and tracedb from the file back to back, alternating
which goes first, each after a ``gc.collect()``; then tracedb on an open database (warm) and the
same call with ``share_prefixes=True``. Figures are medians (and minima). Before any figure
counts, the first plan of each kind is checked sample by sample against the peer's (the same
samples, the same tokens rebuilt from their spans, bins within ``seq_len``, as many micro-batches
per rank); every later plan must equal the first. A difference is a :class:`CorrectnessError`.
"""

from __future__ import annotations

import gc
import inspect
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

import tracedb
from benchmarks.core import (
    CorrectnessError,
    Metric,
    OtherLoad,
    machine,
    pair,
    remove_db,
    timed,
    tracedb_ingest,
)
from benchmarks.workload import TRACES_FILE, WorkloadFiles
from tracedb.runtime import is_attached

RESULTS = Path(__file__).resolve().parent / "results-batches.json"
QUICK = {"traces": 16, "tokens": 3_000, "repeat": 1}
FULL = {"traces": 256, "tokens": 30_000, "repeat": 5}
SEQ_LEN = 32_768
RANKS = 8
TARGET = 20.0
STEP_BYTES_PER_TOKEN = 13  # int32 id + bool loss mask + float32 advantage + float32 logprob
COLUMNS = ("input_ids", "position_ids", "loss_mask", "advantages", "inference_logprobs")
DTYPES = {
    "input_ids": np.int32,
    "position_ids": np.int32,
    "loss_mask": np.bool_,
    "advantages": np.float32,
    "inference_logprobs": np.float32,
}
PAD_TOKEN_ID = 0
REPO = Path(__file__).resolve().parent.parent


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
    objects) has its sampled tokens in the loss once: in the first trainable branch holding
    it. The peer tracks, per trace, the nodes already trained (by identity) and how many of
    their leading tokens were: a branch cut to ``seq_len`` inside a node trains only the part
    it carries, and the next branch holding the node trains the rest. Branches whose
    advantages are None (never scored) are skipped and counted, not trained, not zero-filled.
    ``train_once=False`` (for tests) leaves every sampled token in the loss.
    """
    samples: list[PeerSample] = []
    branches = skipped = shared = 0
    for episode in episodes:
        for trace in episode.traces:
            trained: dict[int, int] = {}  # id(node) -> leading tokens already in the loss
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
                offset = 0
                for node in branch.nodes if train_once else ():
                    if offset >= n:
                        break
                    size = len(node.token_ids)
                    carried = min(size, n - offset)
                    done = trained.get(id(node), 0)
                    if done:
                        cut = loss[offset : offset + min(done, carried)]
                        shared += int(cut.sum())
                        cut[:] = False
                    if carried > done:
                        trained[id(node)] = carried
                    offset += size
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


def peer_ffd(lengths: list[int], capacity: int) -> list[list[int]]:
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


def peer_lpt(costs: list[int], ranks: int) -> list[list[int]]:
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


def peer_pack(episodes: list[Any], seq_len: int, ranks: int, *, train_once: bool = True) -> PeerPlan:
    """The trainer's step from verifiers objects: samples, FFD bins, bin arrays, ranks."""
    t0 = time.perf_counter()
    samples, counts = peer_samples(episodes, seq_len, train_once=train_once)
    t1 = time.perf_counter()
    bins = peer_ffd([len(s) for s in samples], seq_len)
    t2 = time.perf_counter()
    padding = (-len(bins)) % ranks if bins else ranks
    bins += [[] for _ in range(padding)]
    built = [peer_bin(samples, members) for members in bins]
    t3 = time.perf_counter()
    groups = peer_lpt([sum(len(samples[i]) for i in members) for members in bins], ranks)
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


def peer_read(results_dir: Path) -> list[Any]:
    """verifiers' own loader: ``read_episodes(results_dir, WireTrace)``."""
    from verifiers.v1 import WireTrace
    from verifiers.v1.utils.trace_store import read_episodes

    return read_episodes(results_dir, WireTrace)


def peer_read_pack(results_dir: Path, seq_len: int, ranks: int) -> PeerPlan:
    """End to end: read the run's file with verifiers, then pack (the episodes are dropped)."""
    t0 = time.perf_counter()
    episodes = peer_read(results_dir)
    read = time.perf_counter() - t0
    plan = peer_pack(episodes, seq_len, ranks)
    plan.stages = {"read_episodes": read, **plan.stages}
    return plan


# ------------------------------------------------------------------ tracedb


def touch(plan: Any) -> int:
    """Every token column of every micro-batch as numpy (what a trainer hands to torch);
    returns the values touched."""
    values = 0
    for rank in plan:
        for mb in rank:
            for column in mb.tokens.columns:
                values += len(column.to_numpy(zero_copy_only=False))
    return values


def tracedb_from_file(db_path: Path, seq_len: int, ranks: int, **options: Any) -> Any:
    """A fresh read-only connection to the file, the step, every column touched, closed."""
    # Databases share one DuckDB instance per process: the file must not be attached by a
    # handle still open, or the call would not read it from the file.
    if is_attached(str(db_path)):
        raise RuntimeError(f"{db_path} is still open in this process: the step would not be read from the file")
    with tracedb.connect(db_path, read_only=True) as db:
        plan = db.micro_batches(seq_len, ranks=ranks, **options)
        touch(plan)
    return plan


def tracedb_warm(db: Any, seq_len: int, ranks: int, **options: Any) -> Any:
    """The step on an open database, every column touched."""
    plan = db.micro_batches(seq_len, ranks=ranks, **options)
    touch(plan)
    return plan


# ------------------------------------------------------------------ correctness


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


# ------------------------------------------------------------------ memory (child process)


def _status() -> dict[str, int]:
    """VmRSS and VmHWM of this process, bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    except OSError:
        return False
    return True


def _pool_bytes() -> int | None:
    """Idle mappings tracedb's buffer pool holds for the next view (None: no such pool)."""
    try:
        from tracedb.views._buffers import idle_bytes
    except ImportError:
        return None
    return int(idle_bytes())


def memory_child(db_path: Path, warmup_jsonl: Path | None, seq_len: int, ranks: int, calls: int = 3) -> dict[str, Any]:
    """Run in a fresh process. The baseline is its RSS after ``import tracedb`` and a warm-up
    step on a tiny in-memory database (``warmup_jsonl``: compiled kernels loaded, the DuckDB
    instance started, costs a process pays once). Then, for each of ``calls`` steps from the
    file: its peak RSS (VmHWM, reset before the call) and the RSS left after it."""
    gc.collect()
    after_import = _status()["VmRSS"]
    if warmup_jsonl is not None:
        with tracedb.connect(":memory:") as db:
            db.ingest(warmup_jsonl)
            touch(db.micro_batches(seq_len, ranks=ranks))
    gc.collect()
    baseline = _status()["VmRSS"]
    runs = []
    tokens = 0
    for _ in range(calls):
        gc.collect()
        resettable = _reset_peak()
        before = _status()["VmRSS"]
        start = time.perf_counter()
        plan = tracedb_from_file(db_path, seq_len, ranks)
        seconds = time.perf_counter() - start
        peak = _status()["VmHWM"]
        tokens = plan.report.logical_tokens
        del plan
        gc.collect()
        runs.append(
            {
                "rss_before": before,
                "peak_rss": peak,
                "rss_after": _status()["VmRSS"],
                "pool_after": _pool_bytes(),
                "seconds": seconds,
                "peak_resettable": resettable,
            }
        )
    return {"rss_after_import": after_import, "rss_baseline": baseline, "tokens": tokens, "calls": runs}


def measure_memory(db_path: Path, warmup_jsonl: Path | None, seq_len: int, ranks: int) -> dict[str, Any]:
    """:func:`memory_child` in a child process (a fresh interpreter: nothing of this process's
    memory, pools or caches in its figures). Growths are over the child's baseline."""
    code = (
        "import json, sys; from pathlib import Path; from benchmarks.batches import memory_child; "
        "w = sys.argv[2] or None; "
        "print(json.dumps(memory_child(Path(sys.argv[1]), w and Path(w), int(sys.argv[3]), int(sys.argv[4]))))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, "-c", code, str(db_path), str(warmup_jsonl or ""), str(seq_len), str(ranks)],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=600,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the memory child failed ({done.returncode}): {done.stderr[-2000:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    step = out["tokens"] * STEP_BYTES_PER_TOKEN
    base = out["rss_baseline"]
    first, *later = out["calls"]
    out["step_bytes"] = step
    out["fixed_bytes"] = base - out["rss_after_import"]  # the warm-up step's lasting cost
    out["first_call_peak_growth"] = first["peak_rss"] - base
    out["later_calls_peak_growth"] = [c["peak_rss"] - base for c in later]
    out["retained_after_first_call"] = first["rss_after"] - base
    out["first_call_peak_per_step"] = round(out["first_call_peak_growth"] / step, 2) if step else None
    return out


# ------------------------------------------------------------------ profile


_STAGES = [  # (label, parent label or None, module[:class], attribute)
    ("load_nodes (DuckDB reads + decode)", None, "tracedb.batches.run", "load_nodes"),
    ("samples.build", None, "tracedb.batches.run", "build"),
    ("branch spread (branch_table)", "samples.build", "tracedb.batches.samples", "branch_table"),
    ("branch paths (branch_entries)", "samples.build", "tracedb.batches.samples", "branch_entries"),
    ("train-once owners (_owned)", "samples.build", "tracedb.batches.samples", "_owned"),
    ("build_plan", None, "tracedb.batches.run", "build_plan"),
    ("packing (FFD)", "build_plan", "tracedb.batches.packing", "pack"),
    ("balance over ranks", "build_plan", "tracedb.batches.packing", "balance"),
    ("layout (_layout)", "build_plan", "tracedb.batches.plan", "_layout"),
    ("view columns flattened (_ViewColumns.of)", "build_plan", "tracedb.batches.plan:_ViewColumns", "of"),
    ("bin columns gathered (_ViewColumns.bin)", "build_plan", "tracedb.batches.plan:_ViewColumns", "bin"),
    ("samples tables (_samples_table)", "build_plan", "tracedb.batches.plan", "_samples_table"),
]
_OUTER = ["open (connect)", "micro_batches (total)", "touch every column", "close", "total"]


@contextmanager
def _stage_timers(totals: dict[str, float]) -> Iterator[None]:
    """Wrap tracedb's stage functions (benchmark-side, restored after) to sum their times."""
    import importlib

    undo: list[tuple[Any, str, Any]] = []

    def wrap(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed_stage(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[label] = totals.get(label, 0.0) + time.perf_counter() - start

        return timed_stage

    try:
        for label, _, where, attr in _STAGES:
            module, _, cls = where.partition(":")
            owner: Any = importlib.import_module(module)
            if cls:
                owner = getattr(owner, cls, None)
            raw = inspect.getattr_static(owner, attr, None) if owner is not None else None
            if raw is None:
                continue  # the implementation moved on: that stage is not reported
            if isinstance(raw, classmethod):
                replacement: Any = classmethod(wrap(label, raw.__func__))
            elif isinstance(raw, staticmethod):
                replacement = staticmethod(wrap(label, raw.__func__))
            else:
                replacement = wrap(label, raw)
            undo.append((owner, attr, raw))
            setattr(owner, attr, replacement)
        yield
    finally:
        for owner, attr, raw in reversed(undo):
            setattr(owner, attr, raw)


def profile(db_path: Path, seq_len: int, ranks: int, runs: int = 5) -> list[dict[str, Any]]:
    """Where a step from the file spends its time: open, each stage of ``micro_batches`` (with
    what its parent spends outside the stages timed), touching the columns, close. Of ``runs``
    instrumented calls (untimed by the figures), the one with the median total, so that the
    stages add up. Rows: label, depth, seconds."""
    every: list[dict[str, float]] = []
    for _ in range(runs):
        gc.collect()
        totals: dict[str, float] = {}
        start = time.perf_counter()
        with _stage_timers(totals):
            t = time.perf_counter()
            db = tracedb.connect(db_path, read_only=True)
            totals["open (connect)"] = time.perf_counter() - t
            try:
                t = time.perf_counter()
                plan = db.micro_batches(seq_len, ranks=ranks)
                totals["micro_batches (total)"] = time.perf_counter() - t
                t = time.perf_counter()
                touch(plan)
                totals["touch every column"] = time.perf_counter() - t
                del plan
            finally:
                t = time.perf_counter()
                db.close()
                totals["close"] = time.perf_counter() - t
        totals["total"] = time.perf_counter() - start
        every.append(totals)
    med = sorted(every, key=lambda t: t["total"])[len(every) // 2]
    rows: list[dict[str, Any]] = []
    for label in _OUTER:
        if label not in med:
            continue
        rows.append({"stage": label, "depth": 0, "seconds": med[label]})
        if label != "micro_batches (total)":
            continue
        for stage, parent, _, _ in _STAGES:
            if parent is not None or stage not in med:
                continue
            rows.append({"stage": stage, "depth": 1, "seconds": med[stage]})
            children = [c for c, p, _, _ in _STAGES if p == stage and c in med]
            for child in children:
                rows.append({"stage": child, "depth": 2, "seconds": med[child]})
            if children:
                rest = med[stage] - sum(med[c] for c in children)
                rows.append({"stage": f"{stage}: the rest", "depth": 2, "seconds": rest})
        outside = med[label] - sum(med[s] for s, p, _, _ in _STAGES if p is None and s in med)
        rows.append({"stage": "micro_batches: the rest", "depth": 1, "seconds": outside})
    return rows


# ------------------------------------------------------------------ the run


def _warmup_dir(files: WorkloadFiles, rundir: Path, lines: int = 8) -> Path:
    warmup = rundir / "warmup"
    warmup.mkdir(exist_ok=True)
    with files.jsonl.open("rb") as src, (warmup / TRACES_FILE).open("wb") as dst:
        for _, line in zip(range(lines), src):
            dst.write(line)
    return warmup


def run(
    files: WorkloadFiles,
    workdir: Path,
    repeat: int,
    *,
    log: Callable[[str], None],
    seq_len: int = SEQ_LEN,
    ranks: int = RANKS,
) -> dict[str, Any]:
    """Measure the step on both sides; returns the results (see :func:`render`)."""
    started = time.perf_counter()
    other_load = OtherLoad()
    rundir = workdir / "batches"
    rundir.mkdir(parents=True, exist_ok=True)
    db_path = rundir / "tracedb.duckdb"
    remove_db(db_path)

    log("tracedb: ingest (untimed)")
    ingest_start = time.perf_counter()
    report = tracedb_ingest(files.jsonl, db_path)
    ingest_seconds = time.perf_counter() - ingest_start
    if not report.ok:
        raise CorrectnessError(f"tracedb rejected verifiers' records: {report.rejected[:3]}")
    with tracedb.connect(db_path, read_only=True) as db:
        stats = db.stats()

    # Warm-ups, untimed: verifiers builds its pydantic validators on first use, so the peer
    # packs a few lines first; tracedb loads its compiled kernels with one step.
    log("warm-ups (untimed)")
    peer_read_pack(_warmup_dir(files, rundir), seq_len, ranks)
    tracedb_from_file(db_path, seq_len, ranks)

    m = {
        "from_file": Metric("from_file", "step from the file: read+pack vs open+micro_batches", "speedup", TARGET),
        "warm": Metric("warm", "  warm: pack (episodes in memory) vs open db", "speedup", None),
        "shared": Metric("shared", "  share_prefixes=True, open db", "info", None),
    }
    peer_stages: dict[str, list[float]] = {}
    correctness: dict[str, Any] = {"passed": False}
    reference: Any = None
    shared_reference: Any = None
    plans_checked = 0
    peer_samples_seen: tuple[int, int] | None = None

    for r in range(repeat):
        peer_first = r % 2 == 0
        log(f"repeat {r + 1}/{repeat}")
        (tp, peer), (tt, plan) = pair(
            partial(peer_read_pack, files.dir, seq_len, ranks),
            partial(tracedb_from_file, db_path, seq_len, ranks),
            peer_first,
        )
        m["from_file"].add(tp, tt)
        for k, v in peer.stages.items():
            peer_stages.setdefault(k, []).append(v)
        pack_seconds = sum(v for k, v in peer.stages.items() if k != "read_episodes")
        shape = (len(peer.samples), sum(len(s) for s in peer.samples))
        if peer_samples_seen is None:
            peer_samples_seen = shape
        elif shape != peer_samples_seen:
            raise CorrectnessError(f"the peer packed {shape} (samples, tokens), earlier {peer_samples_seen}")
        if reference is None:
            log("verifying tracedb's micro-batches against the peer's, sample by sample")
            correctness["plan"] = verify(plan, peer, seq_len, ranks)
            reference = plan
        else:
            same_plan(f"plan from the file (repeat {r + 1})", plan, reference)
        plans_checked += 1
        del plan

        with tracedb.connect(db_path, read_only=True) as db:
            same_plan("first warm plan", tracedb_warm(db, seq_len, ranks), reference)  # serves it once
            tw, plan = timed(partial(tracedb_warm, db, seq_len, ranks))
            m["warm"].peer.append(pack_seconds)  # the peer's pack stage of this repeat (wall time only)
            m["warm"].add(None, tw)
            same_plan(f"warm plan (repeat {r + 1})", plan, reference)
            plans_checked += 2
            del plan
            ts, plan = timed(partial(tracedb_warm, db, seq_len, ranks, share_prefixes=True))
            m["shared"].add(None, ts)
            if shared_reference is None:
                log("verifying the share_prefixes plan against the peer's samples")
                correctness["shared_plan"] = verify(plan, peer, seq_len, ranks, shared=True)
                shared_reference = plan
                report_shared = plan.report
            else:
                same_plan(f"share_prefixes plan (repeat {r + 1})", plan, shared_reference)
            plans_checked += 1
            del plan
        del peer

    correctness["passed"] = True
    correctness["tracedb_plans_checked"] = plans_checked
    step = reference.report
    log("memory: the step from the file in a child process")
    memory = measure_memory(db_path, rundir / "warmup" / TRACES_FILE, seq_len, ranks)
    log("profiling tracedb's step from the file (instrumented, untimed)")
    stages = profile(db_path, seq_len, ranks)

    m["shared"].notes = {
        "logical_tokens": report_shared.logical_tokens,
        "physical_tokens": report_shared.physical_tokens,
        "physical_over_logical": round(report_shared.physical_tokens / max(1, report_shared.logical_tokens), 4),
        "micro_batches": report_shared.micro_batches,
    }
    tokens = step.logical_tokens
    for key in ("from_file", "warm", "shared"):
        med = statistics.median(m[key].tracedb)
        m[key].notes = {**m[key].notes, "tracedb_M_tokens_per_s": round(tokens / 1e6 / med, 1)}
    m["from_file"].notes["peer_M_tokens_per_s"] = round(tokens / 1e6 / statistics.median(m["from_file"].peer), 2)

    targets = [v.passed for v in m.values() if v.passed is not None]
    del reference, shared_reference
    return {
        "machine": machine(),
        "workload": {**files.manifest, "path": str(files.jsonl)},
        "database": {**stats, "path": str(db_path)},
        "call": {"seq_len": seq_len, "ranks": ranks},
        "step": {**step.to_dict(), "bytes": tokens * STEP_BYTES_PER_TOKEN},
        "shared_step": report_shared.to_dict(),
        "setup_seconds": {"tracedb_ingest": round(ingest_seconds, 2)},
        "repeat": repeat,
        "metrics": {k: v.to_dict() for k, v in m.items()},
        "peer_stages": {k: {"median": statistics.median(v), "samples": v} for k, v in peer_stages.items()},
        "memory": memory,
        "profile": stages,
        "correctness": correctness,
        "all_targets_met": all(targets),
        "other_load": other_load.result(),
        "seconds": round(time.perf_counter() - started, 1),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


# ------------------------------------------------------------------ output


def _side(values: list[float] | None) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.3f}s ({min(values):.3f}s)"


def render(results: dict[str, Any]) -> str:
    """The table, then the step, memory, sharing, correctness, machine and profile lines."""
    rows = [("metric", "peer median (min)", "tracedb median (min)", "ratio", "target", "result")]
    for d in results["metrics"].values():
        ratio = d["ratio"]
        result = "-" if d["passed"] is None else ("PASS" if d["passed"] else "MISS")
        rows.append(
            (
                d["label"],
                _side(d["peer"]["samples"] if d["peer"] else None),
                _side(d["tracedb"]["samples"] if d["tracedb"] else None),
                "-" if ratio is None else f"{ratio:.1f}x",
                d["target"],
                result,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for n, row in enumerate(rows):
        cells = [c.ljust(w) if i in (0, 4, 5) else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
        if n == 0:
            lines.append("-" * len(lines[0]))

    w, db, mach = results["workload"], results["database"], results["machine"]
    step, shared, call = results["step"], results["shared_step"], results["call"]
    mem, c = results["memory"], results["correctness"]
    metrics = results["metrics"]
    mb = 1e6
    peer_stages = ", ".join(f"{k} {v['median']:.2f}s" for k, v in results["peer_stages"].items())
    later = ", ".join(f"{g / mb:.0f} MB" for g in mem["later_calls_peak_growth"])
    plan = c["plan"]
    lines += [
        "",
        f"workload: {w['traces']} traces, {db['branches']} branches, {w['tokens']:,} node tokens, "
        f"{w['bytes'] / mb:.1f} MB traces.jsonl written by verifiers {w['verifiers']}",
        f"step: micro_batches({call['seq_len']}, ranks={call['ranks']}): {step['samples']} samples, "
        f"{step['logical_tokens']:,} tokens ({step['bytes'] / mb:.0f} MB at {STEP_BYTES_PER_TOKEN} B/token), "
        f"{step['micro_batches']} micro-batches ({step['padding_micro_batches']} padding) = "
        f"{step['micro_batches'] // max(1, call['ranks'])} per rank; truncated {step['truncated']}, "
        f"skipped never scored {step['skipped_never_scored']}",
        f"peer stages (median): {peer_stages}",
        f"memory (child process; RSS over its baseline: tracedb imported, one tiny warm-up step, "
        f"+{mem['fixed_bytes'] / mb:.0f} MB over import): first step from the file peaks at "
        f"+{mem['first_call_peak_growth'] / mb:.0f} MB = {mem['first_call_peak_per_step']}x the step's "
        f"{mem['step_bytes'] / mb:.0f} MB; the next steps peak at +{later}; "
        f"{mem['retained_after_first_call'] / mb:.0f} MB held after the first"
        + (
            f" ({mem['calls'][0]['pool_after'] / mb:.0f} MB of it idle in tracedb's buffer pool)"
            if mem["calls"][0].get("pool_after") is not None
            else ""
        ),
        f"prefix sharing: share_prefixes=True stores {shared['physical_tokens']:,} of {shared['logical_tokens']:,} "
        f"tokens (physical/logical {metrics['shared']['notes']['physical_over_logical']:.3f}) in "
        f"{shared['micro_batches']} micro-batches",
        f"correctness: {plan['samples']} samples checked token by token against the peer "
        f"({plan['loss_tokens']:,} loss tokens; {plan['shared_sampled_tokens_trained_once']:,} shared sampled tokens "
        f"trained once), the share_prefixes plan too, {c['tracedb_plans_checked']} tracedb plans equal: "
        + ("PASSED" if c["passed"] else "FAILED"),
        f"machine: {mach['cpu_count']} cpus, {(mach['memory_bytes'] or 0) / 2**30:.0f} GiB, python {mach['python']}, "
        f"duckdb {mach['packages']['duckdb']}; {results['repeat']} repeats, {results['seconds']:.0f}s",
    ]
    cpu = [
        f"{k} {d['peer']['cpu_median'] / d['tracedb']['cpu_median']:.1f}x"
        for k, d in metrics.items()
        if d["peer"] and d["tracedb"] and d["peer"].get("cpu_median") and d["tracedb"].get("cpu_median")
    ]
    if cpu:
        lines.append("cpu-time ratios (process CPU, all threads): " + ", ".join(cpu))
    load = results["other_load"]
    share = load.get("other_cpu_share")
    lines.append(
        f"load average before/after: {load['load_average_before'][0]:.2f}/{load['load_average_after'][0]:.2f}"
        + (f"; other processes used {share:.0%} of the cpus during the run" if share is not None else "")
    )
    if share is not None and share > 0.05:
        lines.append("note: other load above 5% of the machine: figures are noisier than usual")
    lines.append("profile of tracedb's step from the file (instrumented; the median of 5 runs):")
    for row in results["profile"]:
        lines.append(f"  {row['seconds'] * 1e3:7.1f} ms  {'  ' * row['depth']}{row['stage']}")
    return "\n".join(lines)
