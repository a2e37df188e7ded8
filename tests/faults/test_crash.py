"""Crash injection: a tracedb operation in a child process, killed with SIGKILL.

Each operation is first run once uninterrupted (in a child, on a copy of its starting
file), which gives the state it ends in and how long it runs: from the parent's ``GO``
(the child has imported tracedb and loaded what the operation compiles; it then opens
the database) to its ``DONE`` (after it closed it). Then it is run again on fresh copies
and killed: at random moments drawn from that window (seeded, see
``TRACEDB_FAULT_SEED``; for a first ingest also from its first milliseconds, where the
file is created), stopped at chosen points (just before / after its COMMIT, before / after
the export's rename; the child prints a marker there and waits, see
:mod:`support.faults`), and right when it says it is about to COMMIT (the kill then lands
inside the COMMIT, or just after it).

After each kill: the file opens read-only and read-write, holds exactly the state before
or exactly the state after the operation (every table row by row, the clock columns left
out, and a checksum of ``db.branches()``), the state the child's markers call for when they
call for one (a COMMIT that returned is there; one never begun is not), no half file is at
an export's path (the old file or none) nor at a new database's path, and running the
operation again gives exactly what the uninterrupted run gave.
"""

from __future__ import annotations

import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

import tracedb
import tracedb.credit
from tracedb import runtime
from tracedb.errors import DatabaseError

from support import FIXTURES
from support.faults import Child, base_seed, branch_digest, contents, differing, run_operation
from support.ingested import FIXTURE_FILES, episodes_of, renamed, write_jsonl

SEED = base_seed()
RANDOM_KILLS = 4
COPIES = 3
"""Renamed copies of every fixture file an ingest reads (so it runs several batches)."""
LOOKAHEAD = 2
"""Children started ahead of their run (each imports and warms up while earlier runs go)."""
EARLY = 0.015
"""Seconds after GO in which a first open creates its file."""
SETTINGS = {"scanner": "always", "batch_tokens": 20_000}


@dataclass(frozen=True)
class Op:
    name: str
    spec: dict[str, Any]
    start: str | None
    """The template file the operation starts from (None: no file yet)."""
    marks: tuple[str, ...]
    """Markers to stop the child at, one kill each."""
    commit: int = 1
    """Which COMMIT of the child is the operation's own."""
    credit: str | None = None
    early: int = 0
    """Kills drawn from the first EARLY seconds only (where a new file is created)."""


OPS = [
    Op("ingest_existing", {"op": "ingest"}, "base", ("before-commit:1", "after-commit:1")),
    Op(
        "ingest_new",
        {"op": "ingest"},
        None,
        ("before-commit:1", "after-commit:1", "before-commit:2", "after-commit:2"),
        commit=2,
        early=3,
    ),
    Op(
        "grpo",
        {"op": "credit", "algorithm": "grpo", "name": "g"},
        "full",
        ("before-commit:1", "after-commit:1"),
        1,
        "g",
    ),
    Op(
        "gae",
        {"op": "credit", "algorithm": "gae", "name": "g2"},
        "full",
        ("before-commit:1", "after-commit:1"),
        1,
        "g2",
    ),
    Op("write_nodes", {"op": "write_nodes", "stream": "entropies"}, "full", ("before-commit:1", "after-commit:1")),
    Op("export", {"op": "export"}, "full", ("before-replace:1", "after-replace:1")),
]


@dataclass
class State:
    tables: dict[str, list[str]] | None
    """None: there is no database file."""
    digest: str | None = None
    credit_digest: str | None = None

    def same(self, other: State) -> bool:
        return (self.tables, self.digest, self.credit_digest) == (other.tables, other.digest, other.credit_digest)


@dataclass
class World:
    root: Path
    inputs: list[str]
    templates: dict[str, Path] = field(default_factory=dict)
    empty: State | None = None
    """What a freshly installed database holds."""
    old_export: Path | None = None


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    root = tmp_path_factory.mktemp("crash")
    for k in range(COPIES):
        for f in FIXTURE_FILES:
            write_jsonl(root / "inputs" / f"c{k}" / f.name, [renamed(e, f"-c{k}") for e in episodes_of(f)])
    w = World(root, [str(root / "inputs" / f"c{k}") for k in range(COPIES)])
    with runtime.configure(**SETTINGS):
        with tracedb.connect(root / "empty.duckdb") as db:
            w.empty = State(contents(db), branch_digest(db))
        w.templates["base"] = root / "base.duckdb"
        with tracedb.connect(w.templates["base"]) as db:
            assert db.ingest(FIXTURE_FILES).ok
        w.templates["full"] = root / "full.duckdb"
        shutil.copy(w.templates["base"], w.templates["full"])
        with tracedb.connect(w.templates["full"]) as db:
            assert db.ingest(w.inputs).ok
            # The sets the credit operations replace exist already, with other values.
            tracedb.credit.run(db, "grpo", "g", scale_std=True)
            tracedb.credit.run(db, "gae", "g2", gamma=0.5)
            w.old_export = root / "old.parquet"
            db.export(w.old_export, columns=["token_ids"])
    return w


