"""The peers of the core suite's storage and ingest figures, measured in the same run.

Bytes of the same run, each a way a user could keep it:

- ``jsonl``: verifiers' ``traces.jsonl`` itself;
- ``zstd -3`` / ``zstd -19``: that file through python ``zstandard`` at those levels with
  every core (``threads=-1``, as ``zstd -T0``);
- ``branches parquet (zstd)``: the branch views (``db.branches()``, every column) written
  by pyarrow with zstd, one flat row per branch;
- ``tables parquet (zstd 3/19)``: each of tracedb's tables copied out by DuckDB as Parquet
  with zstd at those levels (the information tracedb keeps, under a general-purpose coder);
- ``duckdb read_json``: a DuckDB file holding ``read_json`` of the jsonl (the peer below);
- ``tracedb``: tracedb's file after ingest and close (the close checkpoints).

Ingest as processes and in-process (medians of ``repeat`` runs): verifiers'
``read_episodes`` and ``tracedb ingest`` as whole processes (interpreter start, imports,
the work), DuckDB's ``read_json`` of the file into a fresh file (in-process and as a
process), and the start-up floor: ``python -c "import duckdb, pyarrow"`` against
``tracedb --help``. The in-process verifiers and tracedb figures are the core suite's
``ingest`` row.
"""

from __future__ import annotations

import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import duckdb
import pyarrow.parquet as pq

import tracedb
from benchmarks.workload import WorkloadFiles

TABLES = ("episodes", "traces", "nodes", "segments", "branches")
TARGETS = {"zstd -19": 1.0}  # tracedb's bytes / the peer's, at most (issue: storage <= zstd -19)
INGEST_TARGETS = {
    "whole_process_verifiers_over_tracedb": (">=", 6.0),
    "tracedb_help_over_import_duckdb_pyarrow": ("<=", 1.3),
}
"""Issue 24: verifiers' read_episodes over tracedb ingest as whole processes, at least 6x;
``tracedb --help`` over ``python -c "import duckdb, pyarrow"``, at most 1.3x."""
READ_JSON = (
    "CREATE TABLE episodes AS SELECT * FROM read_json({path}, format = 'newline_delimited', "
    "maximum_object_size = 1073741824)"
)


