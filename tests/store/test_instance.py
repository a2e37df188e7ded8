"""Databases attached to the process's one DuckDB instance (tracedb/runtime.py)."""

from __future__ import annotations

import gc
import multiprocessing
import os
import shutil
import sys
import threading
from pathlib import Path

import duckdb
import pytest

import tracedb

from support import FIXTURES

LINEAR = FIXTURES / "linear.traces.jsonl"


def plain_open_works(path: Path) -> bool:
    """A plain DuckDB client can open the file for writing: tracedb let go of it."""
    con = duckdb.connect(str(path))
    con.close()
    return True


def test_a_second_database_gets_its_own_schema(tmp_path: Path) -> None:
    """Another database attached to the instance must not make a fresh file look installed."""
    with tracedb.connect(tmp_path / "a.duckdb") as a:
        a.ingest(LINEAR)
        with tracedb.connect(tmp_path / "b.duckdb") as b:
            assert b.sql("SELECT count(*) AS n FROM traces").column("n").to_pylist() == [0]
            assert b.stats()["traces"] == 0
        assert a.stats()["traces"] == 1


def test_same_file_twice_shares_one_attachment(tmp_path: Path) -> None:
    path = tmp_path / "runs.duckdb"
    first = tracedb.connect(path)
    second = tracedb.connect(path)
    first.ingest(LINEAR)
    assert second.stats()["traces"] == 1  # one database, seen through both
    first.close()
    assert second.branches().num_rows > 0  # still attached for the other user
    second.close()
    assert plain_open_works(path)


def test_other_mode_in_the_same_process_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "runs.duckdb"
    with tracedb.connect(path) as db:
        db.ingest(LINEAR)
        with pytest.raises(duckdb.ConnectionException, match="already open read-write"):
            tracedb.connect(path, read_only=True)
    with tracedb.connect(path, read_only=True) as ro:
        assert ro.stats()["traces"] == 1
        with pytest.raises(duckdb.ConnectionException, match="already open read-only"):
            tracedb.connect(path)


def test_close_checkpoints_and_lets_go(tmp_path: Path) -> None:
    path = tmp_path / "runs.duckdb"
    db = tracedb.connect(path)
    db.ingest(LINEAR)
    db.close()
    db.close()  # idempotent
    assert not Path(str(path) + ".wal").exists()
    con = duckdb.connect(str(path), read_only=True)
    try:
        assert con.execute("SELECT count(*) FROM traces").fetchall() == [(1,)]
    finally:
        con.close()


def test_a_forgotten_database_is_detached_when_collected(tmp_path: Path) -> None:
    path = tmp_path / "runs.duckdb"
    db = tracedb.connect(path)
    db.ingest(LINEAR)
    del db
    gc.collect()
    assert plain_open_works(path)
    with tracedb.connect(path, read_only=True) as again:
        assert again.stats()["traces"] == 1


def test_memory_databases_are_independent() -> None:
    with tracedb.connect() as a, tracedb.connect() as b:
        a.ingest(LINEAR)
        assert a.stats()["traces"] == 1
        assert b.stats()["traces"] == 0


def test_a_reopened_file_is_read_again(tmp_path: Path) -> None:
    """Nothing of a closed file is served from memory: replace the file, see the new one."""
    one, two, path = tmp_path / "one.duckdb", tmp_path / "two.duckdb", tmp_path / "runs.duckdb"
    with tracedb.connect(one) as db:
        db.ingest(LINEAR)
    with tracedb.connect(two) as db:
        db.ingest(FIXTURES)
    shutil.copy(one, path)
    with tracedb.connect(path, read_only=True) as db:
        first = db.branches()
    shutil.copy(two, path)
    with tracedb.connect(path, read_only=True) as db:
        second = db.branches()
    assert first.num_rows < second.num_rows
    assert set(first.column("trace_id").to_pylist()) < set(second.column("trace_id").to_pylist())


def test_cursor_reads_the_same_database_from_another_thread(tmp_path: Path) -> None:
    with tracedb.connect(tmp_path / "runs.duckdb") as db, tracedb.connect(tmp_path / "other.duckdb"):
        db.ingest(LINEAR)
        found: list[object] = []

        def read() -> None:
            con = db.cursor()
            try:
                found.append(con.execute("SELECT count(*) FROM traces").fetchall()[0][0])
            finally:
                con.close()

        thread = threading.Thread(target=read)
        thread.start()
        thread.join()
        assert found == [1]


