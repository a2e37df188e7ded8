"""Golden views: every fixture's branches, as verifiers 0.4.0 computed them, reproduced
exactly by ``db.branches()`` and by the SQL macro ``branch_tokens()``."""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa
import pytest

import tracedb
from tracedb.views import BRANCH_SCHEMA

from support import FIXTURES
from support.golden import OPTIONAL, f32, golden_file, rows_of

NAMES = sorted(p.name.removesuffix(".traces.jsonl") for p in FIXTURES.glob("*.traces.jsonl"))
COLUMNS = [
    "trace_id",
    "branch_index",
    "trainable",
    "token_ids",
    "sampled_mask",
    "logprobs",
    "advantages",
    "reference_logprobs",
    "trainer_logprobs",
    "entropies",
    "loss_weights",
    "policy_version",
]


def golden(name: str) -> list[dict[str, Any]]:
    return golden_file(FIXTURES / f"{name}.branches.json")


def traces_in(name: str) -> list[tuple[str, str, str | None]]:
    """(trace id, episode id, group id) of every trace in a fixture file."""
    out = []
    for line in (FIXTURES / f"{name}.traces.jsonl").read_text().splitlines():
        if line.strip():
            ep = json.loads(line)
            group = (ep.get("group") or {}).get("id")
            out.extend((t["id"], ep["id"], group) for t in ep["traces"])
    return out


@pytest.fixture
def single(fresh_db):
    def load(name: str) -> tracedb.Database:
        report = fresh_db.ingest(FIXTURES / f"{name}.traces.jsonl")
        assert report.ok, [str(r) for r in report.rejected]
        assert report.traces == len(traces_in(name))
        return fresh_db

    return load


def test_fixtures_are_there() -> None:
    assert len(NAMES) >= 13
    for name in NAMES:
        assert (FIXTURES / f"{name}.branches.json").exists(), name


@pytest.mark.parametrize("name", NAMES)
def test_python_view_is_golden(single, name: str) -> None:
    db = single(name)
    table = db.branches()
    assert table.schema.equals(BRANCH_SCHEMA)
    expected = golden(name)
    got = rows_of(table)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g == e, (g["trace_id"], g["branch_index"])


@pytest.mark.parametrize("name", NAMES)
def test_sql_view_is_golden(single, name: str) -> None:
    db = single(name)
    table = db.sql("SELECT * FROM branch_tokens()")
    assert table.column_names == COLUMNS
    expected = golden(name)
    got = rows_of(table)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g == e, (g["trace_id"], g["branch_index"])


def test_all_fixtures_together_are_golden(fixture_db) -> None:
    expected = sorted((r for name in NAMES for r in golden(name)), key=lambda r: (r["trace_id"], r["branch_index"]))
    assert rows_of(fixture_db.branches()) == expected
    assert rows_of(fixture_db.sql("SELECT * FROM branch_tokens()")) == expected


def test_schema_and_column_order(fixture_db) -> None:
    table = fixture_db.branches()
    assert table.schema.names == COLUMNS
    assert BRANCH_SCHEMA.names == COLUMNS
    assert table.schema.equals(BRANCH_SCHEMA)
    for field in table.schema:
        assert field == BRANCH_SCHEMA.field(field.name)
        assert field.nullable == BRANCH_SCHEMA.field(field.name).nullable
    assert BRANCH_SCHEMA.field("token_ids").type == pa.list_(pa.int32())
    assert BRANCH_SCHEMA.field("sampled_mask").type == pa.list_(pa.bool_())
    for name in ("logprobs", *OPTIONAL):
        assert BRANCH_SCHEMA.field(name).type == pa.list_(pa.float32())
    assert BRANCH_SCHEMA.field("loss_weights").type == pa.map_(pa.string(), pa.list_(pa.float32()))
    assert BRANCH_SCHEMA.field("policy_version").type == pa.list_(pa.int32())
    assert table.column("policy_version").null_count == table.num_rows  # 0.4.0 records carry no versions
    assert [f.name for f in BRANCH_SCHEMA if not f.nullable] == [
        "trace_id",
        "branch_index",
        "trainable",
        "token_ids",
        "sampled_mask",
        "logprobs",
        "loss_weights",
    ]


def test_empty_selection_keeps_the_schema(fixture_db) -> None:
    for table in (
        fixture_db.branches(group="no-such-group"),
        fixture_db.branches(trace_ids=[]),
        fixture_db.branches(trace_ids=["no-such-trace"]),
    ):
        assert table.num_rows == 0
        assert table.schema.equals(BRANCH_SCHEMA)


def test_empty_database(fresh_db) -> None:
    table = fresh_db.branches()
    assert table.num_rows == 0
    assert table.schema.equals(BRANCH_SCHEMA)
    assert fresh_db.sql("SELECT * FROM branch_tokens()").num_rows == 0


