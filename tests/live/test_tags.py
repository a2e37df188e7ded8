"""Ingest tags (``db.ingest(tags=...)``, ``trace_tags``): constants and JSON paths into the
trace's and the episode's record, the refusals of bad specs, the ``tags=`` filter of the
reads (equality and ranges), tags only on the traces an ingest adds, SQL over the table,
and ``tracedb ingest --tag``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

import tracedb

from support import FIXTURES

GROUPS = FIXTURES / "groups.traces.jsonl"
LINEAR = FIXTURES / "linear.traces.jsonl"

SPECS = [
    "step=12",
    "name=abc",
    "flag=true",
    'obj={"a": 1}',
    "turns=$.metrics.turns",
    "gid=$.group.id",  # an episode field: found through the fallback
    "eonly=$episode.group.id",
    "tonly=$trace.group.id",  # traces have no group: no row
    "missing=$.nope.x",
    "idx=$.rewards.resolved.score",
    "first_allow=$.task.data.network_allow[0]",
    'quoted=$["metrics"]["turns"]',
]


# --------------------------------------------------------------------------- helpers


def lines_of(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.strip()]


def write_lines(path: Path, lines: Sequence[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def tag_rows(db: tracedb.Database, name: str | None = None) -> dict[tuple[str, str], dict[str, Any]]:
    """(trace id, name) -> the row of ``trace_tags`` (failing on a (trace, name) twice)."""
    rows = db.sql(
        "SELECT * FROM trace_tags" + ("" if name is None else " WHERE name = ?"), None if name is None else [name]
    )
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for row in rows.to_pylist():
        key = (row["trace_id"], row["name"])
        assert key not in out, f"two rows for {key}"
        out[key] = row
    return out


def typed(value: Any) -> tuple[str, Any]:
    """A value with its JSON type (so 12 and 12.0 and True differ)."""
    return type(value).__name__, value


def trace_ids(table: Any) -> set[str]:
    return set(table.column("trace_id").to_pylist())


# --------------------------------------------------------------------------- values


@pytest.fixture(scope="module")
def tagged_db():
    """The groups fixture ingested with :data:`SPECS`."""
    with tracedb.connect(":memory:") as db:
        report = db.ingest(GROUPS, tags=SPECS)
        assert report.ok and report.traces == 32
        yield db


def test_each_trace_gets_one_row_per_tag_that_has_a_value(tagged_db):
    rows = tag_rows(tagged_db)
    episodes = [json.loads(line) for line in lines_of(GROUPS)]
    present = {"step", "name", "flag", "obj", "turns", "gid", "eonly", "idx", "first_allow", "quoted"}
    assert len(rows) == 32 * len(present)
    for episode in episodes:
        (trace,) = episode["traces"]
        tid = trace["id"]
        names = {name for t, name in rows if t == tid}
        assert names == present  # tonly (not on the trace) and missing have no row
        expected = {
            "step": 12,
            "name": "abc",
            "flag": True,
            "obj": {"a": 1},
            "turns": trace["metrics"]["turns"],
            "gid": episode["group"]["id"],
            "eonly": episode["group"]["id"],
            "idx": trace["rewards"]["resolved"]["score"],
            "first_allow": trace["task"]["data"]["network_allow"][0],
            "quoted": trace["metrics"]["turns"],
        }
        for name, want in expected.items():
            row = rows[(tid, name)]
            assert typed(json.loads(row["value"])) == typed(want), name
            is_number = isinstance(want, (int, float)) and not isinstance(want, bool)
            assert row["number"] == (float(want) if is_number else None), name
            assert row["text"] == (want if isinstance(want, str) else None), name
    # the fixture really varies: the values are read per trace, not once
    assert len({rows[(e["traces"][0]["id"], "turns")]["number"] for e in episodes}) > 1
    assert {rows[(e["traces"][0]["id"], "gid")]["text"] for e in episodes} == {f"group-{g}" for g in range(4)}


def test_the_number_column_holds_numbers_and_not_bools(tagged_db):
    numbers = tagged_db.sql("SELECT DISTINCT name FROM trace_tags WHERE number IS NOT NULL ORDER BY name")
    assert numbers.column("name").to_pylist() == ["idx", "quoted", "step", "turns"]
    step = tagged_db.sql("SELECT DISTINCT number, value::VARCHAR AS v FROM trace_tags WHERE name = 'step'").to_pylist()
    assert step == [{"number": 12.0, "v": "12"}]


def test_traces_list_each_traces_tags_as_a_json_object(tagged_db):
    table = tagged_db.traces(limit=1)
    (row,) = table.to_pylist()
    trace = json.loads(lines_of(GROUPS)[0])["traces"][0]
    assert row["trace_id"] == trace["id"]
    tags = json.loads(row["tags"])
    assert tags["step"] == 12 and tags["flag"] is True and tags["obj"] == {"a": 1}
    assert tags["turns"] == trace["metrics"]["turns"] and tags["gid"] == "group-0"
    assert "tonly" not in tags and "missing" not in tags


def test_an_episode_path_reads_the_episode_of_a_new_trace_in_a_stored_episode(fresh_db, tmp_path):
    line = lines_of(GROUPS)[9]
    assert fresh_db.ingest(write_lines(tmp_path / "a.jsonl", [line])).ok
    record = json.loads(line)
    record["traces"][0]["id"] += "-second"  # the same episode, one more trace
    report = fresh_db.ingest(write_lines(tmp_path / "b.jsonl", [json.dumps(record)]), tags=["gid=$episode.group.id"])
    assert (report.traces, report.episodes) == (1, 0)
    rows = tag_rows(fresh_db)
    assert list(rows) == [(record["traces"][0]["id"], "gid")]
    assert rows[(record["traces"][0]["id"], "gid")]["text"] == record["group"]["id"]


def test_a_trace_field_wins_over_the_episode_field_of_the_same_path(fresh_db, tmp_path):
    record = json.loads(lines_of(GROUPS)[0])
    record["info"] = {"where": "episode", "only_episode": 1}
    record["traces"][0]["info"] = {"where": "trace"}
    fresh_db.ingest(
        write_lines(tmp_path / "a.jsonl", [json.dumps(record)]),
        tags=["w=$.info.where", "e=$.info.only_episode", "ew=$episode.info.where"],
    )
    tid = record["traces"][0]["id"]
    rows = tag_rows(fresh_db)
    assert rows[(tid, "w")]["text"] == "trace"
    assert rows[(tid, "e")]["number"] == 1.0  # not on the trace: the episode's
    assert rows[(tid, "ew")]["text"] == "episode"


def test_a_path_to_a_null_stores_a_json_null(fresh_db, tmp_path):
    record = json.loads(lines_of(GROUPS)[0])
    record["traces"][0]["info"] = {"none": None}
    fresh_db.ingest(write_lines(tmp_path / "a.jsonl", [json.dumps(record)]), tags=["n=$.info.none"])
    (row,) = tag_rows(fresh_db).values()
    assert (row["value"], row["number"], row["text"]) == ("null", None, None)


def test_a_non_finite_number_in_a_record_gives_no_tag():
    # JSON lines cannot hold one (ingest rejects them), so this is the rule itself.
    from tracedb.ingest.tags import parse_tags
    from tracedb.ingest.tags import tag_rows as rows_of

    tags = parse_tags(["x=$.x", "y=$.y", "z=$.z"])
    record = {"x": float("inf"), "y": [1, float("nan")], "z": 2}
    assert [(name, number) for _, name, _, number, _ in rows_of(tags, "t", record, None)] == [("z", 2.0)]


def test_the_nodes_and_traces_the_records_leave_out_give_no_tag(fresh_db):
    fresh_db.ingest(LINEAR, tags=["nodes=$.nodes", "traces=$.traces", "tnodes=$trace.nodes", "etraces=$episode.traces"])
    assert tag_rows(fresh_db) == {}


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "spec",
    ["noequals", "=x", "a b=1", "x=$.", "x=$.a[", "x=$", "x=$.a..b", "x=NaN", "x=Infinity", "x=-Infinity", "x=1e999"],
)
def test_a_bad_spec_is_refused_naming_it_and_writes_nothing(fresh_db, spec):
    with pytest.raises(ValueError) as info:
        fresh_db.ingest(LINEAR, tags=["ok=1", spec])
    assert repr(spec) in str(info.value)
    assert fresh_db.watermark() == 0
    assert fresh_db.sql("SELECT count(*) AS n FROM traces").column("n")[0].as_py() == 0


def test_a_name_given_twice_is_refused_naming_it(fresh_db):
    with pytest.raises(ValueError, match="given twice.*\\ba\\b"):
        fresh_db.ingest(LINEAR, tags=["a=1", "b=1", "a=2"])
    with pytest.raises(ValueError, match="given twice"):
        fresh_db.ingest(LINEAR, tags=["a=1", "a=$.metrics.turns"])
    assert fresh_db.watermark() == 0


@pytest.mark.parametrize("spec", ["x=[NaN]", 'x={"a": Infinity}'])
def test_a_constant_holding_a_non_finite_number_anywhere_is_refused(fresh_db, spec):
    with pytest.raises(ValueError, match="finite"):
        fresh_db.ingest(LINEAR, tags=[spec])


def test_a_constant_that_is_not_json_is_a_string(fresh_db):
    fresh_db.ingest(LINEAR, tags=["s=hello world", "e=", "n=12abc", 'q="12"'])
    rows = {name: row for (_, name), row in tag_rows(fresh_db).items()}
    assert rows["s"]["text"] == "hello world" and rows["s"]["value"] == '"hello world"'
    assert rows["e"]["text"] == ""
    assert rows["n"]["text"] == "12abc" and rows["n"]["number"] is None
    assert rows["q"]["text"] == "12" and rows["q"]["number"] is None  # a JSON string stays one


# --------------------------------------------------------------------------- filters


@pytest.fixture(scope="module")
def filter_db(tmp_path_factory):
    """groups lines 0-7: step 12, alpha, flag true; 8-15: step 20, beta, flag false;
    16-23: step 7.5, gamma; 24-31: no tags."""
    folder = tmp_path_factory.mktemp("tags")
    lines = lines_of(GROUPS)
    parts = [
        ["step=12", "name=alpha", "flag=true", 'obj={"a": 1}'],
        ["step=20", "name=beta", "flag=false", 'obj={"a": 2}'],
        ["step=7.5", "name=gamma"],
        [],
    ]
    ids: dict[str, set[str]] = {}
    with tracedb.connect(":memory:") as db:
        for k, (key, tags) in enumerate(zip("ABCD", parts, strict=True)):
            chunk = lines[8 * k : 8 * k + 8]
            report = db.ingest(write_lines(folder / f"{key}.jsonl", chunk), tags=tags)
            assert report.traces == 8
            ids[key] = {json.loads(line)["traces"][0]["id"] for line in chunk}
        yield db, ids


FILTERS = [
    ({"step": 12}, "A"),
    ({"step": 12.0}, "A"),
    ({"step": 7.5}, "C"),
    ({"step": "12"}, ""),  # a string is not the number
    ({"step": True}, ""),
    ({"name": "beta"}, "B"),
    ({"name": "Beta"}, ""),
    ({"flag": True}, "A"),
    ({"flag": False}, "B"),
    ({"flag": 1}, ""),  # a bool is not a number
    ({"obj": {"a": 2}}, "B"),
    ({"step": (10, 20)}, "AB"),
    ({"step": (12, 12)}, "A"),
    ({"step": (12.5, 19.99)}, ""),
    ({"step": (None, 12)}, "AC"),
    ({"step": (12, None)}, "AB"),
    ({"step": (7.5, 7.5)}, "C"),
    ({"step": (None, None)}, "ABC"),
    ({"name": ("b", "c")}, "B"),
    ({"name": ("alpha", "beta")}, "AB"),
    ({"name": ("beta", None)}, "BC"),
    ({"name": (None, "alpha")}, "A"),
    ({"step": (1, 100), "name": "alpha"}, "A"),
    ({"step": 12, "name": "beta"}, ""),
    ({"nope": 1}, ""),
    ({"name": (0, 100)}, ""),  # a number range over string tags
]


@pytest.mark.parametrize(("tags", "want"), FILTERS, ids=[repr(t) for t, _ in FILTERS])
def test_tag_filters_select_the_traces_they_match(filter_db, tags, want):
    db, ids = filter_db
    expected = set().union(*(ids[k] for k in want)) if want else set()
    assert trace_ids(db.traces(tags=tags)) == expected
    assert trace_ids(db.branches(tags=tags, columns=["trace_id"])) == expected


def test_tag_filters_combine_with_after_and_reach_export_and_micro_batches(filter_db, tmp_path):
    db, ids = filter_db
    assert trace_ids(db.traces(tags={"step": (None, None)}, after=8)) == ids["B"] | ids["C"]
    result = db.export(tmp_path / "b.parquet", tags={"name": "beta"})
    assert set(pq.read_table(tmp_path / "b.parquet").column("trace_id").to_pylist()) == ids["B"]
    assert result["rows"] > 0
    plan = db.micro_batches(4096, tags={"flag": True})
    packed = {t for rank in plan for mb in rank for t in mb.samples.column("trace_id").to_pylist()}
    assert packed and packed <= ids["A"]


@pytest.mark.parametrize("bad", [(1, "z"), ("a", 2), (1, 2, 3), (True, 2)])
def test_a_range_mixing_types_or_of_the_wrong_length_is_refused(filter_db, bad):
    db, _ = filter_db
    with pytest.raises(ValueError, match="step"):
        db.traces(tags={"step": bad})
    with pytest.raises(ValueError, match="step"):
        db.branches(tags={"step": bad})


def test_tags_go_only_on_the_traces_an_ingest_adds(fresh_db, tmp_path):
    lines = lines_of(GROUPS)
    head = write_lines(tmp_path / "head.jsonl", lines[:4])
    more = write_lines(tmp_path / "more.jsonl", lines[:8] + lines[2:3])  # 4 stored, 4 new, one twice
    assert fresh_db.ingest(head, tags=["step=1"]).traces == 4
    again = fresh_db.ingest(head, tags=["step=99", "other=x"])
    assert again.traces == 0 and again.skipped == 4
    assert len(tag_rows(fresh_db)) == 4
    report = fresh_db.ingest(more, tags=["step=2"])
    assert (report.traces, report.skipped) == (4, 5)
    rows = tag_rows(fresh_db)  # one row per trace and name
    ids = [json.loads(line)["traces"][0]["id"] for line in lines[:8]]
    assert {t: r["number"] for (t, _), r in rows.items()} == {
        **dict.fromkeys(ids[:4], 1.0),
        **dict.fromkeys(ids[4:], 2.0),
    }
    assert trace_ids(fresh_db.traces(tags={"step": 2})) == set(ids[4:])


def test_an_aborted_ingest_leaves_no_tags(fresh_db, tmp_path):
    bad = write_lines(tmp_path / "bad.jsonl", lines_of(GROUPS)[:2] + ['{"id": "broken", "traces": ['])
    with pytest.raises(tracedb.IngestAborted):
        fresh_db.ingest(bad, strict=True, tags=["step=1"])
    assert tag_rows(fresh_db) == {}


# --------------------------------------------------------------------------- SQL and CLI


def test_trace_tags_are_usable_from_sql(filter_db):
    db, ids = filter_db
    table = db.sql(
        "SELECT t.trace_id, g.number FROM traces t JOIN trace_tags g USING (trace_id) "
        "WHERE g.name='step' AND g.number >= 10 ORDER BY g.number"
    )
    numbers = table.column("number").to_pylist()
    assert numbers == [12.0] * 8 + [20.0] * 8
    assert set(table.column("trace_id").to_pylist()[:8]) == ids["A"]
    assert set(table.column("trace_id").to_pylist()[8:]) == ids["B"]
    by_json = db.sql("SELECT count(*) AS n FROM trace_tags WHERE name = 'obj' AND value->>'$.a' = '2'")
    assert by_json.column("n")[0].as_py() == 8


def cli_has_tag() -> bool:
    from tracedb.cli.main import app

    result = CliRunner().invoke(app, ["ingest", "--help"], terminal_width=200)
    return "--tag" in result.output


def test_cli_ingest_stores_tags(tmp_path):
    if not cli_has_tag():
        pytest.skip("no --tag in CLI yet")
    from tracedb.cli.main import app

    path = tmp_path / "runs.duckdb"
    args = ["ingest", str(GROUPS), "--db", str(path), "--no-progress", "--tag", "step=3", "--tag", "gid=$.group.id"]
    result = CliRunner().invoke(app, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    with tracedb.connect(path, read_only=True) as db:
        rows = tag_rows(db)
        assert len(rows) == 64
        assert trace_ids(db.traces(tags={"step": 3, "gid": "group-2"})) == {
            json.loads(line)["traces"][0]["id"]
            for line in lines_of(GROUPS)
            if json.loads(line)["group"]["id"] == "group-2"
        }

    bad = CliRunner().invoke(app, ["ingest", str(LINEAR), "--db", str(path), "--no-progress", "--tag", "noequals"])
    assert bad.exit_code == 2  # bad usage
    assert not isinstance(bad.exception, ValueError), "a bad --tag is a message, not a traceback"
    assert "noequals" in bad.stderr
    with tracedb.connect(path, read_only=True) as db:
        assert db.watermark() == 32  # nothing written