def test_isolated_settings_stay_with_their_database(tmp_path: Path) -> None:
    with tracedb.connect(tmp_path / "a.duckdb") as shared:
        before = shared.con.execute("SELECT current_setting('threads')").fetchall()[0][0]
        with tracedb.connect(tmp_path / "b.duckdb", isolated=True) as own:
            own.con.execute("SET threads = 1")
            assert own.con.execute("SELECT current_setting('threads')").fetchall()[0][0] == 1
            own.ingest(LINEAR)
            assert own.branches().num_rows > 0
        assert shared.con.execute("SELECT current_setting('threads')").fetchall()[0][0] == before
    assert plain_open_works(tmp_path / "b.duckdb")


def _child_opens(path: str, queue: multiprocessing.Queue) -> None:
    with tracedb.connect(path, read_only=True) as db:
        queue.put(db.branches().num_rows)


def branches_in_a_forked_child(path: Path) -> int:
    """The number of branches a forked child reads from ``path`` (it must exit cleanly)."""
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_opens, args=(str(path), queue))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    return queue.get(timeout=5)


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="needs fork")
def test_a_forked_child_opens_databases_of_its_own(tmp_path: Path) -> None:
    path = tmp_path / "runs.duckdb"
    with tracedb.connect(path) as db:
        db.ingest(FIXTURES)
        expected = db.branches().num_rows
    with tracedb.connect(tmp_path / "held.duckdb"):  # the instance exists and holds a file at the fork
        assert branches_in_a_forked_child(path) == expected


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="needs fork")
def test_a_forked_child_opens_the_file_its_parent_holds(tmp_path: Path) -> None:
    """DataLoader workers reading the database the parent keeps open: DuckDB's registry
    of open files is inherited, so the child must go through the inherited instance."""
    path = tmp_path / "runs.duckdb"
    with tracedb.connect(path) as db:
        db.ingest(FIXTURES)
        expected = db.branches().num_rows
    with tracedb.connect(path, read_only=True) as held:
        assert branches_in_a_forked_child(path) == expected
        assert held.branches().num_rows == expected  # the child's close left the parent's attachment alone


def test_spills_go_to_the_temp_directory_not_the_working_directory(tmp_path: Path) -> None:
    import tempfile

    with tracedb.connect(tmp_path / "runs.duckdb") as db:
        spill = db.con.execute("SELECT current_setting('temp_directory')").fetchall()[0][0]
    assert Path(spill).is_absolute() and Path(spill).parent == Path(tempfile.gettempdir())


def test_a_database_collected_while_the_registry_is_locked_is_released_later(tmp_path: Path) -> None:
    """A garbage collector's finalizer may run inside this module's lock (same thread):
    the release must be queued, not block on the lock."""
    from tracedb import runtime

    path = tmp_path / "runs.duckdb"
    db = tracedb.connect(path)
    db.ingest(LINEAR)
    cycle: list[object] = [db]
    cycle.append(cycle)  # only the cyclic collector frees it
    del db
    inst = runtime._instance()
    done = threading.Event()

    def collect_under_the_lock() -> None:
        nonlocal cycle
        with inst.lock:
            del cycle
            gc.collect()  # runs the finalizer here
        done.set()

    thread = threading.Thread(target=collect_under_the_lock, daemon=True)
    thread.start()
    thread.join(20)
    assert done.is_set(), "the finalizer blocked on the registry lock"
    assert not runtime.is_attached(str(path))  # the queued release was done
    assert plain_open_works(path)


def test_a_file_a_plain_client_holds_is_opened_through_that_client(tmp_path: Path) -> None:
    """duckdb.connect first, tracedb second: DuckDB refuses a second instance on the file,
    so tracedb joins the plain client's instance (as duckdb.connect itself does)."""
    path = tmp_path / "runs.duckdb"
    with tracedb.connect(path) as db:
        db.ingest(LINEAR)
    plain = duckdb.connect(str(path))
    try:
        with tracedb.connect(path) as db:
            assert db.stats()["traces"] == 1
            assert db.handle.catalog is None  # its own connection to the plain client's instance
        assert plain.execute("SELECT count(*) FROM traces").fetchall() == [(1,)]
    finally:
        plain.close()


