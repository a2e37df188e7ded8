"""The credit benchmark: stamping ``grpo`` and ``gae`` credit sets with tracedb against the
way trainers do it today, per trace in Python over verifiers objects, in one run.

The peer works on the episodes ``read_episodes`` returned (read once, untimed): it walks
each trace's nodes (GRPO) or branches (GAE) and sets ``node.advantages`` to a list over the
node's sampled tokens. tracedb runs ``tracedb.credit.run`` on the benchmark database (compute
and write, one transaction) and, separately, ``tracedb.credit.compute`` (no write).

Every repeat times both sides back to back, alternating which goes first, each after a
``gc.collect()``; figures are medians (and minima). After every timed stamp tracedb's credit
set is read back node by node and compared with the peer's ``node.advantages``; on the first
repeat also the branch view (``db.branches(credit=...)``) against verifiers' own
``Branch.advantages`` and the ``compute`` table. Any difference is a :class:`CorrectnessError`.

The floor, measured in every repeat beside the grpo stamp: one credit set created
(``credit_sets.create``, replacing the previous one, as a stamp does) and committed, with
no credit in it; and an empty BEGIN/COMMIT. The grpo stamp's multiple of the floor is a
target of its own.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

import tracedb
import tracedb.credit
from benchmarks import tables
from benchmarks.harness import CorrectnessError, Metric, Run, ingest_checked, pair, peer_read, remove_db, repeats, timed
from benchmarks.workload import WorkloadFiles
from tracedb import credit_sets

RESULTS = Path(__file__).resolve().parent / "results-credit.json"
QUICK = {"traces": 16, "tokens": 3_000, "repeat": 1}
FULL = {"traces": 256, "tokens": 30_000, "repeat": 11}
TARGETS = {"grpo": 5.0, "gae": 3.0}
"""Stamp speedup over the peer each algorithm must reach (issue 15)."""
FLOOR_TARGET = 3.0
"""A grpo stamp within this multiple of the floor: one set created and committed."""
FLOOR_SET = "bench-floor"
GAMMA, LAM = 1.0, 0.95
ALGORITHMS: dict[str, dict[str, Any]] = {"grpo": {}, "gae": {"gamma": GAMMA, "lam": LAM}}
SET_NAMES = {"grpo": "bench-grpo", "gae": "bench-gae"}
RTOL, ATOL = 1e-6, 1e-7  # float32 precision: |tracedb - peer| <= RTOL * |peer| + ATOL


# ------------------------------------------------------------------ the peer


def _valid(trace: Any) -> bool:
    """tracedb's rule (``outcome.trace_rewards``): ok, not timed out, at least one reward scored."""
    return trace.ok and not trace.is_timeout and any(r is not None for r in trace.rewards.values())


def peer_grpo(episodes: list[Any]) -> int:
    """GRPO as a trainer does it: ``A = trace.reward - mean(valid rewards of its group)``, then
    ``node.advantages = [A] * n_sampled`` on every sampled node (``node.sampled``, with
    ``n_sampled = node.mask.count(True)`` > 0). Excluded traces get None (their credit is
    unassigned). Returns the nodes stamped."""
    groups: dict[str, list[tuple[Any, float | None]]] = {}
    for episode in episodes:
        gid = episode.group.id if episode.group is not None else None
        for trace in episode.traces:
            key = gid if gid is not None else "trace:" + trace.id  # no group: its own group
            groups.setdefault(key, []).append((trace, trace.reward if _valid(trace) else None))
    stamped = 0
    for members in groups.values():
        rewards = [r for _, r in members if r is not None]
        mean = sum(rewards) / len(rewards) if rewards else 0.0
        for trace, reward in members:
            advantage = None if reward is None else reward - mean
            for node in trace.nodes:
                if node.sampled and (n := node.mask.count(True)):
                    node.advantages = None if advantage is None else [advantage] * n
                    stamped += advantage is not None
    return stamped


