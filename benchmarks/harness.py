"""What every suite measures with: timed calls, the table's rows, the run's frame.

- **Timing**: :func:`timed` (wall and process CPU of one call, after a ``gc.collect()``),
  :func:`pair` (the peer and tracedb back to back, in the order given) and :func:`repeats`
  (the repeats, alternating which side goes first); a :class:`Metric` is one row of a table.
- **The run's frame**: :class:`Run` (the clock, :class:`OtherLoad`: the CPU other processes
  took meanwhile) gives the keys every suite's results share (:func:`machine` first; the
  targets, the load, the seconds and the time last); :func:`write_results` writes them.
- **Both sides' common steps**: verifiers' loader (:func:`peer_read`), tracedb's ingest into a
  fresh file (:func:`tracedb_ingest`, :func:`ingest_checked`), a fresh read-only connection
  that must read the file (:func:`from_file`), the peer's warm-up lines (:func:`warmup_dir`).

A difference between tracedb's answer and the peer's is a :class:`CorrectnessError` (exit 2):
the figures would mean nothing.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import resource
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import tracedb
from benchmarks.workload import TRACES_FILE, WorkloadFiles
from tracedb.runtime import is_attached

PACKAGES = ["tracedb", "verifiers", "duckdb", "pyarrow", "numpy", "pydantic", "pysimdjson", "polars"]
"""The package versions :func:`machine` records."""
REPO = Path(__file__).resolve().parent.parent


class CorrectnessError(Exception):
    """tracedb's answer differs from verifiers': the figures mean nothing."""


# ------------------------------------------------------------------ timing


@dataclass
class Sample:
    """One timed call: wall seconds, and CPU seconds of the whole process (all threads)."""

    wall: float
    cpu: float


def timed(fn: Callable[[], Any]) -> tuple[Sample, Any]:
    """``fn()`` after a ``gc.collect()``: its wall and process CPU seconds, and its answer."""
    gc.collect()
    cpu = time.process_time()
    start = time.perf_counter()
    out = fn()
    wall = time.perf_counter() - start
    return Sample(wall, time.process_time() - cpu), out


def pair(
    peer: Callable[[], Any], ours: Callable[[], Any], peer_first: bool
) -> tuple[tuple[Sample, Any], tuple[Sample, Any]]:
    """Time both sides back to back, in the given order."""
    if peer_first:
        p = timed(peer)
        t = timed(ours)
    else:
        t = timed(ours)
        p = timed(peer)
    return p, t


def repeats(repeat: int, log: Callable[[str], None]) -> Iterator[tuple[int, bool]]:
    """``(r, peer_first)`` for each of ``repeat`` repeats (logged): the peer goes first in
    the even ones, tracedb in the odd ones."""
    for r in range(repeat):
        log(f"repeat {r + 1}/{repeat}")
        yield r, r % 2 == 0


@dataclass
class Metric:
    """One row of the table."""

    key: str
    label: str
    kind: str  # "speedup" (peer/tracedb, higher is better), "fraction" / "multiple" (tracedb/peer, lower is better)
    target: float | None = None
    peer: list[float] = field(default_factory=list)
    tracedb: list[float] = field(default_factory=list)
    unit: str = "s"
    notes: dict[str, Any] = field(default_factory=dict)
    peer_cpu: list[float] = field(default_factory=list)
    tracedb_cpu: list[float] = field(default_factory=list)

    def add(self, peer: Sample | None, ours: Sample | None) -> None:
        if peer is not None:
            self.peer.append(peer.wall)
            self.peer_cpu.append(peer.cpu)
        if ours is not None:
            self.tracedb.append(ours.wall)
            self.tracedb_cpu.append(ours.cpu)

    @property
    def ratio(self) -> float | None:
        if not self.peer or not self.tracedb:
            return None
        if self.kind in ("fraction", "multiple"):
            return statistics.median(self.tracedb) / statistics.median(self.peer)
        return statistics.median(self.peer) / statistics.median(self.tracedb)

    @property
    def passed(self) -> bool | None:
        ratio = self.ratio
        if self.target is None or ratio is None:
            return None
        return ratio >= self.target if self.kind == "speedup" else ratio <= self.target

    def target_text(self) -> str:
        if self.target is None:
            return "info"
        if self.kind == "multiple":
            return f"<= {self.target:g}x"
        return f">= {self.target:g}x" if self.kind == "speedup" else f"<= {self.target:.0%}"

    def to_dict(self) -> dict[str, Any]:
        def side(values: list[float], cpu: list[float]) -> dict[str, Any] | None:
            if not values:
                return None
            out = {"median": statistics.median(values), "min": min(values), "samples": values}
            if cpu:
                out["cpu_median"] = statistics.median(cpu)
                out["cpu_samples"] = cpu
            return out

        return {
            "label": self.label,
            "unit": self.unit,
            "kind": self.kind,
            "peer": side(self.peer, self.peer_cpu),
            "tracedb": side(self.tracedb, self.tracedb_cpu),
            "ratio": self.ratio,
            "target": self.target_text(),
            "passed": self.passed,
            **({"notes": self.notes} if self.notes else {}),
        }


# ------------------------------------------------------------------ both sides' common steps


def peer_read(results_dir: Path) -> list[Any]:
    """verifiers' own loader: ``read_episodes(results_dir, WireTrace)``."""
    from verifiers.v1 import WireTrace
    from verifiers.v1.utils.trace_store import read_episodes

    return read_episodes(results_dir, WireTrace)


