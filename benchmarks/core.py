"""The measurements: verifiers v1 (the peer) and tracedb side by side in one run.

Every timed figure is taken ``repeat`` times; each repeat runs the peer and tracedb
back to back, alternating which goes first, with a ``gc.collect()`` before each timed
call so neither side pays for the other's garbage. Figures are medians (and minima).

Correctness is checked on the first repeat: the first view served is compared, branch by
branch and token by token (float streams at float32 precision), with the arrays
verifiers' ``Branch`` properties return for every trace; every other tracedb view taken in
any repeat must equal it, and so must the SQL macro view and the Parquet export.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import tracedb
from benchmarks.workload import WorkloadFiles
from tracedb.runtime import is_attached

COLUMNS = ["token_ids", "sampled_mask", "logprobs", "advantages"]
VIEW_BYTES_PER_TOKEN = 13  # int32 id + bool mask + float32 logprob + float32 advantage
KEYS = ["trace_id", "branch_index"]
PACKAGES = ["tracedb", "verifiers", "duckdb", "pyarrow", "numpy", "pydantic", "pysimdjson", "polars"]


class CorrectnessError(Exception):
    """tracedb's answer differs from verifiers': the figures mean nothing."""


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


# ------------------------------------------------------------------ the two sides


def peer_read(results_dir: Path) -> list[Any]:
    """verifiers' own loader: ``read_episodes(results_dir, WireTrace)``."""
    from verifiers.v1 import WireTrace
    from verifiers.v1.utils.trace_store import read_episodes

    return read_episodes(results_dir, WireTrace)


def peer_walk(episodes: list[Any]) -> tuple[int, int]:
    """Read every branch's token_ids, sampled_mask, logprobs and advantages.

    Each branch's lists are dropped once read (a streaming consumer), the fastest way
    to use verifiers' properties; keeping them all alive costs it 2-4x more.
    """
    branches = tokens = 0
    for episode in episodes:
        for trace in episode.traces:
            for branch in trace.branches:
                ids = branch.token_ids
                mask = branch.sampled_mask
                logprobs = branch.logprobs
                advantages = branch.advantages
                n = len(ids)
                if len(mask) != n or len(logprobs) != n or (advantages is not None and len(advantages) != n):
                    raise CorrectnessError(f"verifiers' branch {trace.id}/{branch.index} is not aligned")
                branches += 1
                tokens += n
    return branches, tokens


def peer_read_walk(results_dir: Path) -> tuple[int, int]:
    return peer_walk(peer_read(results_dir))


def tracedb_ingest(jsonl: Path, db_path: Path) -> Any:
    """Ingest into a fresh file, closed (checkpointed) before the clock stops."""
    db = tracedb.connect(db_path)
    report = db.ingest(jsonl)
    db.close()
    return report


def tracedb_from_file(db_path: Path) -> pa.Table:
    # Databases share one DuckDB instance per process; this figure must open the file
    # afresh, not share an attachment some other handle still holds.
    if is_attached(str(db_path)):
        raise RuntimeError(f"{db_path} is still open in this process: the view would not be read from the file")
    with tracedb.connect(db_path, read_only=True) as db:
        return db.branches(columns=COLUMNS)


def remove_db(path: Path) -> None:
    for p in (path, Path(str(path) + ".wal")):
        p.unlink(missing_ok=True)


def db_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in (path, Path(str(path) + ".wal")) if p.exists())


@dataclass
class Sample:
    """One timed call: wall seconds, and CPU seconds of the whole process (all threads)."""

    wall: float
    cpu: float


def timed(fn: Callable[[], Any]) -> tuple[Sample, Any]:
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


# ------------------------------------------------------------------ correctness


