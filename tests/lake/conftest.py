"""What the lake tests share: a file store of every golden fixture."""

from __future__ import annotations

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
