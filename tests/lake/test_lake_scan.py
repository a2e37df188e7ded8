"""Scanning a lake by keys: only the keys' buckets are read, and the rows are pyiceberg's."""

from __future__ import annotations

import pyarrow as pa
import pytest

import tracedb

from support import FIXTURES

pytest.importorskip("pyiceberg", reason="the lake extra is not installed (pip install '.[lake]')")
pytest.importorskip("pyiceberg_core", reason="the lake extra is not installed (pip install '.[lake]')")

from pyiceberg.expressions import In  # noqa: E402
from pyiceberg.io.pyarrow import PyArrowFileIO  # noqa: E402

import tracedb.lake as lakes  # noqa: E402
from tracedb.lake import scan  # noqa: E402


@pytest.fixture(scope="module")
def lake(tmp_path_factory):
    """A lake holding every golden fixture, pushed in three writes (several files a bucket)."""
    path = tmp_path_factory.mktemp("store") / "runs.duckdb"
    with tracedb.connect(path) as db:
        db.ingest(FIXTURES)
    opened = lakes.init(tmp_path_factory.mktemp("lake") / "L")
    opened.push(path, batch_traces=20)
    return opened


def _opened(monkeypatch):
    """Every data file the lake's FileIO opens (counted beside the code under test)."""
    opened: list[str] = []
    real = PyArrowFileIO.new_input

    def counting(self, location):
        if location.endswith(".parquet"):
            opened.append(location)
        return real(self, location)

    monkeypatch.setattr(PyArrowFileIO, "new_input", counting)
    return opened


@pytest.mark.parametrize(
    ("name", "column"), [("nodes", "trace_id"), ("segments", "segment_id"), ("episodes", "episode_id")]
)
def test_scan_keys_equals_an_in_filter_and_reads_only_the_keys_buckets(lake, monkeypatch, name, column):
    table = lake.table(name)
    everything = table.scan().to_arrow()
    keys = sorted(set(everything.column(column).to_pylist()))[::5][:40]
    read = _opened(monkeypatch)
    got = scan.scan_keys(table, column, keys)
    want = table.scan(row_filter=In(column, keys)).to_arrow()
    assert got.num_rows == want.num_rows > 0
    assert set(got.column(column).to_pylist()) == set(keys)
    cols = [c for c in want.column_names if not pa.types.is_list(want.schema.field(c).type)]
    assert sorted(got.select(cols).to_pylist(), key=repr) == sorted(want.select(cols).to_pylist(), key=repr)
    assert got.column_names == want.column_names
    files = {t.file.file_path for t in table.scan().plan_files()}
    assert len(files) > 1
    wanted = {t.file.file_path for t in table.scan(row_filter=In(column, keys)).plan_files()}
    assert set(read) == wanted  # the same pruning as pyiceberg's own (buckets, then bounds)
    read.clear()
    one = scan.scan_keys(table, column, keys[:1])
    assert set(one.column(column).to_pylist()) == {keys[0]}
    assert len(set(read)) < len(files)  # one key: not every file


def test_scan_keys_edges(lake):
    nodes = lake.table("nodes")
    empty = scan.scan_keys(nodes, "trace_id", [])
    assert empty.num_rows == 0 and "trace_id" in empty.column_names
    assert scan.scan_keys(nodes, "trace_id", ["no-such-trace"]).num_rows == 0
    some = nodes.scan().to_arrow().column("trace_id")[0].as_py()
    picked = scan.scan_keys(nodes, "trace_id", [some, some], columns=["role"])
    assert set(picked.column_names) == {"role", "trace_id"} and set(picked.column("trace_id").to_pylist()) == {some}
    assert scan.bucket_of(nodes, "role") is None  # not bucketed on it: every file read, rows filtered
    by_role = scan.scan_keys(nodes, "role", ["tool"])
    assert by_role.num_rows >= 1 and set(by_role.column("role").to_pylist()) == {"tool"}


def test_bucket_order_groups_keys_by_bucket_then_key(lake):
    nodes = lake.table("nodes")
    ids = sorted(set(nodes.scan().to_arrow().column("trace_id").to_pylist()))
    ordered = scan.bucket_order(nodes, "trace_id", ids)
    assert sorted(ordered) == ids
    position, transform = scan.bucket_of(nodes, "trace_id")
    of = transform.transform(nodes.schema().find_field("trace_id").field_type)
    buckets = [of(t) for t in ordered]
    assert buckets == sorted(buckets) and len(set(buckets)) > 1
    for b in set(buckets):  # by key within a bucket (a chunk of them is a key range of each file)
        assert [t for t in ordered if of(t) == b] == sorted(t for t in ids if of(t) == b)
    assert scan.bucket_order(nodes, "trace_id", []) == []
    assert scan.bucket_order(nodes, "role", ["b", "a"]) == ["b", "a"]


def test_traces_by_key_equal_an_in_filter_with_their_seq(lake):
    traces = lake.table("traces")
    ids = sorted(set(traces.scan().to_arrow().column("trace_id").to_pylist()))[::3]
    by_key = scan.scan_traces(traces, trace_ids=ids)
    by_filter = scan.scan_traces(traces, In("trace_id", ids))
    key = [("trace_id", "ascending"), ("seq", "ascending")]
    assert by_key.num_rows == len(ids) and by_key.sort_by(key).to_pylist() == by_filter.sort_by(key).to_pylist()
    assert scan.visible_traces(traces, trace_ids=ids).column("trace_id").to_pylist() == (
        scan.visible_traces(traces, In("trace_id", ids)).column("trace_id").to_pylist()
    )
    assert scan.scan_traces(traces, trace_ids=[]).num_rows == 0
    assert scan.scan_traces(traces, trace_ids=["no-such-trace"]).num_rows == 0