def _flat(col: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    arr = col.combine_chunks()
    offsets = arr.offsets.to_numpy().astype(np.int64)
    values = arr.values.to_numpy(zero_copy_only=False)
    valid = arr.is_valid().to_numpy(zero_copy_only=False)
    return values, offsets, valid


def verify_against_peer(table: pa.Table, episodes: list[Any]) -> dict[str, Any]:
    """Every branch of every trace: tracedb's row equals verifiers' Branch arrays."""
    failures: list[str] = []
    row_of = {key: i for i, key in enumerate(zip(table["trace_id"].to_pylist(), table["branch_index"].to_pylist()))}
    trainable = table["trainable"].to_pylist()
    cols = {c: _flat(table[c]) for c in COLUMNS}
    branches = tokens = untrainable = forks = held = 0
    for episode in episodes:
        for trace in episode.traces:
            trace_branches = trace.branches
            forks += len(trace_branches) > 1
            for b in trace_branches:
                branches += 1
                where = f"trace {trace.id} branch {b.index}"
                i = row_of.pop((trace.id, b.index), None)
                if i is None:
                    failures.append(f"{where}: missing from tracedb's view")
                    continue
                if trainable[i] != b.trainable:
                    failures.append(f"{where}: trainable {trainable[i]} != verifiers {b.trainable}")
                untrainable += not b.trainable
                expected = {
                    "token_ids": np.asarray(b.token_ids, np.int64),
                    "sampled_mask": np.asarray(b.sampled_mask, bool),
                    "logprobs": np.asarray(b.logprobs, np.float32),
                    "advantages": None if b.advantages is None else np.asarray(b.advantages, np.float32),
                }
                tokens += len(expected["token_ids"])
                for name, want in expected.items():
                    values, offsets, valid = cols[name]
                    if want is None:
                        if valid[i]:
                            failures.append(f"{where}: {name} is None in verifiers, not in tracedb")
                        continue
                    if not valid[i]:
                        failures.append(f"{where}: {name} is null in tracedb, not in verifiers")
                        continue
                    held += name == "advantages"
                    got = values[offsets[i] : offsets[i + 1]]
                    if len(got) != len(want) or not np.array_equal(got, want):
                        bad = int(np.flatnonzero(got != want)[0]) if len(got) == len(want) else None
                        failures.append(
                            f"{where}: {name} differs (tracedb {len(got)} values, verifiers {len(want)}"
                            + (f"; first difference at token {bad}" if bad is not None else "")
                            + ")"
                        )
    for tid, bi in list(row_of)[:5]:
        failures.append(f"trace {tid} branch {bi}: in tracedb's view, not in verifiers'")
    if failures:
        shown = "\n  ".join(failures[:10])
        raise CorrectnessError(f"tracedb's branch view differs from verifiers' ({len(failures)} problems):\n  {shown}")
    if forks == 0 or held == 0:
        raise CorrectnessError(
            f"the workload lacks what it should exercise: {forks} forked traces, {held} branches with advantages"
        )
    return {
        "branches": branches,
        "tokens": tokens,
        "forked_traces": forks,
        "untrainable_branches": untrainable,
        "branches_with_advantages": held,
    }


def same_view(name: str, got: pa.Table, reference: pa.Table) -> None:
    """``got`` holds the same rows (sorted by trace and branch) and columns as ``reference``."""
    names = ["trace_id", "branch_index", "trainable", *COLUMNS]
    missing = [c for c in names if c not in got.column_names]
    if missing:
        raise CorrectnessError(f"{name}: columns {missing} missing")
    got = got.select(names).sort_by([(k, "ascending") for k in KEYS])
    if got.num_rows != reference.num_rows:
        raise CorrectnessError(f"{name}: {got.num_rows} rows, the reference view has {reference.num_rows}")
    for c in names:
        want = reference[c]
        have = got[c]
        if have.type != want.type:
            have = have.cast(want.type)
        if not have.equals(want):
            raise CorrectnessError(f"{name}: column {c} differs from the reference view")


# ------------------------------------------------------------------ facts


def _busy_seconds() -> float | None:
    """CPU seconds the whole machine has spent busy since boot (``/proc/stat``)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
    except (OSError, ValueError):
        return None
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class OtherLoad:
    """How much CPU other processes took while the benchmark ran."""

    def __init__(self) -> None:
        self.busy = _busy_seconds()
        self.own = time.process_time()
        self.wall = time.perf_counter()
        self.load = os.getloadavg()

    def result(self) -> dict[str, Any]:
        busy = _busy_seconds()
        wall = time.perf_counter() - self.wall
        out: dict[str, Any] = {"load_average_before": self.load, "load_average_after": os.getloadavg()}
        if busy is not None and self.busy is not None and wall > 0:
            others = max(0.0, busy - self.busy - (time.process_time() - self.own))
            out["other_cpu_seconds"] = round(others, 1)
            out["other_cpu_share"] = round(others / (wall * (os.cpu_count() or 1)), 3)
        return out


def machine() -> dict[str, Any]:
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
    repo = Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=repo, capture_output=True, text=True, timeout=10)
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


# ------------------------------------------------------------------ the run


def run(files: WorkloadFiles, workdir: Path, repeat: int, *, log: Callable[[str], None]) -> dict[str, Any]:
    """Measure everything; returns the results (see :func:`render` for the table)."""
    started = time.perf_counter()
    other_load = OtherLoad()
    rundir = workdir / "run"
    rundir.mkdir(parents=True, exist_ok=True)
    bench_db = rundir / "tracedb.duckdb"
    scratch = rundir / "ingest.duckdb"
    parquet = rundir / "export.parquet"
    for p in (bench_db, scratch):
        remove_db(p)
    parquet.unlink(missing_ok=True)

    # Warm-ups, untimed: verifiers builds its pydantic validators on first use (seconds),
    # so it reads a few lines first; tracedb's warm-up is ingesting the database that
    # every view figure reads.
    warmup = rundir / "warmup"
    warmup.mkdir(exist_ok=True)
    with files.jsonl.open("rb") as src, (warmup / files.jsonl.name).open("wb") as dst:
        for _, line in zip(range(8), src):
            dst.write(line)
    peer_read_walk(warmup)
    report = tracedb_ingest(files.jsonl, bench_db)
    if not report.ok:
        raise CorrectnessError(f"tracedb rejected verifiers' records: {report.rejected[:3]}")
    with tracedb.connect(bench_db, read_only=True) as db:
        stats = db.stats()
    raw_bytes = files.jsonl.stat().st_size
    stored_bytes = db_bytes(bench_db)

    m = {
        "ingest": Metric("ingest", "ingest: read_episodes vs ingest+close", "speedup", 5.0),
        "warm_views": Metric("warm_views", "warm views: Branch walk vs db.branches", "speedup", 10.0),
        "warm_views_cold_cache": Metric("warm_views_cold_cache", "  same, warm DuckDB, cold cache", "speedup", None),
        "views_from_file": Metric("views_from_file", "views from file: read+walk vs open+branches", "speedup", 50.0),
        "storage": Metric("storage", "storage: traces.jsonl vs database", "fraction", 0.25, unit="MB"),
        "sql_macro_view": Metric("sql_macro_view", "SQL branch_tokens() vs Branch walk", "speedup", None),
        "export_parquet": Metric("export_parquet", "export to Parquet (4 columns)", "info", None),
    }
    m["storage"].peer = [raw_bytes / 1e6]
    m["storage"].tracedb = [stored_bytes / 1e6]
    m["storage"].notes = {"jsonl_bytes": raw_bytes, "database_bytes": stored_bytes}

    correctness: dict[str, Any] = {"passed": False}
    reference: pa.Table | None = None
    views_checked = 0

    def check(name: str, table: pa.Table) -> None:
        nonlocal views_checked
        assert reference is not None
        if not table.equals(reference):
            same_view(name, table, reference)  # explains how, or it is only chunking/metadata
        views_checked += 1

    for r in range(repeat):
        peer_first = r % 2 == 0
        log(f"repeat {r + 1}/{repeat}")

        # 1. ingest
        remove_db(scratch)
        (tp, episodes), (tt, ingested) = pair(
            partial(peer_read, files.dir), partial(tracedb_ingest, files.jsonl, scratch), peer_first
        )
        if not ingested.ok or ingested.traces != report.traces:
            raise CorrectnessError(f"ingest run {r + 1}: {ingested}")
        m["ingest"].add(tp, tt)
        remove_db(scratch)

        # 2. warm views: the peer walks the episodes it just loaded; tracedb serves the
        # view from an open database that has served it once already.
        warm = tracedb.connect(bench_db, read_only=True)
        try:
            served = warm.branches(columns=COLUMNS)
            if reference is None:
                log("verifying tracedb's views against verifiers' Branch arrays")
                reference = served.sort_by([(k, "ascending") for k in KEYS])
                correctness.update(verify_against_peer(reference, episodes))
            check("first view", served)
            # Not kept alive across the timed call: on this kind of VM, fresh memory for a
            # second 100 MB view costs several times the view itself (first-touch faults).
            del served
            (tp, walked), (tt, table) = pair(
                partial(peer_walk, episodes), partial(warm.branches, columns=COLUMNS), peer_first
            )
            m["warm_views"].add(tp, tt)
            if walked != (correctness["branches"], correctness["tokens"]):
                raise CorrectnessError(f"peer walk saw {walked}, verification saw {correctness}")
            check("warm view", table)
            del table

            # warm DuckDB, cold decode cache
            warm.handle.view_cache = None
            tc, table = timed(partial(warm.branches, columns=COLUMNS))
            m["warm_views_cold_cache"].add(tp, tc)
            check("cold-cache view", table)
            del table

            # SQL macro view, against the same peer walk
            ts, table = timed(partial(warm.sql, "SELECT * FROM branch_tokens()"))
            m["sql_macro_view"].add(tp, ts)
            if r == 0:
                same_view("SQL branch_tokens()", table, reference)
                views_checked += 1
            del table

            # export to Parquet
            parquet.unlink(missing_ok=True)
            te, exported = timed(partial(warm.export, parquet, columns=COLUMNS))
            m["export_parquet"].add(None, te)
            m["export_parquet"].notes = {
                "rows": exported["rows"],
                "tokens": exported["tokens"],
                "file_bytes": exported["bytes"],
                "view_MB_per_s": None,  # filled below from the median
            }
            if r == 0:
                same_view("Parquet export", pq.read_table(parquet), reference)
                views_checked += 1
            parquet.unlink(missing_ok=True)
        finally:
            warm.close()
        del episodes

        # 3. views from the database file vs read_episodes + walk
        (tp, walked), (tt, table) = pair(
            partial(peer_read_walk, files.dir), partial(tracedb_from_file, bench_db), peer_first
        )
        m["views_from_file"].add(tp, tt)
        check("view from file", table)
        if walked != (correctness["branches"], correctness["tokens"]):
            raise CorrectnessError(f"peer read+walk saw {walked}, expected {correctness}")
        del table

    correctness["passed"] = True
    correctness["tracedb_views_checked"] = views_checked
    export = m["export_parquet"]
    median_export = statistics.median(export.tracedb)
    export.notes["view_MB_per_s"] = round(export.notes["tokens"] * VIEW_BYTES_PER_TOKEN / 1e6 / median_export, 1)
    export.notes["file_MB_per_s"] = round(export.notes["file_bytes"] / 1e6 / median_export, 1)
    export.notes["rows_per_s"] = round(export.notes["rows"] / median_export, 1)
    view_tokens = correctness["tokens"]
    for key in ("warm_views", "warm_views_cold_cache", "views_from_file"):
        m[key].notes = {
            "tracedb_view_GB_per_s": round(
                view_tokens * VIEW_BYTES_PER_TOKEN / 1e9 / statistics.median(m[key].tracedb), 2
            )
        }

    from benchmarks import peers

    peer = {"bytes": peers.measure_bytes(files, bench_db, rundir, log=log)}
    peer["ingest"] = peers.measure_ingest(files, rundir, repeat, log=log)
    peer["ingest"]["ratios"]["read_json_in_process_over_tracedb_in_process"] = round(
        peer["ingest"]["duckdb read_json (in-process)"]["median"] / statistics.median(m["ingest"].tracedb), 2
    )
    with tracedb.connect(bench_db, read_only=True) as db:
        breakdown = db.storage()
    metrics = {k: v.to_dict() for k, v in m.items()}
    targets = [v.passed for v in m.values() if v.passed is not None]
    return {
        "machine": machine(),
        "workload": {**files.manifest, "path": str(files.jsonl)},
        "database": {**stats, "path": str(bench_db)},
        "view": {
            "columns": COLUMNS,
            "branches": correctness["branches"],
            "tokens": view_tokens,
            "bytes": view_tokens * VIEW_BYTES_PER_TOKEN,
        },
        "repeat": repeat,
        "metrics": metrics,
        "peers": peer,
        "storage_breakdown": breakdown,
        "correctness": correctness,
        "all_targets_met": all(targets),
        "other_load": other_load.result(),
        "seconds": round(time.perf_counter() - started, 1),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


# ------------------------------------------------------------------ output


def _side(values: list[float] | None, unit: str) -> str:
    if not values:
        return "-"
    med, low = statistics.median(values), min(values)
    if unit == "MB":
        return f"{med:.1f} MB"
    return f"{med:.3f}s ({low:.3f}s)"


def render(results: dict[str, Any]) -> str:
    """The table: metric, peer, tracedb (median (min)), ratio, target, PASS/MISS."""
    rows = [("metric", "verifiers median (min)", "tracedb median (min)", "ratio", "target", "result")]
    for d in results["metrics"].values():
        peer = d["peer"]["samples"] if d["peer"] else None
        ours = d["tracedb"]["samples"] if d["tracedb"] else None
        ratio = d["ratio"]
        if ratio is None:
            ratio_text = "-"
        elif d["kind"] == "fraction":
            ratio_text = f"{ratio:.1%}"
        else:
            ratio_text = f"{ratio:.1f}x"
        result = "-" if d["passed"] is None else ("PASS" if d["passed"] else "MISS")
        rows.append((d["label"], _side(peer, d["unit"]), _side(ours, d["unit"]), ratio_text, d["target"], result))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for n, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])] + [
            c.rjust(w) if i < 4 else c.ljust(w) for i, (c, w) in enumerate(zip(row[1:], widths[1:]), 1)
        ]
        lines.append("  ".join(cells).rstrip())
        if n == 0:
            lines.append("-" * len(lines[0]))

    w = results["workload"]
    db = results["database"]
    view = results["view"]
    ex = results["metrics"]["export_parquet"]["notes"]
    mach = results["machine"]
    lines += [
        "",
        f"workload: {w['traces']} traces in groups of {w['params']['group_size']}, {w['tokens']:,} node tokens "
        f"({w['tokens'] // max(1, w['traces']):,}/trace), {w['bytes'] / 1e6:.1f} MB traces.jsonl written by verifiers "
        f"{w['verifiers']}",
        f"view: {view['branches']} branches, {view['tokens']:,} tokens x {len(view['columns'])} columns "
        f"({view['bytes'] / 1e6:.0f} MB at {VIEW_BYTES_PER_TOKEN} B/token); database: {db['nodes']} nodes, "
        f"{db['segments']} segments, {db['stored_tokens']:,} stored tokens (dedup {db['dedup_ratio']}x)",
        f"export: {ex['rows']} rows, {ex['file_bytes'] / 1e6:.1f} MB Parquet, {ex['view_MB_per_s']:.0f} MB/s of view "
        f"({ex['file_MB_per_s']:.0f} MB/s of file)",
        f"correctness: {results['correctness']['branches']} branches checked token by token against verifiers, "
        f"{results['correctness']['tracedb_views_checked']} tracedb views equal: "
        f"{'PASSED' if results['correctness']['passed'] else 'FAILED'}",
        f"machine: {mach['cpu_count']} cpus, {(mach['memory_bytes'] or 0) / 2**30:.0f} GiB, python {mach['python']}, "
        f"duckdb {mach['packages']['duckdb']}; {results['repeat']} repeats, {results['seconds']:.0f}s",
    ]
    cpu_ratios = []
    for key, d in results["metrics"].items():
        if d["kind"] == "speedup" and d["peer"] and d["tracedb"] and d["tracedb"].get("cpu_median"):
            cpu_ratios.append(f"{key} {d['peer']['cpu_median'] / d['tracedb']['cpu_median']:.1f}x")
    if cpu_ratios:
        lines.append(
            "cpu-time ratios (process CPU, all threads; less sensitive to other load): " + ", ".join(cpu_ratios)
        )
    if "peers" in results:
        from benchmarks import peers

        lines += peers.render(results["peers"]) + peers.render_breakdown(results["storage_breakdown"])
    share = results["other_load"].get("other_cpu_share")
    if share is not None and share > 0.05:
        lines.append(
            f"note: other processes used {share:.0%} of the machine's {mach['cpu_count']} cpus during the run "
            f"({results['other_load']['other_cpu_seconds']:.0f} cpu-seconds): figures are noisier than usual"
        )
    return "\n".join(lines)


def write_results(results: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(json.dumps(results, indent=2, default=str) + "\n")
    os.replace(tmp, path)
