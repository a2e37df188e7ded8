"""What the lake tests share: a file store of every golden fixture, a PostgreSQL server."""

from __future__ import annotations

import os

import pytest

import tracedb

from support import FIXTURES


@pytest.fixture(scope="module")
def golden_store(tmp_path_factory):
    """A file store holding every golden fixture (one per module: tests may copy it,
    never write it)."""
    path = tmp_path_factory.mktemp("store") / "runs.duckdb"
    with tracedb.connect(path) as db:
        db.ingest(FIXTURES)
    return path


@pytest.fixture(scope="module")
def postgres():
    """A throwaway PostgreSQL cluster for the module (``benchmarks.postgres``), on a Unix
    socket in a temporary directory, stopped after. Skipped where none can be made, with
    the reason, except under ``CI=true``, where that fails."""
    from benchmarks import postgres as pg

    problem = pg.problem()
    if problem:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true needs a PostgreSQL server for the lake's catalog tests: {problem}")
        pytest.skip(f"PostgreSQL catalog tests not run: {problem}")
    with pg.cluster() as server:
        yield server
