"""A null ``weight_versions`` through the lake's files (pyiceberg writes a null list of
structs as ``[]``): the writer's encoding and the readers' decoding give the file store's
values back, for every way a node can hold the column."""

from __future__ import annotations

import pyarrow as pa
import pytest

from tracedb import tables
from tracedb.records import WEIGHT_VERSIONS_BIT

pytest.importorskip("pyiceberg_core", reason="the lake extra is not installed (pip install '.[lake]')")

from tracedb.lake import nulls  # noqa: E402

SPAN = [{"version": "step_3", "start": 0, "end": 2}]
ROWS = [  # (present bit, extra, stored value, what the lake's file holds)
    (True, None, None, [None]),  # an explicit null
    (True, None, [], []),  # an explicit []
    (True, None, SPAN, SPAN),
    (False, None, None, []),  # no spans in the record: pyiceberg writes []
    (False, '{"weight_versions":[]}', [], []),  # a schema-5 node: the migration copies [] out of extra
    (False, '{"weight_versions":null}', None, []),
    (False, '{"other":1}', None, []),
]


def _nodes(values):
    return pa.table(
        {
            "present": pa.array([WEIGHT_VERSIONS_BIT if bit else 0 for bit, *_ in ROWS], pa.int32()),
            "extra": pa.array([extra for _, extra, *_ in ROWS], pa.string()),
            "weight_versions": pa.array(values, tables.WEIGHT_VERSIONS),
        }
    )


def test_encoded_and_decoded_as_the_file_store_holds_them():
    stored = [row[2] for row in ROWS]
    written = nulls.encode("nodes", _nodes(stored))
    # what pyiceberg leaves of a null list: an empty one
    in_file = [[] if v is None else v for v in written.column("weight_versions").to_pylist()]
    assert in_file == [row[3] for row in ROWS]
    assert nulls.decode("nodes", _nodes(in_file)).column("weight_versions").to_pylist() == stored
    other = pa.table({"trace_id": ["a"]})
    assert nulls.encode("traces", other) is other and nulls.decode("traces", other) is other