def tracedb_ingest(jsonl: Path, db_path: Path) -> Any:
    """Ingest into a fresh file, closed (checkpointed) before the clock stops."""
    db = tracedb.connect(db_path)
    report = db.ingest(jsonl)
    db.close()
    return report


def ingest_checked(jsonl: Path, db_path: Path) -> tuple[Any, float]:
    """:func:`tracedb_ingest`, untimed by the figures: its report and seconds; a record
    tracedb rejects is a :class:`CorrectnessError`."""
    start = time.perf_counter()
    report = tracedb_ingest(jsonl, db_path)
    seconds = time.perf_counter() - start
    if not report.ok:
        raise CorrectnessError(f"tracedb rejected verifiers' records: {report.rejected[:3]}")
    return report, seconds


@contextmanager
def from_file(db_path: Path, what: str) -> Iterator[Any]:
    """A new read-only connection to ``db_path``, closed after. Databases share one DuckDB
    instance per process: a file some handle still holds open would be served from that
    attachment, not read from the file, so it is refused (``what`` names the figure)."""
    if is_attached(str(db_path)):
        raise RuntimeError(f"{db_path} is still open in this process: {what} would not be read from the file")
    with tracedb.connect(db_path, read_only=True) as db:
        yield db


def warmup_dir(files: WorkloadFiles, rundir: Path, lines: int = 8) -> Path:
    """``rundir/warmup``: a results directory of the workload's first ``lines`` lines, for
    the untimed warm-up of verifiers (its pydantic validators are built on first use)."""
    warmup = rundir / "warmup"
    warmup.mkdir(exist_ok=True)
    with files.jsonl.open("rb") as src, (warmup / TRACES_FILE).open("wb") as dst:
        for _, line in zip(range(lines), src):
            dst.write(line)
    return warmup


def remove_db(path: Path) -> None:
    for p in (path, Path(str(path) + ".wal")):
        p.unlink(missing_ok=True)


def db_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in (path, Path(str(path) + ".wal")) if p.exists())


# ------------------------------------------------------------------ the run's frame


def busy_seconds() -> float | None:
    """CPU seconds the whole machine has spent busy since boot (``/proc/stat``)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
    except (OSError, ValueError):
        return None
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class OtherLoad:
    """How much CPU other processes took while the benchmark ran. ``children``: the
    benchmark's own child processes (servers, writers: reaped by the time of
    :meth:`result`) count as its own CPU, not as other load."""

    def __init__(self, *, children: bool = False) -> None:
        self.children = children
        self.busy = busy_seconds()
        self.own = self.own_seconds()
        self.wall = time.perf_counter()
        self.load = os.getloadavg()

    def own_seconds(self) -> float:
        """The CPU seconds this process (and, with ``children``, its reaped children) used so far."""
        own = time.process_time()
        if self.children:
            reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
            own += reaped.ru_utime + reaped.ru_stime
        return own

    def result(self) -> dict[str, Any]:
        busy = busy_seconds()
        wall = time.perf_counter() - self.wall
        out: dict[str, Any] = {"load_average_before": self.load, "load_average_after": os.getloadavg()}
        if busy is not None and self.busy is not None and wall > 0:
            others = max(0.0, busy - self.busy - (self.own_seconds() - self.own))
            out["other_cpu_seconds"] = round(others, 1)
            out["other_cpu_share"] = round(others / (wall * (os.cpu_count() or 1)), 3)
        return out


def machine() -> dict[str, Any]:
    """The machine, the package versions (:data:`PACKAGES`) and the git commit."""
    cpu_model = None
    memory = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory = int(line.split()[1]) * 1024
                break
    except OSError:
        pass
    packages = {}
    for name in PACKAGES:
        try:
            packages[name] = version(name)
        except PackageNotFoundError:
            packages[name] = None
    git = None
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True, timeout=10)
        if rev.returncode == 0:
            git = {"commit": rev.stdout.strip(), "dirty": bool(dirty.stdout.strip())}
    except (OSError, subprocess.SubprocessError):
        pass
    return {
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": cpu_model,
        "memory_bytes": memory,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "packages": packages,
        "git": git,
    }


class Run:
    """One suite's run, from its start: the clock and the other processes' load
    (``children``: see :class:`OtherLoad`)."""

    def __init__(self, *, children: bool = False) -> None:
        self.started = time.perf_counter()
        self.other_load = OtherLoad(children=children)

    def results(self, **fields: Any) -> dict[str, Any]:
        """The suite's results: ``machine``, then ``fields`` in their order (``metrics``, a
        dict of :class:`Metric`, as dicts; with them ``all_targets_met`` after the last
        field), then ``other_load``, ``seconds`` (since the start) and ``timestamp``."""
        out: dict[str, Any] = {"machine": machine()}
        metrics: dict[str, Metric] | None = fields.get("metrics")
        for key, value in fields.items():
            out[key] = {k: m.to_dict() for k, m in value.items()} if key == "metrics" else value
        if metrics is not None:
            out["all_targets_met"] = all(m.passed for m in metrics.values() if m.passed is not None)
        out["other_load"] = self.other_load.result()
        out["seconds"] = round(time.perf_counter() - self.started, 1)
        out["timestamp"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        return out


def write_results(results: dict[str, Any], path: Path) -> None:
    """``results`` as JSON at ``path``, replaced whole (never half written)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(json.dumps(results, indent=2, default=str) + "\n")
    os.replace(tmp, path)
