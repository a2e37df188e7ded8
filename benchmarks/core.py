"""The core suite: verifiers v1 (the peer) and tracedb side by side in one run.

Every timed figure is taken ``repeat`` times; each repeat runs the peer and tracedb
back to back, alternating which goes first, with a ``gc.collect()`` before each timed
call so neither side pays for the other's garbage (``benchmarks/harness.py``). Figures
are medians (and minima).

Correctness is checked on the first repeat: the first view served is compared, branch by
branch and token by token (float streams at float32 precision), with the arrays
verifiers' ``Branch`` properties return for every trace; every other tracedb view taken in
any repeat must equal it, and so must the SQL macro view and the Parquet export.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import tracedb
from benchmarks import tables
from benchmarks.harness import (
    CorrectnessError,
    Metric,
    Run,
    db_bytes,
    from_file,
    ingest_checked,
    pair,
    peer_read,
    remove_db,
    repeats,
    timed,
    tracedb_ingest,
    warmup_dir,
)
from benchmarks.workload import WorkloadFiles

RESULTS = Path(__file__).resolve().parent / "results.json"
QUICK = {"traces": 16, "tokens": 3_000, "repeat": 1}
FULL = {"traces": 256, "tokens": 30_000, "repeat": 5}
COLUMNS = ["token_ids", "sampled_mask", "logprobs", "advantages"]
VIEW_BYTES_PER_TOKEN = 13  # int32 id + bool mask + float32 logprob + float32 advantage
KEYS = ["trace_id", "branch_index"]
INGEST_TARGET = 8.0
"""In-process ingest (read_episodes / ingest+close), at least (issue 24; whole processes:
:data:`benchmarks.peers.INGEST_TARGETS`)."""


# ------------------------------------------------------------------ the two sides


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


def tracedb_from_file(db_path: Path) -> pa.Table:
    """A new read-only connection to the file (refused while it is open here), the view, closed."""
    with from_file(db_path, "the view") as db:
        return db.branches(columns=COLUMNS)


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


# ------------------------------------------------------------------ the run


def run(files: WorkloadFiles, workdir: Path, repeat: int, *, log: Callable[[str], None]) -> dict[str, Any]:
    """Measure everything; returns the results (see :func:`render` for the table)."""
    frame = Run()
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
    peer_read_walk(warmup_dir(files, rundir))
    report, _ = ingest_checked(files.jsonl, bench_db)
    with tracedb.connect(bench_db, read_only=True) as db:
        stats = db.stats()
    raw_bytes = files.jsonl.stat().st_size
    stored_bytes = db_bytes(bench_db)

    m = {
        "ingest": Metric("ingest", "ingest: read_episodes vs ingest+close", "speedup", INGEST_TARGET),
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

    for r, peer_first in repeats(repeat, log):
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
    results = frame.results(
        workload={**files.manifest, "path": str(files.jsonl)},
        database={**stats, "path": str(bench_db)},
        view={
            "columns": COLUMNS,
            "branches": correctness["branches"],
            "tokens": view_tokens,
            "bytes": view_tokens * VIEW_BYTES_PER_TOKEN,
        },
        repeat=repeat,
        metrics=m,
        peers=peer,
        storage_breakdown=breakdown,
        correctness=correctness,
    )
    # The whole-process and tracedb --help ratios count too (benchmarks.peers.INGEST_TARGETS).
    results["all_targets_met"] = results["all_targets_met"] and all(peer["ingest"]["passed"].values())
    return results


# ------------------------------------------------------------------ output


def render(results: dict[str, Any]) -> str:
    """The table: metric, peer, tracedb (median (min)), ratio, target, PASS/MISS."""
    header = ("metric", "verifiers median (min)", "tracedb median (min)", "ratio", "target", "result")
    lines = tables.metric_table(results["metrics"], header)

    w = results["workload"]
    db = results["database"]
    view = results["view"]
    ex = results["metrics"]["export_parquet"]["notes"]
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
        tables.machine_line(results),
    ]
    lines += tables.cpu_ratio_lines(results["metrics"], "; less sensitive to other load")
    if "peers" in results:
        from benchmarks import peers

        lines += peers.render(results["peers"]) + peers.render_breakdown(results["storage_breakdown"])
    lines += tables.busy_note(results["other_load"], results["machine"]["cpu_count"])
    return "\n".join(lines)
