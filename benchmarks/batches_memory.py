"""The trainer-feed benchmark's memory figure (``benchmarks/batches.py``): the step from the
file in a fresh child process, its peak RSS over the child's baseline per call."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import tracedb
from benchmarks.batches_step import STEP_BYTES_PER_TOKEN, touch, tracedb_from_file
from benchmarks.harness import REPO


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
        "import json, sys; from pathlib import Path; from benchmarks.batches_memory import memory_child; "
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
