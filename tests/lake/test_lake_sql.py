"""``lake.sql`` reads only what a query needs: its answers are those over every visible
row (and the file store's), and a query about one trace reads a file per table."""

from __future__ import annotations

import duckdb
import pyarrow as pa
import pytest

import tracedb
import tracedb.credit

from support import FIXTURES

pytest.importorskip("pyiceberg_core", reason="the lake extra is not installed (pip install '.[lake]')")

from pyiceberg.io.pyarrow import PyArrowFileIO  # noqa: E402

import tracedb.lake as lakes  # noqa: E402
from tracedb.lake import read, sqlplan, sqlscan  # noqa: E402
from tracedb.sqltext import load_sql  # noqa: E402


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """The golden fixtures with a per-trace credit set (grpo)."""
    path = tmp_path_factory.mktemp("store") / "runs.duckdb"
    with tracedb.connect(path) as db:
        db.ingest(FIXTURES)
        tracedb.credit.run(db, "grpo")
    return path


@pytest.fixture(scope="module")
def lake(store, tmp_path_factory):
    """The store pushed in writes of 8 traces (several files per bucket)."""
    lake = lakes.init(tmp_path_factory.mktemp("lake") / "L")
    lake.push(store, batch_traces=8)
    return lake


@pytest.fixture(scope="module")
def picks(store):
    with tracedb.connect(store, read_only=True) as db:
        ids = db.sql("SELECT trace_id FROM traces ORDER BY trace_id").column("trace_id").to_pylist()
        group = db.sql("SELECT min(group_id) AS g FROM traces").column("g")[0].as_py()
    return {"one": ids[len(ids) // 2], "two": ids[3:5], "group": group}


def _full(lake, query, params=None):
    """The query over every visible row (what lake.sql did before pushdown)."""
    con = duckdb.connect()
    for name, table in read.visible(lake).items():
        con.register(name, table)
    con.execute(load_sql("macros.sql"))
    return con.sql(query, params=params).to_arrow_table()


QUERIES = [
    ("SELECT * FROM nodes WHERE trace_id = $one ORDER BY ALL", None),
    ("SELECT trace_id, reward FROM traces WHERE trace_id IN $two ORDER BY ALL", None),
    ("SELECT trace_id, n_tokens FROM traces WHERE group_id = $group ORDER BY ALL", None),
    (
        "SELECT t.trace_id, n.node_index, n.role FROM traces t JOIN nodes n USING (trace_id) "
        "WHERE t.group_id = $group ORDER BY ALL",
        None,
    ),
    (
        "SELECT b.trace_id, count(*) AS n FROM branches b LEFT JOIN nodes n ON n.trace_id = b.trace_id "
        "WHERE b.trace_id IN $two GROUP BY ALL ORDER BY ALL",
        None,
    ),
    ("SELECT * FROM branch_stats() WHERE trace_id = $one ORDER BY ALL", None),
    ("SELECT * FROM branch_stats() ORDER BY ALL", None),
    ("SELECT * FROM node_tokens() WHERE trace_id = $one ORDER BY ALL", None),
    (
        "SELECT trace_id, branch_index, token_ids, advantages FROM branch_tokens(credit := 'grpo') "
        "WHERE trace_id = $one ORDER BY ALL",
        None,
    ),
    ("SELECT * FROM node_credit(credit := 'grpo') WHERE trace_id IN $two ORDER BY ALL", None),
    ("SELECT * FROM credit_dose(credit := 'grpo') WHERE trace_id = $one ORDER BY ALL", None),
    ("SELECT * FROM trace_summary() WHERE trace_id = $one ORDER BY ALL", None),
    ("SELECT count(*) AS n, sum(length(token_ids)) AS tokens FROM segments", None),
    ("SELECT credit_set, trace_id, value FROM trace_credit WHERE trace_id = ? ORDER BY ALL", "one"),
    ("SELECT trace_id FROM traces WHERE trace_id = ? OR reward > ? ORDER BY ALL", "one+"),
    ("SELECT count(*) AS n, sum(value) AS s FROM trace_credit", None),  # no credit_set column in the query
    ("SELECT trace_id FROM trace_credit JOIN traces USING (trace_id) WHERE group_id = $group ORDER BY ALL", None),
]


def _bind(query, params, picks):
    literal = {"$one": f"'{picks['one']}'", "$group": f"'{picks['group']}'"}
    literal["$two"] = "(" + ", ".join(f"'{t}'" for t in picks["two"]) + ")"
    for key, text in literal.items():
        query = query.replace(key, text)  # test data only (fixture ids): the queries stay readable
    bound = {None: None, "one": [picks["one"]], "one+": [picks["one"], 0.5]}[params]
    return query, bound


@pytest.mark.parametrize("query, params", QUERIES)
def test_answers_equal_full_reads_and_the_file_store(lake, store, picks, query, params):
    query, bound = _bind(query, params, picks)
    got, report = sqlscan.run(lake, query, bound)
    assert report.pushed
    with tracedb.connect(store, read_only=True) as db:
        expected = db.sql(query, params=bound)
    assert got.num_rows == expected.num_rows > 0
    assert got.equals(expected)
    assert got.equals(_full(lake, query, bound))
    assert lake.sql(query, bound).equals(got)


def test_seq_filters_are_the_lakes(lake, picks):
    query = "SELECT trace_id, seq FROM traces WHERE seq > 3 AND trace_id <> ? ORDER BY ALL"
    got, report = sqlscan.run(lake, query, [picks["one"]])
    assert got.num_rows > 0 and got.equals(_full(lake, query, [picks["one"]]))
    assert report.filters["traces"] == "AlwaysTrue()"  # seq is the commit's, never pushed to Iceberg


def _opened(monkeypatch):
    """Every data file pyiceberg opens, by table (counted beside the code under test)."""
    opened: list[str] = []
    real = PyArrowFileIO.new_input

    def counting(self, location):
        if location.endswith(".parquet") and "/data/" in location:
            opened.append(location.split("/warehouse/")[1].split("/")[1])
        return real(self, location)

    monkeypatch.setattr(PyArrowFileIO, "new_input", counting)
    return opened


def _data_files(lake, name):
    return sum(1 for _ in lake.table(name).scan().plan_files())


@pytest.mark.parametrize(
    "query, tables",
    [
        ("SELECT * FROM nodes WHERE trace_id = $one", {"traces", "nodes"}),
        (  # the policy versions read the trace's episode: one episodes file (its bucket) too
            "SELECT * FROM node_tokens() WHERE trace_id = $one",
            {"traces", "nodes", "segments", "episodes"},
        ),
        (
            "SELECT * FROM branch_tokens() WHERE trace_id = $one",
            {"traces", "nodes", "segments", "branches", "episodes"},
        ),
        (  # credit values show with their set's row: credit_sets is read too (small, whole)
            "SELECT * FROM credit_dose(credit := 'grpo') WHERE trace_id = $one",
            {"traces", "nodes", "trace_credit", "credit_sets"},
        ),
        ("SELECT * FROM branch_stats() WHERE trace_id = $one", {"traces", "nodes", "branches"}),
        ("SELECT * FROM trace_summary() WHERE trace_id = $one", {"traces", "nodes"}),
        ("SELECT * FROM branch_stats() WHERE trace_id = ?", {"traces", "nodes", "branches"}),
        ("SELECT * FROM branch_tokens() WHERE trace_id = ?", {"traces", "nodes", "segments", "branches", "episodes"}),
    ],
)
def test_a_one_trace_query_reads_a_file_per_table(lake, store, picks, monkeypatch, query, tables):
    params = [picks["one"]] if "?" in query else None
    query, _ = _bind(query, None, picks)
    opened = _opened(monkeypatch)
    got, report = sqlscan.run(lake, query, params)
    assert set(opened) == tables
    for name in tables - {"credit_sets"}:  # the trace's bucket, its write's file (segments beside it)
        assert opened.count(name) == 1 < _data_files(lake, name), name
    visible = read.visible(lake)
    assert report.rows["nodes"] < visible["nodes"].num_rows / 10
    with tracedb.connect(store, read_only=True) as db:
        want = db.sql(query, params)
    order = [(c, "ascending") for c in want.column_names if not pa.types.is_nested(want.schema.field(c).type)]
    assert got.sort_by(order).equals(want.sort_by(order))


def test_group_filters_of_the_macros_reach_the_scans(lake, store, picks, monkeypatch):
    """A group filter of trace_summary() and of branch_stats() joined to traces reads the
    group's traces' nodes and branches only (through the macros' CTEs and aggregates)."""
    opened = _opened(monkeypatch)
    queries = [
        "SELECT * FROM trace_summary() WHERE group_id = ?",
        "SELECT b.* FROM branch_stats() b JOIN traces t USING (trace_id) WHERE t.group_id = ?",
    ]
    with tracedb.connect(store, read_only=True) as db:
        for query in queries:
            opened.clear()
            got, report = sqlscan.run(lake, query, [picks["group"]])
            want = db.sql(query, [picks["group"]])
            order = [(c, "ascending") for c in want.column_names]
            assert got.sort_by(order).equals(want.sort_by(order)) and want.num_rows > 0, query
            members = report.rows["traces"]
            assert 0 < opened.count("nodes") <= members < _data_files(lake, "nodes"), query


def test_projections_and_joins_narrow_the_reads(lake, picks, monkeypatch):
    opened = _opened(monkeypatch)
    query, _ = _bind("SELECT * FROM branch_stats()", None, picks)
    sqlscan.run(lake, query)
    assert "segments" not in opened  # branch_stats reads branches and nodes only
    opened.clear()
    query, _ = _bind("SELECT n.* FROM traces t JOIN nodes n USING (trace_id) WHERE t.group_id = $group", None, picks)
    _, report = sqlscan.run(lake, query)
    group_size = report.rows["traces"]
    assert opened.count("nodes") <= group_size < _data_files(lake, "nodes")  # the group's trace ids reach nodes
    scans = sqlplan.plan("SELECT * FROM node_credit() WHERE trace_id IN ('a', 'b')")
    assert [s.table for s in scans] == ["nodes", "nodes"]  # DuckDB pins one scan, the join pins the other
    assert sqlscan.read_for(lake, scans)[1].rows["nodes"] == 0


def test_what_cannot_be_planned_reads_everything_and_errors_are_duckdbs(lake):
    described, report = sqlscan.run(lake, "DESCRIBE traces")
    assert not report.pushed and "trace_id" in described.column("column_name").to_pylist()
    counted = lake.sql("SELECT count(*) AS n FROM query_table('nodes')").column("n")[0].as_py()
    assert counted == read.visible(lake)["nodes"].num_rows  # a table function's scan is a scan too
    with pytest.raises(duckdb.CatalogException, match="no_such_table"):
        lake.sql("SELECT * FROM no_such_table")
    empty = lake.sql("SELECT * FROM traces WHERE trace_id = 'no-such-trace'")
    assert empty.num_rows == 0 and empty.schema.names == pa.schema(lake.tables()["traces"].schema).names


def test_large_key_sets_are_read_by_key(lake, store, monkeypatch):
    """Every visible node's segments (thousands of ids) are read by key from their traces'
    buckets, not through a pyiceberg In filter of every id, and give the file store's
    answers."""
    monkeypatch.setattr(sqlscan, "KEY_SCAN_MIN", 8)  # the golden fixtures hold a few hundred segments
    query = "SELECT count(*) AS n, sum(len(token_ids)) AS tokens FROM node_tokens()"
    got, report = sqlscan.run(lake, query)
    assert report.filters["segments"].startswith("segment_id in 454 keys, of 44 traces")
    assert report.files["segments"] >= 1
    with tracedb.connect(store, read_only=True) as db:
        assert got.to_pylist() == db.sql(query).to_pylist()
    monkeypatch.setattr(sqlscan, "KEY_SCAN_MIN", 10**9)  # the In filter path: the same answer
    again, report = sqlscan.run(lake, query)
    assert again.equals(got)


def test_a_filter_keeping_only_a_losing_writers_row_shows_nothing(tmp_path):
    """A traces row of a writer that lost the race for a trace id (committed after the
    winner's) is never shown, even to a query whose filter keeps that row alone."""
    from tracedb.lake import write
    from tracedb.lake.move import file_rows

    store = tmp_path / "runs.duckdb"
    with tracedb.connect(store) as db:
        db.ingest([FIXTURES / "linear.traces.jsonl", FIXTURES / "forest.traces.jsonl"])
        one = db.sql("SELECT min(trace_id) AS t FROM traces").column("t")[0].as_py()
        rows = file_rows(db, [one])
    lake = lakes.init(tmp_path / "L")
    lake.push(store)
    lost = rows["traces"]
    lost = lost.set_column(lost.schema.get_field_index("reward"), "reward", pa.array([-9.0] * lost.num_rows))
    lake.table("traces").append(write.lake_rows("traces", lost, "loser"))
    lake.table("nodes").append(write.lake_rows("nodes", rows["nodes"], "loser"))
    for query in (
        "SELECT trace_id, reward FROM traces WHERE reward < -5 ORDER BY ALL",
        "SELECT count(*) AS n FROM traces t JOIN nodes n USING (trace_id) WHERE t.reward < -5",
    ):
        got, report = sqlscan.run(lake, query)
        assert report.pushed and "reward" in report.filters["traces"]  # the filter reached the scan
        assert got.equals(_full(lake, query))
    assert lake.sql("SELECT count(*) AS n FROM traces WHERE reward < -5").column("n")[0].as_py() == 0
    assert lake.sql("SELECT reward FROM traces WHERE trace_id = ?", [one]).column("reward")[0].as_py() != -9.0


def _lake_bytes(root):
    return {str(p): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_lake_sql_runs_reads_only(lake, tmp_path):
    """As ``tracedb sql`` without ``--write`` (``tests/faults/test_sql_reads.py``): every
    statement is judged before any runs; a COPY may write a file, not one of the lake's."""
    from pathlib import Path

    where = lake.location.where
    warehouse = Path(where).resolve() / "warehouse"
    before = _lake_bytes(Path(where))
    other = tmp_path / "other.duckdb"
    refused = {
        "attach-write": f"ATTACH '{other}' AS w; CREATE TABLE w.t AS SELECT * FROM traces",
        "use": "USE memory",
        "write-after-a-read": "SELECT count(*) FROM traces; CREATE TABLE t AS SELECT 1",
        "set": "SET enable_external_access = false",
        "export": f"EXPORT DATABASE '{tmp_path / 'exported'}'",
        "copy-into-the-warehouse": f"COPY (SELECT * FROM traces) TO '{warehouse}/x.parquet'",
        "copy-over-the-catalog": f"COPY (SELECT 1 AS x) TO '{where}/catalog.db' (FORMAT csv)",
        "explain-analyze-create": "EXPLAIN ANALYZE CREATE TABLE t AS SELECT 1",
        "call": "CALL checkpoint()",
    }
    for name, sql in refused.items():
        with pytest.raises(tracedb.errors.SqlRefused) as e:
            lake.sql(sql)
        assert not other.exists(), name
        if name.startswith("copy"):
            assert "would write over or into" in str(e.value), (name, str(e.value))
    assert _lake_bytes(Path(where)) == before
    assert lake.sql("SELECT count(*) AS n FROM traces").column("n")[0].as_py() > 0
    assert lake.sql("EXPLAIN SELECT * FROM traces").num_rows
    out = tmp_path / "ids.csv"
    lake.sql(f"COPY (SELECT trace_id FROM traces) TO '{out}' (HEADER false)")
    assert len(out.read_text().splitlines()) == lake.sql("SELECT count(*) AS n FROM traces").column("n")[0].as_py()


def test_lake_sql_command_refuses_in_one_line(lake):
    from typer.testing import CliRunner

    from tracedb.cli.main import app

    done = CliRunner().invoke(app, ["lake", "sql", "USE memory; SELECT 1", "--lake", lake.location.where])
    assert done.exit_code == 2, done.output
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "does not only read" in lines[0], done.stderr


def test_lake_sql_prints_every_type(lake):
    """Dates past year 9999 or infinite and 128-bit integers printed a traceback or came
    back wrong (``tests/faults/test_sql_values.py`` checks the file store's every value)."""
    import json

    from typer.testing import CliRunner

    from tracedb.cli.main import app

    runner = CliRunner()
    sql = "SELECT * FROM test_all_types()"
    done = runner.invoke(app, ["lake", "sql", sql, "--lake", lake.location.where, "--json"])
    assert done.exit_code == 0, done.output[-2000:]
    rows = json.loads(done.stdout)
    assert [r["uhugeint"] for r in rows] == ["0", str(2**128 - 1), None]
    assert [r["hugeint"] for r in rows] == [str(-(2**127)), str(2**127 - 1), None]
    assert [r["date"] for r in rows] == ["5877642-06-25 (BC)", "5881580-07-10", None]
    assert rows[1]["date_array"] == ["1970-01-01", "infinity", "-infinity", None, "2022-05-12"]
    table = runner.invoke(app, ["lake", "sql", sql, "--lake", lake.location.where])
    assert table.exit_code == 0 and "Traceback" not in table.output, table.output[-2000:]
    edges = lake.sql("SELECT 'infinity'::TIMESTAMP AS t, '10000-01-01'::DATE AS d", portable=True).to_pylist()
    assert edges == [{"t": "infinity", "d": "10000-01-01"}]


def _with_episode(rows, episode, policy_start, ingested_at):
    """``rows`` (a trace's, of file_rows) moved to episode ``episode`` with that episode row."""
    out = dict(rows)
    traces = rows["traces"]
    out["traces"] = traces.set_column(
        traces.schema.get_field_index("episode_id"), "episode_id", pa.array([episode] * traces.num_rows, pa.string())
    )
    row = rows["episodes"].slice(0, 1)
    for column, value in (("episode_id", episode), ("policy_start", policy_start), ("ingested_at", ingested_at)):
        at = row.schema.get_field_index(column)
        row = row.set_column(at, row.schema.field(at), pa.array([value], row.schema.field(at).type))
    out["episodes"] = row
    return out


def _shared_episode_lake(tmp_path):
    """A lake of two traces of one episode, each in its own write (episode rows with
    policy_start 5, then 9), and an earlier episode row (1) of a writer killed before
    its traces row: (lake, first trace, second trace)."""
    import datetime

    from tracedb.lake import write
    from tracedb.lake.move import file_rows

    store = tmp_path / "runs.duckdb"
    with tracedb.connect(store) as db:
        db.ingest([FIXTURES / "linear.traces.jsonl", FIXTURES / "forest.traces.jsonl"])
        first, second = db.sql("SELECT trace_id FROM traces ORDER BY trace_id LIMIT 2").column(0).to_pylist()
        rows = {t: file_rows(db, [t], rejects=False) for t in (first, second)}
    day = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
    lake = lakes.init(tmp_path / "L")
    killed = _with_episode(rows[first], "shared", 1, day)  # the earliest row, of a write never committed
    lake.table("episodes").append(write.lake_rows("episodes", killed["episodes"], "killed-writer"))
    lake.append(_with_episode(rows[first], "shared", 5, day + datetime.timedelta(hours=1)))
    lake.append(_with_episode(rows[second], "shared", 9, day + datetime.timedelta(hours=2)))
    return lake, first, second


def test_a_one_trace_query_shows_the_episode_row_every_reader_shows(tmp_path):
    """An episode of traces in several writes shows one row, the first (by ingest time)
    of a write with a visible trace of it: a query about one of them that reads only the
    trace's episode (not every visible trace) finds the same row, through the episode's
    other traces when another write's row comes first, and never a killed writer's."""
    lake, first, second = _shared_episode_lake(tmp_path)
    for trace in (first, second):
        for query in (
            "SELECT trace_id, node_index, policy_version FROM node_tokens() WHERE trace_id = ? ORDER BY ALL",
            "SELECT e.policy_start FROM traces t JOIN episodes e USING (episode_id) WHERE t.trace_id = ?",
        ):
            got, report = sqlscan.run(lake, query, [trace])
            assert report.pushed and report.rows["traces"] < 3
            assert got.num_rows > 0 and got.equals(_full(lake, query, [trace])), (trace, query)
    query = "SELECT e.policy_start FROM traces t JOIN episodes e USING (episode_id) WHERE t.trace_id = ?"
    assert lake.sql(query, [second]).column(0).to_pylist() == [5]  # the first committed write's row


def test_reads_of_some_traces_show_the_episode_row_a_full_read_shows(tmp_path):
    """read.visible of one trace and a view task's policy versions (the episode's
    policy_start stands for tokens without weight-version spans) choose the episode's
    row as over every visible trace: the first committed write's (5), not the selected
    trace's own (9), nor the killed writer's (1)."""
    from tracedb.lake import views
    from tracedb.lake.catalog import BATCH
    from tracedb.lake.scan import visible_traces

    lake, first, second = _shared_episode_lake(tmp_path)
    whole = read.visible(lake)["episodes"]
    assert whole.column("policy_start").to_pylist() == [5]
    for trace in (first, second):
        assert read.visible(lake, trace_ids=[trace])["episodes"].equals(whole), trace
        rows = visible_traces(lake.table("traces"), trace_ids=[trace]).select(["trace_id", BATCH])
        got = views.view(
            lake, rows, columns=["policy_version"], train_once=False, trainable=None, branch_index=None, credit=None
        )
        versions = {v for branch in got.column("policy_version").to_pylist() for v in branch if v is not None}
        assert versions == {5}, (trace, versions)
