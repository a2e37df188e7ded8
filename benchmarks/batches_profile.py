"""Where tracedb's step from the file spends its time (``benchmarks/batches.py``): the stages
of ``db.micro_batches`` timed by wrapping tracedb's functions for the profiled calls (untimed
by the figures)."""

from __future__ import annotations

import gc
import inspect
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import tracedb
from benchmarks.batches_step import touch

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
