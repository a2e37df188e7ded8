"""The database the CEC database tests share (the records: :mod:`support.cec_records`)."""

from __future__ import annotations

import pytest

import tracedb

from support.cec_records import GROUPS


@pytest.fixture
def db():
    with tracedb.connect(":memory:") as database:
        assert database.ingest(GROUPS).ok
        yield database
