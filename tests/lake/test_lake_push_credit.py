"""Pushing credit written after its traces were pushed: the lake gets the sets it lacks,
a set it holds with other values is refused, pushing twice adds nothing."""

from __future__ import annotations

import shutil

import pyarrow as pa
import pytest

import tracedb
import tracedb.credit
from tracedb.errors import WriteError

pytest.importorskip("pyiceberg_core", reason="the lake extra is not installed (pip install '.[lake]')")

import tracedb.lake as lakes  # noqa: E402

CREDIT = ("credit", "trace_credit")


@pytest.fixture(scope="module")
def ingested(golden_store):
    """A file store holding every golden fixture."""
    return golden_store


@pytest.fixture
def store(ingested, tmp_path):
    path = tmp_path / "runs.duckdb"
    shutil.copy(ingested, path)
    return path


def _ids(db):
    return db.sql("SELECT trace_id FROM traces ORDER BY trace_id").column("trace_id").to_pylist()


def _per_trace(db, name, scale=1.0):
    """A node-layout set ``name``: one value per trace broadcast over its sampled nodes."""
    ids = _ids(db)
    db.create_credit_set(name, description="written after the push")
    db.write_traces(pa.table({"trace_id": ids, "value": [scale * i / len(ids) for i in range(len(ids))]}), credit=name)


def _lake_credit(lake):
    tables = lake.tables()
    return {t: sorted(map(str, tables[t].to_pylist())) for t in (*CREDIT, "credit_sets")}


def _credit(db, table):
    return db.sql(f"SELECT * FROM {table} ORDER BY ALL")


def test_credit_written_after_the_push_reaches_the_lake(store, tmp_path):
    lake = lakes.init(tmp_path / "L")
    with tracedb.connect(store) as db:
        lake.push(db, batch_traces=20)  # the traces first, no credit set yet
        tracedb.credit.run(db, "grpo", "g2")  # a per-trace set
        _per_trace(db, "n2")  # a per-node set
        n_trace = db.sql("SELECT count(*) AS n FROM trace_credit").column("n")[0].as_py()
        n_node = db.sql("SELECT count(*) AS n FROM credit").column("n")[0].as_py()
        assert n_trace > 0 and n_node > 0
    assert lake.tables()["credit_sets"].num_rows == 0

    report = lake.push(store, batch_traces=20)
    assert report.traces == 0 and report.skipped > 0
    assert report.rows == {"credit": n_node, "trace_credit": n_trace, "credit_sets": 2}
    again = lake.push(store)
    assert again.traces == 0 and again.rows == {}  # pushing twice adds nothing
    assert lake.tables()["credit"].num_rows == n_node

    pulled = tmp_path / "pulled.duckdb"
    lake.pull(pulled)
    with tracedb.connect(store, read_only=True) as a, tracedb.connect(pulled, read_only=True) as b:
        for trace_id in _ids(a):
            assert b.trace(trace_id) == a.trace(trace_id), trace_id
        for table in CREDIT:
            assert _credit(b, table).equals(_credit(a, table)), table
        assert b.credit_sets().equals(a.credit_sets())
        for name in ("g2", "n2"):
            assert b.branches(credit=name).equals(a.branches(credit=name)), name


def test_a_push_with_new_traces_and_a_set_for_old_and_new_ones(store, tmp_path):
    with tracedb.connect(store) as db:
        ids = _ids(db)
        half = tmp_path / "half.duckdb"
        shutil.copy(store, half)
    with tracedb.connect(half) as db:
        db.sql(f"DELETE FROM traces WHERE trace_id IN {tuple(ids[len(ids) // 2 :])}")
    lake = lakes.init(tmp_path / "L")
    lake.push(half)
    with tracedb.connect(store) as db:
        _per_trace(db, "n2")
    report = lake.push(store, batch_traces=7)
    assert report.traces == len(ids) - len(ids) // 2 and report.rows["credit_sets"] == 1
    pulled = tmp_path / "pulled.duckdb"
    lake.pull(pulled)
    with tracedb.connect(store, read_only=True) as a, tracedb.connect(pulled, read_only=True) as b:
        assert _credit(b, "credit").equals(_credit(a, "credit"))
        assert b.credit_sets().equals(a.credit_sets())


def test_a_set_the_lake_holds_with_other_values_is_refused(store, tmp_path):
    lake = lakes.init(tmp_path / "L")
    with tracedb.connect(store) as db:
        tracedb.credit.run(db, "grpo", "g2")
        _per_trace(db, "n2")
    lake.push(store)
    with tracedb.connect(store) as db:
        tracedb.credit.run(db, "grpo", "g2", replace=True, scale_std=True)
    with pytest.raises(WriteError, match="credit set 'g2'.*params"):
        lake.push(store)
    with tracedb.connect(store) as db:
        tracedb.credit.run(db, "grpo", "g2", replace=True)
        db.drop_credit_set("n2")
        _per_trace(db, "n2", scale=2.0)  # the same set, other values
    before = _lake_credit(lake)
    with pytest.raises(WriteError, match="credit set 'n2': the lake holds it with other values .*trace"):
        lake.push(store)
    assert _lake_credit(lake) == before  # refused before anything was written


