"""The lake on each catalog it is tested on: SQLite (a local lake) and PostgreSQL (a
throwaway server on a Unix socket, see ``benchmarks/postgres.py``): made and read the
same way, commit conflicts retried and counted the same way, and a catalog that cannot
be reached named in one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

import tracedb

pytest.importorskip("pyiceberg_core", reason="the lake extra is not installed (pip install '.[lake]')")

import tracedb.lake as lakes  # noqa: E402
from tracedb.cli.main import app  # noqa: E402
from tracedb.lake import write  # noqa: E402
from tracedb.lake.move import file_rows  # noqa: E402


@pytest.fixture(params=["sqlite", "postgres"])
def new_lake(request, tmp_path):
    """Makes the address of a new lake on the catalog of the parameter: a directory
    (SQLite), or a properties file naming a new database of the module's PostgreSQL
    server, its warehouse a local directory."""
    if request.param == "sqlite":
        return lambda name="L": tmp_path / name
    server = request.getfixturevalue("postgres")
    return lambda name="L": server.lake_properties(tmp_path / f"{name}.yaml", tmp_path / f"{name}-warehouse")


def _store_rows(store, first: int, n: int) -> dict:
    with tracedb.connect(store, read_only=True) as db:
        ids = db.sql(f"SELECT trace_id FROM traces ORDER BY trace_id LIMIT {n} OFFSET {first}").column(0).to_pylist()
        return file_rows(db, ids)


def test_a_lake_is_made_written_and_read_alike_on_each_catalog(new_lake, golden_store, tmp_path):
    where = new_lake()
    made = CliRunner().invoke(app, ["lake", "init", "--warehouse", str(where), "--json"])
    assert made.exit_code == 0, made.output
    assert json.loads(made.output)["watermark"] == 0
    lake = lakes.open(where)
    report = lake.push(golden_store)  # one write
    assert report.traces > 0 and (report.attempts, report.retries) == (1, 0)
    assert report.commits == len(report.rows)  # a commit per table written, traces included
    query = "SELECT * FROM branch_stats() ORDER BY ALL"
    with tracedb.connect(golden_store, read_only=True) as db:
        expected = db.sql(query)
        ids = db.sql("SELECT trace_id FROM traces ORDER BY trace_id").column(0).to_pylist()
        records = {t: db.trace(t) for t in ids}
    assert lakes.open(where).sql(query).equals(expected)
    assert lake.push(golden_store).traces == 0  # idempotent
    lake.pull(tmp_path / "pulled.duckdb")
    with tracedb.connect(tmp_path / "pulled.duckdb", read_only=True) as pulled:
        assert {t: pulled.trace(t) for t in ids} == records


def test_a_commit_conflict_is_retried_and_counted(new_lake, golden_store):
    """Another writer's whole write lands just after this write loaded ``nodes`` to commit
    its files (the second load: the first wrote them): its nodes commit conflicts once
    (pyiceberg's retry gets past it), and the report counts that retry, as the catalog saw it."""
    lake = lakes.init(new_lake())
    other = lakes.open(lake.where)  # a second writer: its own catalog connection
    mine, theirs = _store_rows(golden_store, 0, 6), _store_rows(golden_store, 6, 4)

    class Interleaved:
        def __init__(self) -> None:
            self.loads = 0
            self.commits = lake.commits

        def table(self, name: str):
            table = lake.table(name)
            if name == "nodes":
                self.loads += 1
                if self.loads == 2:
                    assert other.append(theirs).traces == 4
            return table

    report = write.append(Interleaved(), mine)
    assert (report.traces, report.retries) == (6, 1)
    assert report.commits == len(report.rows)  # one commit per table written, traces included
    visible = lake.tables()
    assert sorted(visible["traces"].column("trace_id").to_pylist()) == sorted(
        mine["traces"].column("trace_id").to_pylist() + theirs["traces"].column("trace_id").to_pylist()
    )
    assert visible["nodes"].num_rows == mine["nodes"].num_rows + theirs["nodes"].num_rows


def test_a_traces_conflict_is_checked_again_and_counted(new_lake, golden_store, monkeypatch):
    """Another writer commits two of this write's traces between this write's check and
    its traces commit: the commit conflicts, is counted as a retry, and the next attempt
    checks again and commits only the other three."""
    lake = lakes.init(new_lake())
    other = lakes.open(lake.where)
    rows = _store_rows(golden_store, 0, 5)
    two = _store_rows(golden_store, 0, 2)
    real = write.visible_ids
    looks: list[int] = []  # this write's checks (not the other writer's, made inside one of them)

    def blind_at_the_commit(table, wanted):
        if looks and looks[-1] < 0:
            return real(table, wanted)
        looks.append(len(looks))
        if len(looks) == 2:  # the check of the first traces commit attempt: the other writer lands now
            looks.append(-1)
            assert other.append(two).traces == 2
            looks.pop()
            return set()
        return real(table, wanted)

    monkeypatch.setattr(write, "visible_ids", blind_at_the_commit)
    report = lake.append(rows)
    assert (report.traces, report.skipped, report.attempts, report.retries) == (3, 2, 2, 1)
    assert len(looks) == 3  # the write's first check, then one per attempt (not one per trace id)
    traces = lake.tables()["traces"].column("trace_id").to_pylist()
    assert sorted(traces) == sorted(rows["traces"].column("trace_id").to_pylist())


def test_a_catalog_that_cannot_be_reached_is_named_in_one_line(tmp_path):
    pytest.importorskip("psycopg2", reason="the lake extra is not installed (pip install '.[lake]')")
    props = tmp_path / "lake.yaml"
    uri = f"postgresql+psycopg2://tracedb:secret@/lake?host={tmp_path}"  # no server on that socket
    props.write_text(f"type: sql\nuri: {uri}\nwarehouse: {tmp_path / 'wh'}\n")
    with pytest.raises(lakes.LakeError) as caught:
        lakes.open(props)
    message = str(caught.value)
    assert "\n" not in message and "secret" not in message
    assert f"cannot open catalog sql postgresql+psycopg2://tracedb:***@/lake?host={tmp_path}" in message
    cli = subprocess.run(
        [sys.executable, "-m", "tracedb", "lake", "sql", "SELECT 1", "--lake", str(props)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 2 and cli.stdout == ""
    assert len(cli.stderr.strip().splitlines()) == 1 and "cannot open catalog" in cli.stderr


def test_relative_paths_in_a_properties_file_are_taken_from_its_directory(tmp_path, golden_store, monkeypatch):
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "lake.yaml").write_text("type: sql\nuri: sqlite:///catalog.db\nwarehouse: warehouse\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    lake = lakes.init(conf / "lake.yaml")
    assert lake.push(golden_store).traces > 0
    assert (conf / "catalog.db").is_file() and any((conf / "warehouse").rglob("*.parquet"))
    assert not any(elsewhere.iterdir())