def peer_gae(episodes: list[Any], gamma: float = GAMMA, lam: float = LAM) -> int:
    """GAE as a trainer does it, per trace and per branch (``trace.branches``): the turns are the
    branch's sampled nodes with sampled tokens (as in GRPO), in path order; reward 0 on every
    turn but the last, which gets ``trace.reward``; values 0 (no critic, so the bootstrap of a
    truncated branch is 0 too); the backward loop ``delta = r + gamma V' - V``,
    ``A = delta + gamma lam A'``; each turn's advantage set on the node's sampled tokens. A node
    shared by branches takes its value from its first trainable branch (the first branch when
    none is), as tracedb does. Excluded traces get None. Returns the nodes stamped."""
    stamped = 0
    for episode in episodes:
        for trace in episode.traces:
            valid = _valid(trace)
            outcome = trace.reward
            done: set[int] = set()
            # Trainable branches first, each group in branch order: the first one through a node wins.
            for branch in sorted(trace.branches, key=lambda b: not b.trainable):
                turns = [(node, n) for node in branch.nodes if node.sampled and (n := node.mask.count(True))]
                if not valid:
                    for node, _ in turns:
                        node.advantages = None
                    continue
                size = len(turns)
                rewards = [0.0] * size
                if size:
                    rewards[-1] = outcome
                values = [0.0] * size
                advantages = [0.0] * size
                running = 0.0
                for t in range(size - 1, -1, -1):
                    next_value = values[t + 1] if t + 1 < size else 0.0
                    delta = rewards[t] + gamma * next_value - values[t]
                    running = delta + gamma * lam * running
                    advantages[t] = running
                for (node, n), advantage in zip(turns, advantages):
                    if id(node) in done:
                        continue
                    done.add(id(node))
                    node.advantages = [advantage] * n
                    stamped += 1
    return stamped


PEERS: dict[str, Callable[..., int]] = {"grpo": peer_grpo, "gae": peer_gae}


# ------------------------------------------------------------------ tracedb


def tracedb_stamp(db: Any, algorithm: str) -> dict[str, Any]:
    """``tracedb.credit.run``: compute, create the set and write it, in one transaction."""
    return tracedb.credit.run(db, algorithm, SET_NAMES[algorithm], replace=True, **ALGORITHMS[algorithm])


def tracedb_compute(db: Any, algorithm: str) -> pa.Table:
    """``tracedb.credit.compute``: the algorithm's credit table, nothing written."""
    return tracedb.credit.compute(db, algorithm, **ALGORITHMS[algorithm])


def tracedb_floor(db: Any) -> None:
    """The floor of any stamp: one set created (``credit_sets.create``, replacing the one
    before, as the stamps do) and committed, with no credit in it."""
    with db.handle.transaction():
        credit_sets.create(db.handle, FLOOR_SET, algorithm="grpo", replace=True)


def empty_commit(db: Any) -> None:
    """An empty DuckDB transaction: BEGIN, COMMIT."""
    db.handle.con.execute("BEGIN TRANSACTION")
    db.handle.con.execute("COMMIT")


# ------------------------------------------------------------------ correctness


def peer_nodes(episodes: list[Any]) -> dict[tuple[str, int], list[float]]:
    """The peer's credit: ``(trace id, node index) -> node.advantages`` of every assigned node."""
    return {
        (trace.id, i): node.advantages
        for episode in episodes
        for trace in episode.traces
        for i, node in enumerate(trace.nodes)
        if node.advantages is not None
    }


def _close(got: np.ndarray, want: np.ndarray) -> bool:
    return len(got) == len(want) and bool(np.all(np.abs(got - want) <= RTOL * np.abs(want) + ATOL))