def test_in_memory_spellings() -> None:
    """ "" is a fresh in-memory database like ":memory:"; ":memory:name" is shared by name
    (as duckdb.connect has it) and writes no file."""
    with tracedb.connect("") as a, tracedb.connect("") as b:
        a.ingest(LINEAR)
        assert (a.stats()["traces"], b.stats()["traces"]) == (1, 0)
    with tracedb.connect(":memory:shared") as a, tracedb.connect(":memory:shared") as b:
        a.ingest(LINEAR)
        assert b.stats()["traces"] == 1
    assert not Path(":memory:shared").exists()


def test_close_refused_while_busy_can_be_retried(tmp_path: Path) -> None:
    path = tmp_path / "runs.duckdb"
    db = tracedb.connect(path)
    db.ingest(LINEAR)
    started, finish = threading.Event(), threading.Event()

    def busy() -> None:
        rows = db.con.execute("SELECT * FROM range(100000000)")  # a result left pending on db.con
        started.set()
        finish.wait(20)
        del rows

    thread = threading.Thread(target=busy)
    thread.start()
    started.wait(20)
    try:
        try:
            db.close()
        except duckdb.Error:
            pass  # DuckDB may refuse to close a connection another thread uses
    finally:
        finish.set()
        thread.join()
    db.close()  # a second close after the refusal closes for real
    assert plain_open_works(path)