def read_state(path: Path, op: Op, *, read_only: bool) -> State:
    with tracedb.connect(path, read_only=read_only) as db:
        tables = contents(db)
        credit = branch_digest(db, op.credit) if op.credit and db.has_credit_set(op.credit) else None
        return State(tables, branch_digest(db), credit)


def prepare(world: World, op: Op, run: Path, *, old_export: bool) -> dict[str, Any]:
    """A fresh copy of the operation's starting file in ``run``; the child's spec."""
    run.mkdir()
    db = run / "db.duckdb"
    if op.start is not None:
        shutil.copy(world.templates[op.start], db)
    spec = {**op.spec, "db": str(db), "settings": SETTINGS, "warm": str(FIXTURES / "linear.traces.jsonl")}
    if op.spec["op"] == "ingest":
        spec["paths"] = world.inputs
    if op.spec["op"] == "export":
        spec["export"] = str(run / "out.parquet")
        if old_export:
            assert world.old_export is not None
            shutil.copy(world.old_export, spec["export"])
    return spec


def spawn(spec: dict[str, Any], plan: tuple[str, Any]) -> Child:
    """The child of one run (it imports and warms up, then waits for GO)."""
    if plan[0] == "stall":
        spec = {**spec, "stall": plan[1]}
    return Child(spec, Path(spec["db"]).parent)


def kill_run(child: Child, plan: tuple[str, Any]) -> tuple[list[str], int]:
    """Start the child's operation and kill it as ``plan`` says: ("delay", seconds after
    GO), ("stall", marker: stopped there) or ("race", marker: killed as soon as it says it)."""
    with child:
        child.go()
        kind, arg = plan
        if kind == "delay":
            time.sleep(arg)
        elif kind == "stall":
            child.expect("STALLED")
        else:
            child.expect(f"MARK {arg}")
        code = child.kill()
        child.close()
        while not child.lines.empty():
            line = child.lines.get_nowait()[1]
            if line is not None:
                child.seen.append(line)
        if code not in (0, -9) or (code == 0 and not any(s.startswith("DONE") for s in child.seen)):
            raise AssertionError(f"the child failed on its own: {child.describe()}")
        assert kind != "stall" or code == -9, child.describe()
        return child.seen, code


def uninterrupted(world: World, op: Op, tmp: Path) -> tuple[State, State, float, Any]:
    """The state before, the state after, the operation's duration, and its export."""
    spec = prepare(world, op, tmp / "reference", old_export=False)
    db = Path(spec["db"])
    before = read_state(db, op, read_only=True) if db.exists() else world.empty
    with Child(spec, db.parent) as child:
        started = child.go()
        done, _ = child.expect("DONE")
        assert child.proc.wait(timeout=30) == 0, child.describe()
    after = read_state(db, op, read_only=True)
    exported = pq.read_table(spec["export"]) if "export" in spec else None
    if op.spec["op"] == "export":
        assert after.same(before), "an export changed the database"
        assert exported is not None and exported.num_rows > 0
    else:
        assert not after.same(before), f"{op.name} changed nothing: the test would prove nothing"
    return before, after, done - started, exported


def check_export(spec: dict[str, Any], seen: list[str], reference: Any, world: World, had_old: bool) -> str:
    """The export path holds the old file (or none) or the whole new one; which it is."""
    out = Path(spec["export"])
    assert world.old_export is not None
    if out.exists() and had_old and out.read_bytes() == world.old_export.read_bytes():
        found = "before"
    elif not out.exists():
        assert not had_old, "the old export file is gone"
        found = "before"
    else:
        table = pq.read_table(out)  # a half file does not read
        assert table.equals(reference), "the file at the export path is not the export"
        found = "after"
    if "MARK after-replace:1" in seen:
        assert found == "after", "the export was renamed into place, yet the path does not hold it"
    if "MARK before-replace:1" not in seen:
        assert found == "before", "the export path changed before the export was renamed into place"
    leftovers = [
        p.name for p in out.parent.iterdir() if p.suffix != ".stderr" and p.name not in ("db.duckdb", "out.parquet")
    ]
    assert all(n.startswith(".out.parquet.") and n.endswith(".partial") for n in leftovers), leftovers
    return found