def _quote(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def zstd_bytes(path: Path, level: int) -> tuple[int, float]:
    """Bytes of ``path`` compressed by zstd at ``level`` on every core, and the seconds taken."""
    import zstandard

    data = path.read_bytes()
    start = time.perf_counter()
    out = zstandard.ZstdCompressor(level=level, threads=-1).compress(data)
    return len(out), time.perf_counter() - start


def tables_parquet_bytes(db_path: Path, out_dir: Path, level: int) -> int:
    """tracedb's tables copied out by DuckDB as Parquet (zstd at ``level``): total bytes."""
    out_dir.mkdir(parents=True, exist_ok=True)
    total = 0
    con = duckdb.connect(str(db_path), read_only=True)
    try:
        for table in TABLES:
            target = out_dir / f"{table}.parquet"
            con.execute(
                f"COPY {table} TO {_quote(str(target))} (FORMAT parquet, COMPRESSION zstd, COMPRESSION_LEVEL {level})"
            )
            total += target.stat().st_size
            target.unlink()
    finally:
        con.close()
    return total


def branches_parquet_bytes(db_path: Path, target: Path) -> int:
    with tracedb.connect(db_path, read_only=True) as db:
        table = db.branches()
    pq.write_table(table, target, compression="zstd")
    size = target.stat().st_size
    target.unlink()
    return size


def read_json_into(jsonl: Path, db_path: Path) -> None:
    """DuckDB's own JSON reader: the file into a table of a fresh DuckDB file, closed."""
    for p in (db_path, Path(str(db_path) + ".wal")):
        p.unlink(missing_ok=True)
    con = duckdb.connect(str(db_path))
    try:
        con.execute(READ_JSON.format(path=_quote(str(jsonl))))
        con.execute("CHECKPOINT")
    finally:
        con.close()


def _process(argv: list[str]) -> tuple[float, float]:
    """Wall and CPU seconds (user + system) of one child process run to its end."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=3_600)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:3])} ... exited {done.returncode}: {done.stderr[-2000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def _timed(fn: Callable[[], Any]) -> tuple[float, float]:
    cpu, start = time.process_time(), time.perf_counter()
    fn()
    return time.perf_counter() - start, time.process_time() - cpu


def _summary(samples: list[tuple[float, float]]) -> dict[str, Any]:
    walls = [s[0] for s in samples]
    return {
        "median": statistics.median(walls),
        "min": min(walls),
        "samples": walls,
        "cpu_median": statistics.median(s[1] for s in samples),
    }


def tracedb_cli() -> list[str]:
    """The ``tracedb`` console script of this interpreter's environment."""
    script = Path(sys.executable).with_name("tracedb")
    return [str(script)] if script.exists() else [sys.executable, "-m", "tracedb"]


def measure_bytes(files: WorkloadFiles, db_path: Path, rundir: Path, *, log: Callable[[str], None]) -> dict[str, Any]:
    """Every byte peer of the run (see the module doc), and tracedb's ratio to each."""
    log("peers: bytes (zstd -3, zstd -19, Parquet of the views and of the tables)")
    ours = sum(p.stat().st_size for p in (db_path, Path(str(db_path) + ".wal")) if p.exists())
    rows: dict[str, dict[str, Any]] = {"jsonl": {"bytes": files.jsonl.stat().st_size}}
    for level in (3, 19):
        size, seconds = zstd_bytes(files.jsonl, level)
        rows[f"zstd -{level}"] = {"bytes": size, "seconds": round(seconds, 2)}
    rows["branches parquet (zstd)"] = {"bytes": branches_parquet_bytes(db_path, rundir / "branches.parquet")}
    for level in (3, 19):
        rows[f"tables parquet (zstd {level})"] = {"bytes": tables_parquet_bytes(db_path, rundir / "tables", level)}
    json_db = rundir / "read_json.duckdb"
    read_json_into(files.jsonl, json_db)
    rows["duckdb read_json"] = {"bytes": json_db.stat().st_size}
    json_db.unlink()
    rows["tracedb"] = {"bytes": ours}
    for name, row in rows.items():
        row["tracedb_ratio"] = round(ours / row["bytes"], 3)
        if name in TARGETS:
            row["target"] = f"tracedb <= {TARGETS[name]:g}x"
            row["passed"] = ours <= TARGETS[name] * row["bytes"]
    return rows


def measure_ingest(files: WorkloadFiles, rundir: Path, repeat: int, *, log: Callable[[str], None]) -> dict[str, Any]:
    """Whole-process ingest of verifiers and tracedb, DuckDB's read_json, start-up floors."""
    log("peers: ingest as whole processes, DuckDB read_json, start-up")
    scratch = rundir / "peer-ingest.duckdb"
    json_db = rundir / "peer-read_json.duckdb"
    env_python = [sys.executable, "-c"]
    verifiers_read = (
        "import sys; from pathlib import Path; from verifiers.v1 import WireTrace; "
        "from verifiers.v1.utils.trace_store import read_episodes; "
        "read_episodes(Path(sys.argv[1]), WireTrace)"
    )
    read_json_code = (
        "import sys, duckdb; con = duckdb.connect(sys.argv[2]); "
        f'con.execute({READ_JSON!r}.format(path="\'" + sys.argv[1].replace("\'", "\'\'") + "\'")); '
        "con.execute('CHECKPOINT'); con.close()"
    )
    samples: dict[str, list[tuple[float, float]]] = {
        k: []
        for k in (
            "verifiers read_episodes (process)",
            "tracedb ingest (process)",
            "duckdb read_json (in-process)",
            "duckdb read_json (process)",
            "python -c 'import duckdb, pyarrow'",
            "tracedb --help",
        )
    }
    cli = tracedb_cli()
    for r in range(repeat):
        log(f"peers: ingest repeat {r + 1}/{repeat}")
        for p in (scratch, json_db):
            for q in (p, Path(str(p) + ".wal")):
                q.unlink(missing_ok=True)
        order = [
            ("verifiers read_episodes (process)", lambda: _process([*env_python, verifiers_read, str(files.dir)])),
            (
                "tracedb ingest (process)",
                lambda: _process([*cli, "ingest", str(files.jsonl), "--db", str(scratch), "--no-progress"]),
            ),
        ]
        if r % 2:
            order.reverse()
        for name, fn in order:
            samples[name].append(fn())
        samples["duckdb read_json (in-process)"].append(_timed(lambda: read_json_into(files.jsonl, json_db)))
        json_db.unlink(missing_ok=True)
        samples["duckdb read_json (process)"].append(
            _process([*env_python, read_json_code, str(files.jsonl), str(json_db)])
        )
        json_db.unlink(missing_ok=True)
        samples["python -c 'import duckdb, pyarrow'"].append(_process([*env_python, "import duckdb, pyarrow"]))
        samples["tracedb --help"].append(_process([*cli, "--help"]))
        for q in (scratch, Path(str(scratch) + ".wal")):
            q.unlink(missing_ok=True)
    out = {name: _summary(s) for name, s in samples.items()}
    med = {name: v["median"] for name, v in out.items()}
    out["ratios"] = {
        "whole_process_verifiers_over_tracedb": round(
            med["verifiers read_episodes (process)"] / med["tracedb ingest (process)"], 2
        ),
        "read_json_in_process_over_tracedb_in_process": None,  # filled by the core suite (its ingest row)
        "tracedb_help_over_import_duckdb_pyarrow": round(
            med["tracedb --help"] / med["python -c 'import duckdb, pyarrow'"], 2
        ),
    }
    out["targets"] = {name: f"{op} {bound:g}x" for name, (op, bound) in INGEST_TARGETS.items()}
    out["passed"] = {
        name: out["ratios"][name] >= bound if op == ">=" else out["ratios"][name] <= bound
        for name, (op, bound) in INGEST_TARGETS.items()
    }
    return out


def render(peers: dict[str, Any]) -> list[str]:
    """Lines for the core suite's table: the bytes, then the ingest peers."""
    lines = ["", "bytes of the same run (tracedb's file / each):"]
    for name, row in peers["bytes"].items():
        mark = ""
        if "passed" in row:
            mark = f"  target {row['target']}: {'PASS' if row['passed'] else 'MISS'}"
        lines.append(f"  {name:<28} {row['bytes'] / 1e6:9.2f} MB   tracedb {row['tracedb_ratio']:.2f}x{mark}")
    ing = peers.get("ingest")
    if ing:
        lines.append("ingest and start-up (median of the repeats; wall seconds, cpu seconds):")
        for name, v in ing.items():
            if name in ("ratios", "targets", "passed"):
                continue
            lines.append(f"  {name:<36} {v['median']:8.3f}s  cpu {v['cpu_median']:.3f}s")
        r, passed = ing["ratios"], ing.get("passed", {})

        def verdict(name: str) -> str:
            return f"target {ing['targets'][name]}: " + ("PASS" if passed.get(name) else "MISS")

        whole, helps = "whole_process_verifiers_over_tracedb", "tracedb_help_over_import_duckdb_pyarrow"
        lines.append(
            f"  verifiers / tracedb as whole processes: {r[whole]:.2f}x ({verdict(whole)}); "
            f"tracedb --help / import duckdb, pyarrow: {r[helps]:.2f}x ({verdict(helps)})"
        )
        json_ratio = r.get("read_json_in_process_over_tracedb_in_process")
        if json_ratio is not None:
            lines.append(f"  duckdb read_json / tracedb ingest, in-process: {json_ratio:.2f}x")
    return lines


def render_breakdown(breakdown: dict[str, Any], top: int = 14) -> list[str]:
    """The largest parts of tracedb's file (``tracedb stats --bytes``), for the table."""
    from tracedb.storage import flat_rows

    rows = sorted(flat_rows(breakdown), key=lambda r: -r["bytes"])
    lines = [f"tracedb's file by table and column ({breakdown['file_bytes'] / 1e6:.2f} MB; tracedb stats --bytes):"]
    for r in rows[:top] if len(rows) > top else rows:
        name = f"{r['table']}.{r['column']}" if r["column"] else r["table"]
        lines.append(f"  {name:<32} {r['bytes'] / 1e6:9.3f} MB  {r['share']:6.1%}  {r['compression']}")
    if len(rows) > top:
        rest = sum(r["bytes"] for r in rows[top:])
        lines.append(f"  {f'({len(rows) - top} more)':<32} {rest / 1e6:9.3f} MB  {rest / breakdown['file_bytes']:6.1%}")
    return lines