def compare_nodes(name: str, table: pa.Table, column: str, expected: dict[tuple[str, int], list[float]]) -> int:
    """``table`` (trace_id, node_index, ``column``: float lists) holds exactly the peer's
    assigned nodes with the peer's values at float32 precision. Returns the nodes compared."""
    keys = list(zip(table["trace_id"].to_pylist(), table["node_index"].to_pylist()))
    col = table[column].combine_chunks()
    offsets = col.offsets.to_numpy()
    values = col.values.to_numpy(zero_copy_only=False)
    failures: list[str] = []
    if len(set(keys)) != len(keys):
        failures.append("a node appears twice")
    for i, key in enumerate(keys):
        want = expected.get(key)
        where = f"trace {key[0]} node {key[1]}"
        if want is None:
            failures.append(f"{where}: assigned by tracedb, not by the peer")
            continue
        got = values[offsets[i] : offsets[i + 1]]
        want_arr = np.asarray(want, np.float64)
        if not _close(got, want_arr):
            diff = f"{len(got)} values vs {len(want_arr)}"
            if len(got) == len(want_arr):
                j = int(np.argmax(np.abs(got - want_arr)))
                diff = f"token {j}: tracedb {got[j]!r}, peer {want_arr[j]!r}"
            failures.append(f"{where}: differs ({diff})")
    for key in sorted(set(expected) - set(keys))[:5]:
        failures.append(f"trace {key[0]} node {key[1]}: assigned by the peer, not by tracedb")
    if failures:
        shown = "\n  ".join(failures[:10])
        raise CorrectnessError(
            f"{name}: tracedb's credit differs from the peer's ({len(failures)} problems):\n  {shown}"
        )
    return len(keys)


def stamped_nodes(db: Any, credit: str) -> pa.Table:
    """The set's credit per node (compact layout), read through the ``credit_advantages`` macro."""
    return db.sql(
        "SELECT trace_id, node_index, advantages FROM credit_advantages(?) WHERE advantages IS NOT NULL "
        "ORDER BY trace_id, node_index",
        [credit],
    )


def verify_branches(db: Any, credit: str, episodes: list[Any]) -> int:
    """``db.branches(credit=...)`` equals verifiers' ``Branch.advantages`` (spread by verifiers
    from the peer's node values) for every branch of every trace. Returns the branches checked."""
    view = db.branches(credit=credit, columns=["advantages"])
    row_of = {k: i for i, k in enumerate(zip(view["trace_id"].to_pylist(), view["branch_index"].to_pylist()))}
    col = view["advantages"].combine_chunks()
    offsets = col.offsets.to_numpy()
    values = col.values.to_numpy(zero_copy_only=False)
    valid = col.is_valid().to_numpy(zero_copy_only=False)
    failures: list[str] = []
    checked = 0
    for episode in episodes:
        for trace in episode.traces:
            for branch in trace.branches:
                where = f"trace {trace.id} branch {branch.index}"
                i = row_of.pop((trace.id, branch.index), None)
                if i is None:
                    failures.append(f"{where}: missing from tracedb's view")
                    continue
                checked += 1
                want = branch.advantages
                if want is None or not valid[i]:
                    if (want is None) != (not valid[i]):
                        failures.append(f"{where}: advantages None in {'the peer' if want is None else 'tracedb'} only")
                    continue
                if not _close(values[offsets[i] : offsets[i + 1]], np.asarray(want, np.float64)):
                    failures.append(f"{where}: branch advantages differ")
    failures += [f"trace {t} branch {b}: in tracedb's view only" for t, b in list(row_of)[:5]]
    if failures:
        shown = "\n  ".join(failures[:10])
        raise CorrectnessError(f"{credit} branch view differs from verifiers' ({len(failures)} problems):\n  {shown}")
    return checked