def open_after_kill(db: Path, op: Op, world: World) -> State:
    """The state a killed run left, read read-only and then read-write (which must agree)."""
    ours = {"db.duckdb", "db.duckdb.wal"}
    strays = [p.name for p in db.parent.iterdir() if p.suffix != ".stderr" and p.name not in ours]
    # a first open killed while it made the file leaves at most its hidden temporary file
    assert all(n.startswith(".db.duckdb.") and n.endswith(".creating") for n in strays), strays
    if op.start is None and not db.exists():
        assert not Path(f"{db}.wal").exists(), "a WAL without its database file"
        assert world.empty is not None
        return world.empty  # killed before the file was made: nothing, as before
    try:
        seen_ro: State | None = read_state(db, op, read_only=True)
    except DatabaseError as e:
        # A first install that never committed: a read-only open may refuse the file; the
        # read-write open below must finish it.
        assert op.start is None, f"read-only open refused the file: {e}"
        assert "not a tracedb database" in str(e) or "cut short" in str(e), e
        seen_ro = None
    seen_rw = read_state(db, op, read_only=False)
    if seen_ro is not None:
        assert seen_rw.same(seen_ro), (
            f"read-only and read-write opens differ: {differing(seen_ro.tables, seen_rw.tables)}"
        )
    return seen_rw


def check_kill(
    op: Op,
    spec: dict[str, Any],
    seen: list[str],
    code: int,
    world: World,
    before: State,
    after: State,
    reference: Any,
    where: str,
    *,
    had_old: bool,
) -> str:
    """What a kill left is all or nothing of the operation, as the markers call for; which."""
    db = Path(spec["db"])
    if op.spec["op"] == "export":
        found = check_export(spec, seen, reference, world, had_old=had_old)
        assert read_state(db, op, read_only=True).same(before), f"{where}: an export changed the database"
        return found
    state = open_after_kill(db, op, world)
    if state.tables == before.tables:
        found = "before"
        assert state.same(before), f"{where}: the tables are as before, the branch view is not"
    elif state.same(after):
        found = "after"
    else:
        from_before = differing(before.tables or {}, state.tables or {})
        from_after = differing(after.tables or {}, state.tables or {})
        raise AssertionError(f"{where}: not all, not nothing: differs from before {from_before}, after {from_after}")
    if f"MARK after-commit:{op.commit}" in seen or code == 0:
        assert found == "after", f"{where}: a COMMIT that returned is lost"
    if f"MARK before-commit:{op.commit}" not in seen:
        assert found == "before", f"{where}: written before its COMMIT began"
    return found


@pytest.mark.parametrize("op", OPS, ids=[o.name for o in OPS])
def test_kill(op: Op, world: World, tmp_path: Path) -> None:
    rng = random.Random(f"{SEED}:{op.name}")
    before, after, window, reference = uninterrupted(world, op, tmp_path)
    plans: list[tuple[str, Any]] = [("delay", rng.uniform(0.0, window)) for _ in range(RANDOM_KILLS)]
    plans += [("delay", rng.uniform(0.0, min(EARLY, window))) for _ in range(op.early)]
    plans += [("stall", m) for m in op.marks]
    plans.append(("race", op.marks[0]))
    print(f"seed {SEED} ({op.name}): window {window:.3f} s, plans {plans}")
    outcomes = []
    specs = [prepare(world, op, tmp_path / f"kill{i}", old_export=i % 2 == 0) for i in range(len(plans))]
    children = [spawn(specs[i], plans[i]) for i in range(min(LOOKAHEAD, len(plans)))]
    try:
        for i, plan in enumerate(plans):
            where = f"seed {SEED}, {op.name}, kill {i} {plan}"
            seen, code = kill_run(children[i], plan)
            if i + LOOKAHEAD < len(plans):  # later children import while this run is checked
                children.append(spawn(specs[i + LOOKAHEAD], plans[i + LOOKAHEAD]))
            found = check_kill(op, specs[i], seen, code, world, before, after, reference, where, had_old=i % 2 == 0)
            outcomes.append((plan, code, found))
            rerun(op, specs[i], after, reference, where)
    finally:
        for child in children:
            child.close()
    print(f"outcomes: {outcomes}")
    assert {f for _, _, f in outcomes} == {"before", "after"}, f"the kills did not land on both sides: {outcomes}"


def rerun(op: Op, spec: dict[str, Any], after: State, reference: Any, where: str) -> None:
    """The operation again, in this process, on what the kill left: the uninterrupted result."""
    db = Path(spec["db"])
    with runtime.configure(**spec["settings"]):
        with tracedb.connect(db, read_only=op.spec["op"] == "export") as database:
            run_operation(database, spec)
    if op.spec["op"] == "export":
        assert pq.read_table(spec["export"]).equals(reference), f"{where}: the export again differs"
        return
    state = read_state(db, op, read_only=True)
    assert state.same(after), f"{where}: run again, it differs from an uninterrupted run: " + str(
        differing(after.tables or {}, state.tables or {})
    )
