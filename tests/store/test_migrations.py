"""Schema migrations (``tracedb/migrations.py``) run on files earlier versions really wrote
(``tests/fixtures/schema/vN.duckdb``, see its README): an older file is refused read-only
with the advice to migrate, upgraded in place by a read-write open with everything it
held, and left as it was when a migration fails; a file newer than the code, or older
than any migration reaches, is refused naming both versions."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import duckdb
import pytest

import tracedb
import tracedb.credit
from tracedb import migrations
from tracedb.errors import SchemaVersionError

from support import FIXTURES
from support.hostile import V1_FIXTURE, duckdb_run, on_disk, stored_version

SCHEMA_DIR = V1_FIXTURE.parent
LINEAR = FIXTURES / "linear.traces.jsonl"
TRACE_ID = "4ba71ab7ac0504a56cc6be1805fdf179"  # linear's one trace
MODES = pytest.mark.parametrize("read_only", [False, True], ids=["read-write", "read-only"])


@pytest.fixture
def v1(tmp_path: Path) -> Path:
    """A copy of the file schema 1 wrote (the fixture itself is never opened for writing)."""
    path = tmp_path / "runs.duckdb"
    shutil.copy(V1_FIXTURE, path)
    return path


def reject_columns(path: Path) -> list[str]:
    con = duckdb.connect(str(path), read_only=True)
    try:
        rows = con.execute("SELECT column_name FROM duckdb_columns() WHERE table_name = 'rejects'").fetchall()
    finally:
        con.close()
    return [r[0] for r in rows]


def credit_set(db: tracedb.Database, name: str) -> dict[str, Any]:
    (row,) = [r for r in db.credit_sets().to_pylist() if r["name"] == name]
    return {k: row[k] for k in ("algorithm", "params", "assigned_nodes")}


def test_the_fixture_is_a_version_1_file():
    assert stored_version(V1_FIXTURE) == "1"
    assert "record_bytes" not in reject_columns(V1_FIXTURE)
    assert migrations.SCHEMA_VERSION == tracedb.SCHEMA_VERSION > 1


def test_an_older_file_opened_read_only_is_refused_with_the_advice_to_migrate(v1):
    before = on_disk(v1)
    with pytest.raises(SchemaVersionError) as info:
        tracedb.connect(v1, read_only=True)
    message = str(info.value)
    assert f"tracedb migrate --db {v1}" in message
    assert "schema version 1" in message and f"reads {tracedb.SCHEMA_VERSION}" in message
    assert on_disk(v1) == before


def test_a_read_write_open_upgrades_in_place_keeping_everything(v1, tmp_path):
    with tracedb.connect(v1) as db:
        trace = db.trace(TRACE_ID)
        branches = db.branches()
        grpo_branches = db.branches(credit="grpo")
        grpo_trace = db.trace(TRACE_ID, credit="grpo")
        grpo = credit_set(db, "grpo")
        rejects = db.sql("SELECT source, line, reason, record, record_bytes, record_sha256 FROM rejects").to_pylist()
    assert stored_version(v1) == str(tracedb.SCHEMA_VERSION)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs.duckdb"]  # in place, nothing beside it

    with tracedb.connect(":memory:") as fresh:
        assert fresh.ingest(LINEAR).ok
        tracedb.credit.run(fresh, "grpo", "grpo")
        assert trace == fresh.trace(TRACE_ID)
        assert branches.equals(fresh.branches())
        assert grpo_branches.equals(fresh.branches(credit="grpo"))
        assert grpo_trace == fresh.trace(TRACE_ID, credit="grpo")
        now = credit_set(fresh, "grpo")
        # grpo's parameters grew since (include_dropped, include_eval): the stored set keeps the ones it ran with
        fresh_params = {k: v for k, v in json.loads(now.pop("params")).items() if k in json.loads(grpo["params"])}
        assert {**grpo, "params": json.loads(grpo["params"])} == {**now, "params": fresh_params}

    (reject,) = rejects
    assert (reject["source"], reject["line"]) == ("/tmp/v1bad.jsonl", 1)
    assert reject["reason"].startswith("not valid JSON")
    raw = reject["record"].encode()
    assert reject["record"].startswith('{"id": "broken"')
    assert (reject["record_bytes"], reject["record_sha256"]) == (len(raw), hashlib.sha256(raw).hexdigest())

    with tracedb.connect(v1, read_only=True) as db:  # now a current file
        assert db.trace(TRACE_ID) == trace
        assert db.stats()["rejects"] == 1


def test_the_upgraded_file_takes_new_rejects_with_their_length(v1, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "also-broken", "traces": [\n')
    with tracedb.connect(v1) as db:
        report = db.ingest(bad)
        assert [r.line for r in report.rejected] == [1]
        rows = db.sql("SELECT source, record_bytes FROM rejects ORDER BY record_bytes").to_pylist()
    assert rows == [
        {"source": "/tmp/v1bad.jsonl", "record_bytes": 28},
        {"source": str(bad), "record_bytes": len('{"id": "also-broken", "traces": [')},
    ]


def test_a_migration_that_fails_midway_leaves_the_file_as_it_was(v1, monkeypatch):
    with pytest.raises(SchemaVersionError) as info:
        tracedb.connect(v1, read_only=True)
    refusal = str(info.value)
    real = migrations.MIGRATIONS[1]
    statements: list[str] = []

    class FailsAfterOne:
        """The migration's connection: its first statement runs, the second fails."""

        def __init__(self, con: duckdb.DuckDBPyConnection) -> None:
            self.con = con

        def execute(self, query: str, *args: Any) -> Any:
            statements.append(query)
            if len(statements) > 1:
                raise duckdb.IOException("disk full (simulated)")
            return self.con.execute(query, *args)

    monkeypatch.setitem(migrations.MIGRATIONS, 1, lambda con: real(FailsAfterOne(con)))
    with pytest.raises(duckdb.IOException, match="simulated"):
        tracedb.connect(v1)
    assert len(statements) == 2 and "ADD COLUMN record_bytes" in statements[0]

    assert stored_version(v1) == "1"
    assert reject_columns(v1) == reject_columns(V1_FIXTURE)  # the first ALTER was rolled back
    with pytest.raises(SchemaVersionError) as again:
        tracedb.connect(v1, read_only=True)
    assert str(again.value) == refusal

    monkeypatch.setitem(migrations.MIGRATIONS, 1, real)
    with tracedb.connect(v1) as db:  # the real migration still applies
        assert db.stats()["traces"] == 1
    assert stored_version(v1) == str(tracedb.SCHEMA_VERSION)