def test_credit_values_show_only_with_their_sets_row(store, tmp_path):
    """A set whose credit_sets row is not committed (a writer died between the values and
    the set) shows no values, neither in lake.tables() nor in lake.sql."""
    from pyiceberg.expressions import EqualTo

    with tracedb.connect(store) as db:
        _per_trace(db, "half")
        _per_trace(db, "whole", scale=2.0)
    lake = lakes.init(tmp_path / "L")
    lake.push(store)
    counts = "SELECT credit_set, count(*) AS n FROM {} GROUP BY ALL ORDER BY ALL"
    before = {t: lake.sql(counts.format(t)).to_pylist() for t in CREDIT}
    assert {r["credit_set"] for t in CREDIT for r in before[t]} >= {"half", "whole"}
    lake.table("credit_sets").delete(EqualTo("name", "half"))  # the set's row never committed
    tables = lake.tables()
    for t in CREDIT:
        assert "half" not in tables[t].column("credit_set").to_pylist(), t
        assert lake.sql(counts.format(t)).to_pylist() == [r for r in before[t] if r["credit_set"] != "half"], t
        raw = lake.table(t).scan().to_arrow().column("credit_set").to_pylist()
        assert ("half" in raw) == any(r["credit_set"] == "half" for r in before[t])  # stored, not shown
    assigned = "SELECT count(*) FILTER (WHERE assigned) AS n FROM node_credit(credit := ?)"
    assert lake.sql(assigned, ["whole"]).column("n")[0].as_py() > 0
    assert lake.sql(assigned, ["half"]).column("n")[0].as_py() == 0


@pytest.mark.parametrize("bad", [0, -3, "8", True])
def test_a_bad_batch_size_is_refused_before_any_write(store, tmp_path, bad):
    lake = lakes.init(tmp_path / "L")
    lake.push(store)
    with tracedb.connect(store) as db:
        tracedb.credit.run(db, "grpo", "late")  # a set the lake lacks: its values would go first
    before = {t: lake.table(t).scan().to_arrow().num_rows for t in (*CREDIT, "credit_sets")}
    with pytest.raises(ValueError, match=f"batch_traces must be an int >= 1, not {bad!r}"):
        lake.push(store, batch_traces=bad)
    assert {t: lake.table(t).scan().to_arrow().num_rows for t in before} == before


def test_values_a_dead_writer_left_are_refused_then_compacted_away(store, tmp_path):
    """A writer of set "g" died after its values, before the set's row: the values stay
    invisible, a push of other values for "g" and a lake credit of "g" are refused naming
    it, and once compaction removed them the push lands the file's values."""
    from tracedb.lake.catalog import BATCH
    from tracedb.lake.scan import visible_traces
    from tracedb.lake.write import lake_rows

    lake = lakes.init(tmp_path / "L")
    lake.push(store)
    shown = visible_traces(lake.table("traces"), columns=["trace_id"]).slice(0, 2)
    dead = pa.table(
        {
            "credit_set": ["g"] * shown.num_rows,
            "trace_id": shown.column("trace_id"),
            "value": pa.array([42.0] * shown.num_rows, pa.float32()),
        }
    )
    rows = lake_rows("trace_credit", dead, "")
    rows = rows.set_column(rows.schema.get_field_index(BATCH), BATCH, shown.column(BATCH))
    lake.table("trace_credit").append(rows)
    assert "g" not in lake.tables()["trace_credit"].column("credit_set").to_pylist()
    with tracedb.connect(store) as db:
        _per_trace(db, "g")
    with pytest.raises(WriteError, match="credit set 'g': the lake holds values of it .* never committed the set"):
        lake.push(store)
    assert "g" not in [s["name"] for s in lake.tables()["credit_sets"].to_pylist()]  # refused before any write
    with pytest.raises(WriteError, match="credit set 'g': the lake holds trace_credit values of it"):
        lake.credit("grpo", name="g")
    lake.compact(grace=0)
    assert "g" not in lake.table("trace_credit").scan().to_arrow().column("credit_set").to_pylist()
    lake.push(store)
    pulled = tmp_path / "pulled.duckdb"
    lake.pull(pulled)
    with tracedb.connect(store, read_only=True) as a, tracedb.connect(pulled, read_only=True) as b:
        for table in CREDIT:
            assert _credit(b, table).equals(_credit(a, table)), table


@pytest.mark.parametrize("name", ["", "  ", " g"], ids=["empty", "blank", "leading-space"])
def test_lake_credit_refuses_a_bad_set_name_before_any_work(tmp_path, name):
    """As the file store's: an empty name used to become the algorithm's. Refused before
    Ray is asked for anything (none runs here) and before the lake is read."""
    lake = lakes.init(tmp_path / "L")
    with pytest.raises(WriteError, match="cannot name a credit set"):
        lake.credit("grpo", name)
    assert lake.table("credit_sets").scan().to_arrow().num_rows == 0


def test_group_keys_are_read_without_a_library_warning(golden_store):
    """The driver's group keys (the file store's trace_rewards over the lake's traces
    rows) are read without DuckDB's warning about Arrow output of a DB-API result, which
    reached the terminal of ``lake credit``."""
    import warnings

    from tracedb.credit.outcome import trace_rewards
    from tracedb.lake import credit

    with tracedb.connect(golden_store, read_only=True) as db:
        traces = db.sql("SELECT trace_id, group_id, reward, ok, is_timeout FROM traces")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        keys = trace_rewards(credit._Traces(traces), reward=None, group_by="group_id", include_failed=False)
    assert len(keys) == traces.num_rows > 0