def test_column_selection(fixture_db) -> None:
    full = fixture_db.branches()
    table = fixture_db.branches(columns=["token_ids", "advantages"])
    assert table.column_names == ["trace_id", "branch_index", "trainable", "token_ids", "advantages"]
    assert table.schema.equals(pa.schema([BRANCH_SCHEMA.field(n) for n in table.column_names]))
    for name in table.column_names:
        assert table.column(name).to_pylist() == full.column(name).to_pylist(), name
    # selection after a full view (decode cache warm) and before one must agree
    again = fixture_db.branches(columns=["advantages"])
    assert again.column("advantages").to_pylist() == full.column("advantages").to_pylist()


def test_column_selection_on_a_cold_database(single) -> None:
    db = single("loss_weights")
    table = db.branches(columns=["loss_weights"])
    assert table.column_names == ["trace_id", "branch_index", "trainable", "loss_weights"]
    expected = golden("loss_weights")
    got = [{k: f32(v) for k, v in dict(r).items()} for r in table.column("loss_weights").to_pylist()]
    assert got == [r["loss_weights"] for r in expected]
    # now ask for more streams than the cached decode holds
    assert rows_of(db.branches()) == expected


def test_unknown_column_is_refused(fixture_db) -> None:
    with pytest.raises(ValueError, match="no_such_column"):
        fixture_db.branches(columns=["token_ids", "no_such_column"])


def test_filter_trace_ids(fixture_db) -> None:
    everything = rows_of(fixture_db.branches())
    wanted = [traces_in("forest")[0][0], traces_in("subagent_fork")[0][0]]
    got = rows_of(fixture_db.branches(trace_ids=wanted))
    assert got == [r for r in everything if r["trace_id"] in wanted]
    assert {r["trace_id"] for r in got} == set(wanted)
    one = rows_of(fixture_db.branches(trace_ids=wanted[0]))  # a single id as a string
    assert one == [r for r in everything if r["trace_id"] == wanted[0]]


def test_filter_group(fixture_db) -> None:
    groups = traces_in("groups")
    assert len({g for _, _, g in groups}) > 1
    expected = golden("groups")
    for group in sorted({g for _, _, g in groups}):
        ids = {t for t, _, g in groups if g == group}
        got = rows_of(fixture_db.branches(group=group))
        assert got == [r for r in expected if r["trace_id"] in ids], group
        assert {r["trace_id"] for r in got} == ids
    two = sorted({g for _, _, g in groups})[:2]
    ids = {t for t, _, g in groups if g in two}
    assert rows_of(fixture_db.branches(group=two)) == [r for r in expected if r["trace_id"] in ids]


def test_filter_episode(fixture_db) -> None:
    (tid, eid, _), *_ = traces_in("compaction")
    assert rows_of(fixture_db.branches(episode=eid)) == golden("compaction")


def test_filter_trainable_drops_rejected_compaction(fixture_db) -> None:
    (tid, _, _), *_ = traces_in("rejected_compaction")
    expected = golden("rejected_compaction")
    assert [r["trainable"] for r in expected] == [False, True]
    got = rows_of(fixture_db.branches(trace_ids=[tid], trainable=True))
    assert got == [expected[1]]
    assert rows_of(fixture_db.branches(trace_ids=[tid], trainable=False)) == [expected[0]]
    everything = rows_of(fixture_db.branches(trainable=True))
    assert all(r["trainable"] for r in everything)
    assert (tid, 0) not in {(r["trace_id"], r["branch_index"]) for r in everything}
    assert (tid, 1) in {(r["trace_id"], r["branch_index"]) for r in everything}


@pytest.mark.parametrize("batch_tokens", [1, 50, 10**9], ids=["trace-per-batch", "small-batches", "one-batch"])
@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"trainable": True},
        {"train_once": True, "columns": ["token_ids", "sampled_mask"]},
        {"columns": ["logprobs"]},
    ],
    ids=["all", "trainable", "train-once", "logprobs"],
)
def test_export_batches_equal_the_view(fixture_db, batch_tokens: int, kwargs: dict[str, Any]) -> None:
    """The batches exports stream (the whole-database read when one batch holds everything,
    per-trace list reads otherwise) join to exactly the in-memory view."""

    expected = fixture_db.branches(**kwargs)
    batches = list(fixture_db.iter_branches(batch_tokens=batch_tokens, **kwargs))
    assert (len(batches) == 1) == (batch_tokens == 10**9)
    assert pa.concat_tables(batches).equals(expected)
    ids = sorted(set(expected.column("trace_id").to_pylist()))[:2]
    some = pa.concat_tables(fixture_db.iter_branches(trace_ids=ids, batch_tokens=batch_tokens, **kwargs))
    assert some.equals(fixture_db.branches(trace_ids=ids, **kwargs))