@MODES
def test_a_file_newer_than_the_code_is_refused_naming_both_versions(v1, read_only):
    duckdb_run(v1, "UPDATE tracedb_meta SET value = '99' WHERE key = 'schema_version'")
    before = on_disk(v1)
    with pytest.raises(SchemaVersionError) as info:
        tracedb.connect(v1, read_only=read_only)
    message = str(info.value)
    assert "schema version 99 is newer" in message and f"({tracedb.SCHEMA_VERSION})" in message
    assert on_disk(v1) == before


@MODES
def test_a_file_older_than_any_migration_is_refused(v1, read_only):
    duckdb_run(v1, "UPDATE tracedb_meta SET value = '0' WHERE key = 'schema_version'")
    before = on_disk(v1)
    with pytest.raises(SchemaVersionError) as info:
        tracedb.connect(v1, read_only=read_only)
    message = str(info.value)
    assert "schema version 0 is older than any this tracedb upgrades" in message
    assert f"reads {tracedb.SCHEMA_VERSION}" in message and f"from {min(migrations.MIGRATIONS)} on" in message
    assert on_disk(v1) == before


def test_every_older_version_has_a_fixture_and_a_migration():
    """Each version before the current one was written to a fixture file, and the chain
    of migrations reaches the current version from each."""
    for version in range(1, tracedb.SCHEMA_VERSION):
        assert (SCHEMA_DIR / f"v{version}.duckdb").exists(), version
        assert stored_version(SCHEMA_DIR / f"v{version}.duckdb") == str(version)
        assert migrations.can_upgrade(version)
    assert not migrations.can_upgrade(0) and not migrations.can_upgrade(tracedb.SCHEMA_VERSION + 1)


@pytest.mark.parametrize("version", range(1, tracedb.SCHEMA_VERSION))
def test_each_fixture_upgrades_to_the_current_version(tmp_path, version):
    path = tmp_path / f"v{version}.duckdb"
    shutil.copy(SCHEMA_DIR / f"v{version}.duckdb", path)
    with tracedb.connect(path) as db:
        assert db.trace(TRACE_ID)["id"] == TRACE_ID
    assert stored_version(path) == str(tracedb.SCHEMA_VERSION)
