"""The lake without Ray: making and opening one, push/pull, the visibility rule, SQL."""

from __future__ import annotations

import json
import threading

import pyarrow as pa
import pytest

import tracedb

from support import FIXTURES

pytest.importorskip("pyiceberg", reason="the lake extra is not installed (pip install '.[lake]')")
pytest.importorskip("pyiceberg_core", reason="the lake extra is not installed (pip install '.[lake]')")

import tracedb.lake as lakes  # noqa: E402
from tracedb import tables  # noqa: E402
from tracedb.lake import catalog, files, read, write  # noqa: E402


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A file store holding every golden fixture."""
    path = tmp_path_factory.mktemp("store") / "runs.duckdb"
    with tracedb.connect(path) as db:
        db.ingest(FIXTURES)
        db.create_credit_set("manual", description="a set made by hand")
    return path


@pytest.fixture(scope="module")
def pushed(store, tmp_path_factory):
    """A local lake the store was pushed into (in two writes)."""
    lake = lakes.init(tmp_path_factory.mktemp("lake") / "L")
    report = lake.push(store, batch_traces=30)
    return lake, report


def test_init_makes_the_stored_tables(tmp_path):
    lake = lakes.init(tmp_path / "L")
    assert lakes.init(tmp_path / "lake.v1").watermark() == 0  # a dot in a directory's name
    assert (tmp_path / "L" / "catalog.db").is_file() and (tmp_path / "L" / "warehouse").is_dir()
    expected = {n: s for n, s in tables.STORED.items() if n not in catalog.FILE_ONLY}
    assert set(lake._tables) == {"tracedb_meta", *expected}
    for name, schema in expected.items():
        arrow = lake.table(name).schema().as_arrow()
        names = [*schema.names, *([catalog.BATCH] if catalog.batched(name, schema) else [])]
        names += [catalog.SEGMENT_HOME] if name == "segments" else []
        assert arrow.names == names, name
        assert catalog.lake_columns(name) == names[len(schema.names) :], name
    read_back = lake.tables()
    for name, schema in expected.items():  # what readers get: the stored schema (nullable)
        want = pa.schema([f.with_nullable(True) for f in schema]).remove_metadata()
        assert read_back[name].schema.remove_metadata() == want, name
    spec = lake.table("nodes").spec()
    buckets = f"bucket[{catalog.DEFAULT_BUCKETS}]"
    assert [(f.name, str(f.transform)) for f in spec.fields] == [("trace_id_bucket", buckets)]
    assert [(f.name, str(f.transform)) for f in lake.table("segments").spec().fields] == [
        ("lake_trace_bucket", buckets)
    ]
    meta = lake.table("tracedb_meta").scan().to_arrow().to_pylist()
    assert meta == [
        {"key": "lake_schema_version", "value": str(lakes.LAKE_SCHEMA_VERSION)},
        {"key": "buckets", "value": str(catalog.DEFAULT_BUCKETS)},
    ]
    assert lake.buckets == catalog.DEFAULT_BUCKETS
    again = lakes.init(tmp_path / "L")  # idempotent
    assert again.table("tracedb_meta").scan().to_arrow().num_rows == 2


def test_the_bucket_count_is_chosen_at_init_and_kept(tmp_path, store):
    lake = lakes.init(tmp_path / "L", buckets=4)
    assert lake.buckets == 4 and lakes.init(tmp_path / "L").buckets == 4
    for name in ("traces", "nodes", "segments", "episodes"):
        assert [str(f.transform) for f in lake.table(name).spec().fields] == ["bucket[4]"], name
    with pytest.raises(lakes.LakeError, match="it has 4 buckets, fixed when it was made \\(not 8\\)"):
        lakes.init(tmp_path / "L", buckets=8)
    for bad in (0, -1, 5000, True, 2.5):
        with pytest.raises(ValueError, match="buckets is an int from 1 to 4096"):
            lakes.init(tmp_path / "M", buckets=bad)
    lake.push(store)
    partitions = {f.partition for f in files.live_files(lake.table("nodes"))}
    assert partitions <= {(b,) for b in range(4)} and len(partitions) == 4


def test_open_refuses_what_is_not_a_lake(tmp_path):
    with pytest.raises(lakes.LakeError, match="no lake here.*tracedb lake init"):
        lakes.open(tmp_path)
    (tmp_path / "x.txt").write_text("")
    with pytest.raises(lakes.LakeError, match="neither a directory nor"):
        lakes.open(tmp_path / "x.txt")
    with pytest.raises(lakes.LakeError, match="no such catalog properties file"):
        lakes.open(tmp_path / "missing.yaml")
    (tmp_path / "bad.json").write_text("[1, 2")
    with pytest.raises(lakes.LakeError, match="bad.json: not readable as json"):
        lakes.open(tmp_path / "bad.json")


def test_open_by_catalog_properties(tmp_path, store):
    lakes.init(tmp_path / "L")
    props = {
        "type": "sql",
        "uri": f"sqlite:///{tmp_path / 'L' / 'catalog.db'}",
        "warehouse": (tmp_path / "L" / "warehouse").as_uri(),
    }
    (tmp_path / "lake.json").write_text(json.dumps(props))
    (tmp_path / "lake.yaml").write_text("".join(f"{k}: '{v}'\n" for k, v in props.items()))
    lakes.open(tmp_path / "lake.json").push(store)
    assert lakes.open(tmp_path / "lake.yaml").watermark() == 1
    other = {**props, "namespace": "elsewhere"}
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(lakes.LakeError, match="'elsewhere' holds no tracedb lake"):
        lakes.open(tmp_path / "other.json")


def test_push_is_idempotent_and_seq_is_the_commit(pushed, store):
    lake, report = pushed
    with tracedb.connect(store, read_only=True) as db:
        n = db.sql("SELECT count(*) AS n FROM traces").column("n")[0].as_py()
    assert report.traces == n and report.skipped == 0
    again = lake.push(store)
    assert again.traces == 0 and again.skipped == n and again.rows == {}
    traces = lake.tables()["traces"]
    assert traces.num_rows == n
    snapshots = [s.sequence_number for s in lake.table("traces").metadata.snapshots]
    assert sorted(set(traces.column("seq").to_pylist())) == snapshots == [1, 2]
    assert traces.column("seq").to_pylist().count(1) == 30  # the first write's traces
    assert lake.watermark() == 2
    assert read.visible(lake, after=1)["traces"].num_rows == n - 30


def test_pull_round_trips_every_record(pushed, store, tmp_path):
    lake, _ = pushed
    assert lake.pull(tmp_path / "local.duckdb") > 0
    assert lake.pull(tmp_path / "local.duckdb") == 0  # idempotent
    with tracedb.connect(store, read_only=True) as a, tracedb.connect(tmp_path / "local.duckdb", read_only=True) as b:
        ids = a.sql("SELECT trace_id FROM traces ORDER BY trace_id").column("trace_id").to_pylist()
        for trace_id in ids:
            assert b.trace(trace_id) == a.trace(trace_id), trace_id
        episodes = a.sql("SELECT episode_id FROM episodes").column("episode_id").to_pylist()
        for episode_id in episodes:
            assert b.episode(episode_id) == a.episode(episode_id)
        assert b.branches().equals(a.branches())
        assert b.credit_sets().equals(a.credit_sets())
        for name in ("segments", "nodes", "branches", "trace_tags", "rejects"):
            q = f"SELECT * EXCLUDE ({'rejected_at' if name == 'rejects' else 'x'}) FROM {name} ORDER BY ALL"
            q = q.replace(" EXCLUDE (x)", "")
            assert b.sql(q).equals(a.sql(q)), name
        assert b.watermark() == len(ids)


def test_pull_a_selection(pushed, store, tmp_path):
    lake, _ = pushed
    with tracedb.connect(store, read_only=True) as a:
        groups = a.sql("SELECT group_id, count(*) AS n FROM traces WHERE group_id IS NOT NULL GROUP BY 1 ORDER BY 1")
        ids = a.sql("SELECT trace_id FROM traces ORDER BY trace_id LIMIT 3").column("trace_id").to_pylist()
    group, size = groups.column("group_id")[0].as_py(), groups.column("n")[0].as_py()
    assert lake.pull(tmp_path / "g.duckdb", group=group) == size
    assert lake.pull(tmp_path / "t.duckdb", trace_ids=ids) == 3
    with tracedb.connect(tmp_path / "t.duckdb", read_only=True) as b:
        assert sorted(b.sql("SELECT trace_id FROM traces").column("trace_id").to_pylist()) == ids
        used = b.sql("SELECT count(DISTINCT segment_id) AS n FROM nodes").column("n")[0].as_py()
        assert b.sql("SELECT count(*) AS n FROM segments").column("n")[0].as_py() == used
    assert lake.pull(tmp_path / "none.duckdb", trace_ids=["no-such-trace"]) == 0


def test_a_write_without_its_traces_row_is_invisible(tmp_path, store):
    """A killed writer (rows, no traces commit) and a writer that lost the race for a
    trace id (its rows are there under another batch) leave nothing a reader sees."""
    lake = lakes.init(tmp_path / "L")
    with tracedb.connect(store, read_only=True) as db:
        from tracedb.lake.move import file_rows

        ids = db.sql("SELECT trace_id FROM traces ORDER BY trace_id LIMIT 4").column("trace_id").to_pylist()
        rows = file_rows(db, ids)
    killed = {k: v for k, v in rows.items() if k != "traces"}
    lake.append({**killed, "traces": rows["traces"].slice(0, 0)})  # nothing committed as traces
    for name in ("nodes", "branches", "episodes"):
        lake.table(name).append(write.lake_rows(name, rows[name], "killed-writer"))
    assert lake.tables()["nodes"].num_rows == 0 and lake.tables()["segments"].num_rows == 0
    lake.append(rows)
    visible = lake.tables()
    with tracedb.connect(store, read_only=True) as db:
        n_nodes = db.sql(f"SELECT count(*) AS n FROM nodes WHERE trace_id IN {tuple(ids)}").column("n")[0].as_py()
    assert visible["nodes"].num_rows == n_nodes
    assert lake.table("nodes").scan().to_arrow().num_rows == 2 * n_nodes  # the killed write's rows stay
    assert visible["episodes"].num_rows == 4


def test_the_trace_check_is_made_again_on_every_commit_attempt(tmp_path, store, monkeypatch):
    """A writer whose first look saw none of the ids, while another committed them: its
    traces commit re-checks and adds nothing."""
    lake = lakes.init(tmp_path / "L")
    with tracedb.connect(store, read_only=True) as db:
        from tracedb.lake.move import file_rows

        ids = db.sql("SELECT trace_id FROM traces ORDER BY trace_id LIMIT 5").column("trace_id").to_pylist()
        rows = file_rows(db, ids)
    real = write.visible_ids
    looks = []

    def first_look_blind(table, wanted):
        looks.append(len(looks))
        if len(looks) == 1:  # the first look (before the rows are written): another writer commits now
            lake.append({"traces": rows["traces"].slice(0, 2), "nodes": rows["nodes"], "segments": rows["segments"]})
            return set()
        return real(table, wanted)

    monkeypatch.setattr(write, "visible_ids", first_look_blind)
    report = lake.append(rows)
    assert report.traces == 3 and report.skipped == 2
    traces = lake.tables()["traces"]
    assert sorted(traces.column("trace_id").to_pylist()) == ids


def test_concurrent_pushes_of_one_store_lose_and_duplicate_nothing(tmp_path, store):
    lake = lakes.init(tmp_path / "L")
    reports, errors = [], []

    def push():
        try:
            reports.append(lakes.open(tmp_path / "L").push(store, batch_traces=11))
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=push) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors
    with tracedb.connect(store, read_only=True) as db:
        n = db.sql("SELECT count(*) AS n FROM traces").column("n")[0].as_py()
        n_nodes = db.sql("SELECT count(*) AS n FROM nodes").column("n")[0].as_py()
    assert sum(r.traces for r in reports) == n
    visible = lake.tables()
    assert visible["traces"].num_rows == n and visible["nodes"].num_rows == n_nodes
    assert len(set(visible["segments"].column("segment_id").to_pylist())) == visible["segments"].num_rows


QUERIES = [
    "SELECT * FROM branch_stats() ORDER BY ALL",
    "SELECT * FROM trace_summary() ORDER BY ALL",
    "SELECT * FROM node_credit() ORDER BY ALL",
    "SELECT trace_id, branch_index, token_ids, advantages FROM branch_tokens(train_once := true) ORDER BY ALL",
    "SELECT group_id, count(*) AS n, avg(reward) AS r FROM traces GROUP BY ALL ORDER BY ALL",
]


@pytest.mark.parametrize("query", QUERIES)
def test_sql_macros_give_the_file_stores_answers(pushed, store, query):
    lake, _ = pushed
    with tracedb.connect(store, read_only=True) as db:
        expected = db.sql(query)
    got = lake.sql(query)
    assert got.num_rows == expected.num_rows > 0
    assert got.equals(expected)


def test_sql_takes_parameters_and_names_errors(pushed):
    lake, _ = pushed
    assert lake.sql("SELECT count(*) AS n FROM traces WHERE reward > ?", [0.5]).num_rows == 1
    with pytest.raises(Exception, match="no_such_table"):
        lake.sql("SELECT * FROM no_such_table")