def test_concurrent_ingests_put_the_checkpoint_threshold_back(tmp_path: Path, knobs) -> None:
    from tracedb.synthetic import write_sample

    files = [write_sample(tmp_path / f"t{i}.jsonl", groups=1, tokens_per_trace=4_000, seed=i) for i in range(2)]
    knobs(checkpoint_min_tokens=0)  # every ingest lowers the threshold around its commit
    with tracedb.connect(tmp_path / "a.duckdb") as a, tracedb.connect(tmp_path / "b.duckdb") as b:
        before = a.con.execute("SELECT current_setting('checkpoint_threshold')").fetchall()[0][0]
        errors: list[BaseException] = []

        def run(db: tracedb.Database, jsonl: Path) -> None:
            try:
                for _ in range(5):
                    db.ingest(jsonl)
                    db.sql("DELETE FROM branches; DELETE FROM node_store; DELETE FROM traces; DELETE FROM episodes")
            except BaseException as e:  # reported below
                errors.append(e)

        threads = [threading.Thread(target=run, args=pair) for pair in ((a, files[0]), (b, files[1]))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        assert a.con.execute("SELECT current_setting('checkpoint_threshold')").fetchall()[0][0] == before


def test_opening_a_file_open_elsewhere_in_the_process_does_not_reinstall(tmp_path: Path) -> None:
    """A shared attachment is installed once: concurrent read-write opens of one file do
    not race on CREATE OR REPLACE MACRO."""
    path = tmp_path / "runs.duckdb"
    errors: list[BaseException] = []
    with tracedb.connect(path):

        def open_close() -> None:
            try:
                for _ in range(20):
                    tracedb.connect(path).close()
            except BaseException as e:  # reported below
                errors.append(e)

        threads = [threading.Thread(target=open_close) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors


_FORK_EXIT = """
import os, sys
from pathlib import Path
import tracedb

path, fixture, own = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
wal = Path(str(path) + ".wal")
with tracedb.connect(path) as db:
    db.ingest(fixture)
    db.sql("INSERT INTO credit_sets (name, algorithm) VALUES ('x', 'y')")  # small: stays in the WAL
    assert wal.exists()
    before = (path.read_bytes(), wal.read_bytes())
    pid = os.fork()
    if pid == 0:  # the child: its own file, then the interpreter's normal shutdown
        with tracedb.connect(own) as mine:
            mine.ingest(fixture)
        sys.exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    print("unchanged" if (path.read_bytes(), wal.read_bytes()) == before else "CHANGED")
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_exiting_leaves_the_parents_file_alone(tmp_path: Path) -> None:
    """A child that exits normally must not checkpoint (rewrite) the file its parent has
    open for writing: the inherited instance is never destroyed in the child."""
    import subprocess

    args = [str(tmp_path / "runs.duckdb"), str(LINEAR), str(tmp_path / "own.duckdb")]
    done = subprocess.run([sys.executable, "-c", _FORK_EXIT, *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "unchanged"
    with tracedb.connect(tmp_path / "own.duckdb", read_only=True) as own:  # the child's own file was closed properly
        assert own.stats()["traces"] == 1


def test_the_memory_limit_setting_bounds_duckdb_and_is_put_back(tmp_path: Path, knobs) -> None:
    from tracedb import runtime

    with tracedb.connect(tmp_path / "a.duckdb") as db:
        default = runtime.memory_limit()
        with runtime.configure(memory_limit="300MB"):
            assert db.sql("SELECT current_setting('memory_limit') AS m").column("m")[0].as_py() == "286.1 MiB"
            db.ingest(FIXTURES / "linear.traces.jsonl")  # works under it
        assert runtime.memory_limit() == default
        with pytest.raises(ValueError, match="memory limit 'lots'.*512MB"):
            knobs(memory_limit="lots")
        assert runtime.memory_limit() == default


def test_the_memory_limit_comes_from_the_environment_for_a_fresh_process(tmp_path: Path) -> None:
    code = "import tracedb; from tracedb import runtime; tracedb.connect(':memory:'); print(runtime.memory_limit())"
    env = {**os.environ, "TRACEDB_MEMORY_LIMIT": "256MB"}
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "244.1 MiB"
    plain = {k: v for k, v in os.environ.items() if k != "TRACEDB_MEMORY_LIMIT"}
    out = subprocess.run([sys.executable, "-c", code], env=plain, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "1.0 GiB", out.stderr  # the default bound
    both = (
        "import duckdb, tracedb; from tracedb import runtime; tracedb.connect(':memory:'); "
        "own = duckdb.connect().sql(\"SELECT current_setting('memory_limit')\").fetchall()[0][0]; "
        "print(runtime.memory_limit(), '|', own)"
    )
    env = {**plain, "TRACEDB_MEMORY_LIMIT": "none"}
    out = subprocess.run([sys.executable, "-c", both], env=env, capture_output=True, text=True, timeout=60)
    ours, duckdbs = out.stdout.strip().split(" | ")
    assert ours.split()[1] == duckdbs.split()[1], out.stderr  # "none": DuckDB's own default (a share of
    assert abs(float(ours.split()[0]) - float(duckdbs.split()[0])) < 0.5  # the memory free now)
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "tracedb",
            "ingest",
            str(FIXTURES / "linear.traces.jsonl"),
            "--db",
            str(tmp_path / "x.duckdb"),
        ],
        env={**os.environ, "TRACEDB_MEMORY_LIMIT": "lots"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode != 0 and "Traceback" not in bad.stderr and "memory limit 'lots'" in bad.stderr + bad.stdout


def test_an_isolated_database_has_the_process_limits(tmp_path: Path, knobs) -> None:
    """``isolated=True`` (the REST server's user SQL) had DuckDB's defaults: 80% of the
    machine's memory and 90% of the free disk, spilling to ./.tmp. It has the process's."""
    import tempfile

    from tracedb import runtime

    setting = "SELECT current_setting('{}') AS v"
    knobs(memory_limit="300MB")
    with tracedb.connect(tmp_path / "own.duckdb", isolated=True) as own:

        def read(name: str) -> str:
            return own.con.execute(setting.format(name)).fetchall()[0][0]

        assert read("memory_limit") == "286.1 MiB" == runtime.memory_limit()
        assert read("max_temp_directory_size") == "16.0 GiB"
        spill = Path(read("temp_directory"))
        assert spill.parent == Path(tempfile.gettempdir()) and spill.name.startswith(f"tracedb-duckdb-{os.getpid()}-")
    plain = duckdb.connect(str(tmp_path / "plain.duckdb"))  # a client's own instance is not retuned
    try:
        mine = plain.execute(setting.format("memory_limit")).fetchall()[0][0]
        with tracedb.connect(tmp_path / "plain.duckdb"):
            pass
        assert plain.execute(setting.format("memory_limit")).fetchall()[0][0] == mine
    finally:
        plain.close()
    assert runtime.size_bytes("1.0 GiB") == 1 << 30 and runtime.size_bytes("244.1 MiB") == int(244.1 * (1 << 20))
    assert runtime.size_bytes("512 bytes") == 512 and runtime.size_bytes("lots") is None


def test_the_temp_limit_comes_from_the_environment(tmp_path: Path) -> None:
    import subprocess

    code = (
        "import tracedb; db = tracedb.connect(':memory:'); "
        "print(db.sql(\"SELECT current_setting('max_temp_directory_size') AS t\").column('t')[0])"
    )
    env = {**os.environ, "TRACEDB_TEMP_LIMIT": "2GiB"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "2.0 GiB", out.stderr
    env["TRACEDB_TEMP_LIMIT"] = "plenty"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "temp limit 'plenty'" in out.stderr