def verify_compute(
    algorithm: str, table: pa.Table, expected: dict[tuple[str, int], list[float]], sampled_traces: set[str]
) -> int:
    """``compute``'s table against the peer: per trace (GRPO's layout) or per node (GAE's).
    A trace without sampled tokens has no node to stamp, so only ``sampled_traces`` count."""
    if "node_index" in table.column_names:
        return compare_nodes(f"{algorithm} compute", table, "values", expected)
    per_trace: dict[str, set[float]] = {}
    for (trace_id, _), values in expected.items():
        per_trace.setdefault(trace_id, set()).update(values)
    failures = [
        f"trace {t}: the peer gave its nodes {len(v)} different values" for t, v in per_trace.items() if len(v) > 1
    ]
    want = {t: next(iter(v)) for t, v in per_trace.items() if len(v) == 1}
    got = {t: v for t, v in zip(table["trace_id"].to_pylist(), table["value"].to_pylist()) if t in sampled_traces}
    for trace_id in sorted(set(got) | set(want)):
        value, peer = got.get(trace_id), want.get(trace_id)
        if value is None or peer is None or not _close(np.array([value]), np.array([peer], np.float64)):
            failures.append(f"trace {trace_id}: compute gives {value!r}, the peer {peer!r}")
    if failures:
        shown = "\n  ".join(failures[:10])
        raise CorrectnessError(f"{algorithm} compute differs from the peer ({len(failures)} problems):\n  {shown}")
    return len(got)


# ------------------------------------------------------------------ profile


