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

The parts: the peer is the reference packer (``benchmarks/reference_packer.py``), tracedb's
side ``benchmarks/batches_step.py``, the check ``benchmarks/batches_check.py``, the memory
figure ``benchmarks/batches_memory.py`` (a child process), the profile
``benchmarks/batches_profile.py``; this module runs them and renders the table.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import tracedb
from benchmarks import tables
from benchmarks.batches_check import same_plan, verify
from benchmarks.batches_memory import measure_memory
from benchmarks.batches_profile import profile
from benchmarks.batches_step import STEP_BYTES_PER_TOKEN, tracedb_from_file, tracedb_warm
from benchmarks.harness import (
    CorrectnessError,
    Metric,
    Run,
    ingest_checked,
    pair,
    remove_db,
    repeats,
    timed,
    warmup_dir,
)
from benchmarks.reference_packer import peer_read_pack
from benchmarks.workload import TRACES_FILE, WorkloadFiles

RESULTS = Path(__file__).resolve().parent / "results-batches.json"
QUICK = {"traces": 16, "tokens": 3_000, "repeat": 1}
FULL = {"traces": 256, "tokens": 30_000, "repeat": 5}
SEQ_LEN = 32_768
RANKS = 8
TARGET = 20.0


# ------------------------------------------------------------------ the run


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
    frame = Run()
    rundir = workdir / "batches"
    rundir.mkdir(parents=True, exist_ok=True)
    db_path = rundir / "tracedb.duckdb"
    remove_db(db_path)

    log("tracedb: ingest (untimed)")
    _, ingest_seconds = ingest_checked(files.jsonl, db_path)
    with tracedb.connect(db_path, read_only=True) as db:
        stats = db.stats()

    # Warm-ups, untimed: verifiers builds its pydantic validators on first use, so the peer
    # packs a few lines first; tracedb loads its compiled kernels with one step.
    log("warm-ups (untimed)")
    peer_read_pack(warmup_dir(files, rundir), seq_len, ranks)
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

    for r, peer_first in repeats(repeat, log):
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

    del reference, shared_reference
    return frame.results(
        workload={**files.manifest, "path": str(files.jsonl)},
        database={**stats, "path": str(db_path)},
        call={"seq_len": seq_len, "ranks": ranks},
        step={**step.to_dict(), "bytes": tokens * STEP_BYTES_PER_TOKEN},
        shared_step=report_shared.to_dict(),
        setup_seconds={"tracedb_ingest": round(ingest_seconds, 2)},
        repeat=repeat,
        metrics=m,
        peer_stages={k: {"median": statistics.median(v), "samples": v} for k, v in peer_stages.items()},
        memory=memory,
        profile=stages,
        correctness=correctness,
    )


# ------------------------------------------------------------------ output


def render(results: dict[str, Any]) -> str:
    """The table, then the step, memory, sharing, correctness, machine and profile lines."""
    header = ("metric", "peer median (min)", "tracedb median (min)", "ratio", "target", "result")
    lines = tables.metric_table(results["metrics"], header)

    w, db = results["workload"], results["database"]
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
        tables.machine_line(results),
    ]
    lines += tables.cpu_ratio_lines(metrics)
    lines += tables.load_lines(results["other_load"])
    lines.append("profile of tracedb's step from the file (instrumented; the median of 5 runs):")
    for row in results["profile"]:
        lines.append(f"  {row['seconds'] * 1e3:7.1f} ms  {'  ' * row['depth']}{row['stage']}")
    return "\n".join(lines)