class _TimedConnection:
    """Stands in for ``db.con`` during a profiled call: times every statement tracedb sends
    (``execute``; ``sql`` up to its Arrow result; ``register``/``unregister``)."""

    def __init__(self, con: Any) -> None:
        self._con = con
        self.log: list[tuple[str, float]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._con, name)

    def _time(self, label: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.log.append((label, time.perf_counter() - start))

    def execute(self, query: str, *args: Any, **kwargs: Any) -> Any:
        return self._time(" ".join(query.split()), self._con.execute, query, *args, **kwargs)

    def register(self, name: str, *args: Any) -> Any:
        return self._time(f"register {name}", self._con.register, name, *args)

    def unregister(self, name: str) -> Any:
        return self._time(f"unregister {name}", self._con.unregister, name)

    def sql(self, query: str, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        rel = self._con.sql(query, *args, **kwargs)
        label = " ".join(query.split())
        if rel is None:
            self.log.append((label, time.perf_counter() - start))
            return None
        log = self.log

        class _Relation:
            def __getattr__(self, name: str) -> Any:
                return getattr(rel, name)

            def to_arrow_table(self) -> pa.Table:
                out = rel.to_arrow_table()
                log.append((label, time.perf_counter() - start))
                return out

        return _Relation()


def profile(db: Any, algorithm: str, runs: int = 3) -> dict[str, Any]:
    """Where one ``run`` spends its time: every DuckDB statement (median over ``runs``
    instrumented runs, untimed by the benchmark) and the Python around them."""
    totals: list[float] = []
    logs: list[list[tuple[str, float]]] = []
    real = db.handle.con
    for _ in range(runs):
        spy = _TimedConnection(real)
        db.handle.con = spy
        try:
            start = time.perf_counter()
            tracedb_stamp(db, algorithm)
            totals.append(time.perf_counter() - start)
        finally:
            db.handle.con = real
        logs.append(spy.log)
    shape = [label for label, _ in logs[0]]
    if any([label for label, _ in log] != shape for log in logs):
        logs = logs[:1]  # statements differ between runs: report the first run only
    statements = [
        {"statement": label, "seconds": statistics.median(log[i][1] for log in logs)} for i, label in enumerate(shape)
    ]
    total = statistics.median(totals)
    sql = sum(s["seconds"] for s in statements)
    return {"total_seconds": total, "sql_seconds": sql, "python_seconds": total - sql, "statements": statements}


# ------------------------------------------------------------------ the run


def run(files: WorkloadFiles, workdir: Path, repeat: int, *, log: Callable[[str], None]) -> dict[str, Any]:
    """Measure both algorithms on both sides; returns the results (see :func:`render`)."""
    frame = Run()
    rundir = workdir / "credit"
    rundir.mkdir(parents=True, exist_ok=True)
    db_path = rundir / "tracedb.duckdb"
    remove_db(db_path)

    # Setup, untimed: the peer's episodes in memory, tracedb's database built by ingest.
    log("peer: read_episodes (untimed)")
    read_start = time.perf_counter()
    episodes = peer_read(files.dir)
    read_seconds = time.perf_counter() - read_start
    log("tracedb: ingest (untimed)")
    _, ingest_seconds = ingest_checked(files.jsonl, db_path)

    db = tracedb.connect(db_path)
    try:
        stats = db.stats()
        sampled = stats["sampled_tokens"]
        per_trace = {t.id: sum(n.mask.count(True) for n in t.nodes) for e in episodes for t in e.traces}
        peer_sampled = sum(per_trace.values())
        sampled_traces = {t for t, n in per_trace.items() if n}
        if peer_sampled != sampled:
            raise CorrectnessError(f"sampled tokens: verifiers counts {peer_sampled}, tracedb {sampled}")

        m: dict[str, Metric] = {}
        for algorithm in ALGORITHMS:
            m[f"{algorithm}_stamp"] = Metric(
                f"{algorithm}_stamp", f"{algorithm}: stamp (tracedb compute + write)", "speedup", TARGETS[algorithm]
            )
            m[f"{algorithm}_compute"] = Metric(f"{algorithm}_compute", "  same, tracedb compute only", "speedup", None)
        # Peer column: the floor; tracedb column: the grpo stamp; ratio: stamp / floor.
        m["grpo_floor"] = Metric("grpo_floor", "grpo stamp vs floor (set created + commit)", "multiple", FLOOR_TARGET)
        empty: list[float] = []

        # Warm-ups, untimed: both sides once per algorithm (imports, query plans, first touch).
        for algorithm in ALGORITHMS:
            PEERS[algorithm](episodes, **ALGORITHMS[algorithm])
            tracedb_stamp(db, algorithm)
            tracedb_compute(db, algorithm)
        tracedb_floor(db)

        correctness: dict[str, Any] = {"passed": False, "rtol": RTOL, "atol": ATOL}
        for r, peer_first in repeats(repeat, log):
            for algorithm, params in ALGORITHMS.items():
                name = SET_NAMES[algorithm]
                (tp, peer_count), (tt, result) = pair(
                    partial(PEERS[algorithm], episodes, **params), partial(tracedb_stamp, db, algorithm), peer_first
                )
                m[f"{algorithm}_stamp"].add(tp, tt)
                if result["nodes"] != peer_count:
                    raise CorrectnessError(f"{algorithm}: tracedb stamped {result['nodes']} nodes, peer {peer_count}")
                expected = peer_nodes(episodes)
                checked = compare_nodes(f"{name} (repeat {r + 1})", stamped_nodes(db, name), "advantages", expected)
                tc, table = timed(partial(tracedb_compute, db, algorithm))
                m[f"{algorithm}_compute"].add(tp, tc)
                if r == 0:
                    log(f"verifying {name} against the peer (nodes, branch view, compute table)")
                    correctness[algorithm] = {
                        "nodes": checked,
                        "branches": verify_branches(db, name, episodes),
                        "compute_rows": verify_compute(algorithm, table, expected, sampled_traces),
                    }
                del table, expected
                if algorithm == "grpo":
                    floor, _ = timed(partial(tracedb_floor, db))
                    m["grpo_floor"].add(floor, tt)
                    empty.append(timed(partial(empty_commit, db))[0].wall)

        correctness["passed"] = True
        correctness["repeats_checked"] = repeat
        log("profiling tracedb's stamp (instrumented, untimed)")
        profiles = {algorithm: profile(db, algorithm) for algorithm in ALGORITHMS}
    finally:
        db.close()

    for metric in m.values():
        metric.notes = {
            "peer_s_per_M_sampled": statistics.median(metric.peer) / (sampled / 1e6),
            "tracedb_s_per_M_sampled": statistics.median(metric.tracedb) / (sampled / 1e6),
        }
    for algorithm in ALGORITHMS:
        stamp, compute = m[f"{algorithm}_stamp"], m[f"{algorithm}_compute"]
        stamp.notes["tracedb_write_seconds"] = statistics.median(stamp.tracedb) - statistics.median(compute.tracedb)

    return frame.results(
        workload={**files.manifest, "path": str(files.jsonl)},
        database=stats,
        sampled_tokens=sampled,
        algorithms={a: {"set": SET_NAMES[a], "params": p} for a, p in ALGORITHMS.items()},
        setup_seconds={"peer_read_episodes": round(read_seconds, 2), "tracedb_ingest": round(ingest_seconds, 2)},
        repeat=repeat,
        metrics=m,
        correctness=correctness,
        profile=profiles,
        floor={
            "set_created_and_committed": m["grpo_floor"].to_dict()["peer"],
            "empty_commit_seconds": {"median": statistics.median(empty), "min": min(empty), "samples": empty},
        },
    )


# ------------------------------------------------------------------ output


def render(results: dict[str, Any]) -> str:
    """The table, then the workload, setup, correctness, machine and profile lines."""
    header = ("metric", "peer median (min)", "tracedb median (min)", "ratio", "target", "result")
    header += ("peer s/M sampled", "tracedb s/M sampled")

    def per_sampled(d: dict[str, Any]) -> tuple[str, str]:
        return f"{d['notes']['peer_s_per_M_sampled']:.4f}", f"{d['notes']['tracedb_s_per_M_sampled']:.4f}"

    lines = tables.metric_table(results["metrics"], header, digits=4, extra=per_sampled)

    w, db = results["workload"], results["database"]
    setup = results["setup_seconds"]
    c = results["correctness"]
    metrics = results["metrics"]
    floor = results["floor"]
    lines += [
        "",
        f"floor (same run): one set created and committed {floor['set_created_and_committed']['median'] * 1e3:.2f} ms "
        f"median ({floor['set_created_and_committed']['min'] * 1e3:.2f} ms min), an empty BEGIN/COMMIT "
        f"{floor['empty_commit_seconds']['median'] * 1e3:.2f} ms; grpo stamp = "
        f"{metrics['grpo_floor']['ratio']:.1f}x the floor",
        f"workload: {w['traces']} traces in groups of {w['params']['group_size']}, {db['nodes']:,} nodes, "
        f"{db['branches']} branches, {results['sampled_tokens']:,} sampled tokens "
        f"({w['tokens']:,} node tokens); gae gamma={GAMMA:g} lam={LAM:g}",
        f"setup, untimed: peer read_episodes {setup['peer_read_episodes']:.1f}s (objects kept in memory), "
        f"tracedb ingest {setup['tracedb_ingest']:.1f}s; tracedb write share of the stamp: "
        + ", ".join(f"{a} {metrics[f'{a}_stamp']['notes']['tracedb_write_seconds'] * 1e3:.1f} ms" for a in ALGORITHMS),
        "correctness: "
        + "; ".join(
            f"{a} {c[a]['nodes']:,} nodes and {c[a]['branches']} branches equal the peer's"
            for a in ALGORITHMS
            if a in c
        )
        + f" (rtol {RTOL:g}, atol {ATOL:g}; nodes checked every repeat): "
        + ("PASSED" if c["passed"] else "FAILED"),
        tables.machine_line(results),
    ]
    lines += tables.cpu_ratio_lines(metrics)
    lines += tables.load_lines(results["other_load"])
    for algorithm, p in results["profile"].items():
        lines.append(
            f"profile {algorithm} stamp (instrumented, median of 3 runs): {p['total_seconds'] * 1e3:.1f} ms = "
            f"{p['sql_seconds'] * 1e3:.1f} ms in {len(p['statements'])} DuckDB calls + "
            f"{p['python_seconds'] * 1e3:.1f} ms Python; largest calls:"
        )
        for s in sorted(p["statements"], key=lambda s: -s["seconds"])[:5]:
            lines.append(f"  {s['seconds'] * 1e3:6.1f} ms  {s['statement'][:100]}")
    return "\n".join(lines)
