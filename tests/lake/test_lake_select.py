"""Live-run selections on a lake (``complete_groups=``, ``tags=`` with ``after`` /
``through``): the traces ``select_ids`` and ``lake.micro_batches`` take equal the file
store's on the same traces, with its errors for bad values (no Ray needed).

A file store of interleaved group members (four ingests, three tagged; one group never
reaches 8 members) is pushed into a lake seven traces per write. The pushed writes cut
the file store's sequence numbers into ranges, so the lake's ``seq`` ``w`` is the file
store's watermark ``bound[w]`` (the last file seq of write ``w``): a lake selection at
``after=w`` / ``through=w`` is the file store's at ``bound[w]``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import tracedb

from support import FIXTURES
from support.plans import assert_same_step  # noqa: E402

pytest.importorskip("pyiceberg_core", reason="the lake extra is not installed (pip install '.[lake]')")

import tracedb.lake as lakes  # noqa: E402
from tracedb.cli.main import app  # noqa: E402
from tracedb.lake.select import resolve_lake, select_ids  # noqa: E402
from tracedb.selection import Selection  # noqa: E402

# (group, member) of each ingest; sizes after them: g0 6/8/8/8, g1 2/6/6/8, g2 0/4/8/8, g3 0/0/7/7
STEPS = [
    [(0, 0), (1, 0), (0, 1), (0, 2), (1, 1), (0, 3)],
    [(2, 0), (0, 4), (1, 2), (2, 1), (1, 3), (0, 5), (2, 2), (1, 4), (2, 3), (0, 6), (1, 5)],
    [(3, 0), (2, 4), (3, 1), (0, 7), (3, 2), (2, 5), (3, 3), (2, 6), (3, 4), (3, 5), (2, 7), (3, 6)],
    [(1, 6), (1, 7)],
]
TAGS = [
    ["step=1", "name=alpha", "flag=true"],
    ["step=2", "name=beta", 'obj={"a": 1}'],
    ["step=2.5", "name=gamma", "flag=false"],
    [],
]
WRITE = 7
"""Traces per lake write."""


def _lines(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """(file store, lake, bound): ``bound[w]`` is the file store's seq matching the lake's ``w``."""
    folder = tmp_path_factory.mktemp("select")
    members: dict[str, list[str]] = {}
    for line in _lines(FIXTURES / "groups.traces.jsonl"):
        members.setdefault(json.loads(line)["group"]["id"], []).append(line)
    db = tracedb.connect(folder / "runs.duckdb")
    for k, (step, tags) in enumerate(zip(STEPS, TAGS, strict=True)):
        chunk = [members[f"group-{g}"][i] for g, i in step]
        if k == len(STEPS) - 1:
            chunk += _lines(FIXTURES / "linear.traces.jsonl")  # a trace of no group
        path = folder / f"step{k}.jsonl"
        path.write_text("".join(line + "\n" for line in chunk))
        assert db.ingest(path, tags=tags).traces == len(chunk)
    lake = lakes.init(folder / "L")
    lake.push(db, batch_traces=WRITE)
    rows = db.sql("SELECT trace_id, seq FROM traces").to_pylist()
    file_seq = {r["trace_id"]: r["seq"] for r in rows}
    lake_rows = lake.tables()["traces"].select(["trace_id", "seq"]).to_pylist()
    bound = {0: 0}
    for r in lake_rows:
        bound[r["seq"]] = max(bound.get(r["seq"], 0), file_seq[r["trace_id"]])
    assert sorted(bound) == list(range(len(bound))) and len(bound) == 1 + -(-len(rows) // WRITE)
    assert lake.watermark() == max(bound) and bound[max(bound)] == db.watermark()
    db.close()
    with tracedb.connect(folder / "runs.duckdb", read_only=True) as db:
        yield db, lake, bound


def _file(bound: dict[int, int], mark: int | None) -> int | None:
    """The file store's watermark for the lake's ``mark`` (past the lake's: past the file's)."""
    if mark is None:
        return None
    top = max(bound)
    return bound[mark] if mark <= top else bound[top] + (mark - top)


def _expected(db, bound, **selection) -> list[str]:
    for key in ("after", "through"):
        selection[key] = _file(bound, selection.get(key))
    return db.branches(columns=["trace_id"], **selection).column("trace_id").unique().to_pylist()


def _ordered(db, ids: list[str]) -> bool:
    """Whether ``ids`` are ordered by group (no group last) then trace id."""
    rows = db.sql("SELECT trace_id, group_id FROM traces").to_pylist()
    groups = {r["trace_id"]: r["group_id"] for r in rows}
    keys = [(groups[t] is None, groups[t] or "", t) for t in ids]
    return keys == sorted(keys)


MARKS = [(None, None), (2, None), (None, 3), (1, 4), (3, 9)]
"""(after, through) pairs, in lake seqs (9: past the lake's watermark)."""


@pytest.mark.parametrize("complete_groups", [None, 4, 8])
@pytest.mark.parametrize(
    "tags",
    [None, {"step": (1.5, None)}, {"name": ("alpha", "beta"), "flag": True}],
    ids=["untagged", "step-range", "name-and-flag"],
)
def test_selections_equal_the_file_stores(stores, complete_groups, tags):
    db, lake, bound = stores
    sizes = set()
    for after, through in MARKS:
        got = select_ids(lake, Selection(after=after, through=through, complete_groups=complete_groups, tags=tags))
        want = _expected(db, bound, after=after, through=through, complete_groups=complete_groups, tags=tags)
        assert sorted(got) == sorted(want), (after, through)
        assert _ordered(db, got)
        sizes.add(len(got))
    assert len(sizes) > 1  # the grid selects different traces


@pytest.mark.parametrize(
    "tags",
    [
        {"step": 2},
        {"step": 2.0},
        {"step": "2"},  # a string is not the number
        {"flag": True},
        {"flag": False},
        {"flag": 1},  # a bool is not a number
        {"name": "gamma"},
        {"name": ("b", None)},
        {"obj": {"a": 1}},
        {"step": (None, None)},
        {"nope": 1},
        {"name": (0, 100)},  # a number range over string tags
    ],
    ids=repr,
)
def test_tag_filters_equal_the_file_stores(stores, tags):
    db, lake, bound = stores
    assert sorted(select_ids(lake, Selection(tags=tags))) == sorted(_expected(db, bound, tags=tags))


def test_complete_groups_of_a_narrowed_selection_count_every_member(stores):
    """trace_ids / episode / group keep part of a group: its completeness still counts
    all its members (read from the lake though the scan is narrowed)."""
    db, lake, bound = stores
    rows = db.sql("SELECT trace_id, episode_id, group_id FROM traces ORDER BY trace_id").to_pylist()
    half = [r["trace_id"] for r in rows[::2]]
    episodes = [r["episode_id"] for r in rows[1::3]]
    cases = [
        dict(trace_ids=half),
        dict(episode=episodes),
        dict(group=["group-0", "group-3"], trace_ids=half),
        dict(trace_ids=half, tags={"step": (None, 2)}),
        dict(trace_ids=[]),
    ]
    sizes = []
    for selection in cases:
        for complete_groups, after, through in [(4, None, None), (8, 1, 3)]:
            got = select_ids(
                lake, Selection(complete_groups=complete_groups, after=after, through=through, **selection)
            )
            want = _expected(db, bound, complete_groups=complete_groups, after=after, through=through, **selection)
            assert sorted(got) == sorted(want), (selection, complete_groups, after, through)
            sizes.append(len(got))
    assert max(sizes) > 0 and sizes[-1] == 0


def test_polling_each_write_gets_each_complete_group_once(stores):
    """A consumer passing each call's watermark on gets every group of 8 once, whole."""
    db, lake, bound = stores
    mark, seen = 0, []
    for through in range(1, max(bound) + 1):
        ids, mark_now = resolve_lake(lake, Selection(after=mark, complete_groups=8, through=through))
        assert mark_now == through
        seen += ids
        mark = mark_now
    groups = db.sql("SELECT group_id, count(*) AS n FROM traces GROUP BY 1 HAVING n >= 8").column(0).to_pylist()
    want = db.sql("SELECT trace_id FROM traces WHERE group_id IN (SELECT unnest(?::VARCHAR[]))", [groups])
    assert sorted(seen) == sorted(want.column(0).to_pylist()) and len(groups) == 3


def _same_plan(got, want, *, lake_marks: dict[str, int | None]):
    assert {**got.arguments, **dict.fromkeys(lake_marks)} == {**want.arguments, **dict.fromkeys(lake_marks)}
    assert {k: got.arguments[k] for k in lake_marks} == lake_marks
    assert {**got.report.to_dict(), "watermark": None} == {**want.report.to_dict(), "watermark": None}
    assert len(got) == len(want)
    for rank_got, rank_want in zip(got, want, strict=True):
        assert len(rank_got) == len(rank_want)
        for mb_got, mb_want in zip(rank_got, rank_want, strict=True):
            assert mb_got.tokens.equals(mb_want.tokens)
            assert mb_got.samples.equals(mb_want.samples)


@pytest.mark.parametrize(
    "selection",
    [
        dict(complete_groups=8, after=1),
        dict(tags={"step": (1.5, None)}, through=3),
        dict(complete_groups=4, tags={"flag": True}, after=0, through=9),
    ],
    ids=["complete-after", "tags-through", "both"],
)
def test_plans_equal_the_file_stores(stores, selection):
    db, lake, bound = stores
    marks = {"after": selection.get("after"), "through": selection.get("through")}
    got = lake.micro_batches(512, ranks=2, **selection)
    want = db.micro_batches(512, ranks=2, **{**selection, **{k: _file(bound, v) for k, v in marks.items()}})
    assert got.report.samples > 0
    _same_plan(got, want, lake_marks=marks)
    upto = lake.watermark() if marks["through"] is None else min(marks["through"], lake.watermark())
    assert got.report.watermark == upto and want.report.watermark == bound[upto]


BAD = [
    (dict(tags={"step": (1, "z")}), "step"),
    (dict(tags={"step": (1, 2, 3)}), "step"),
    (dict(tags={"step": (True, 2)}), "step"),
    (dict(complete_groups=0), "complete_groups"),
    (dict(complete_groups="8"), "complete_groups"),
    (dict(after=-1), "after"),
    (dict(after=1.5), "after"),
    (dict(through="x"), "through"),
]


@pytest.mark.parametrize(("bad", "word"), BAD, ids=[repr(b) for b, _ in BAD])
def test_bad_selections_get_the_file_stores_errors(stores, bad, word, tmp_path):
    db, lake, _ = stores
    with pytest.raises(ValueError) as want:
        db.branches(**bad)
    with pytest.raises(ValueError) as got:
        select_ids(lake, Selection(**bad))
    assert str(got.value) == str(want.value) and word in str(got.value)
    with pytest.raises(ValueError) as planned:
        lake.micro_batches(512, **bad)
    assert str(planned.value) == str(want.value)
    with pytest.raises(ValueError) as pulled:  # after= alone is read.visible's, not the selection's
        lake.pull(tmp_path / "pulled.duckdb", **bad)
    assert str(pulled.value) == str(want.value)


def test_pull_of_one_trace_id_given_as_a_string(stores, tmp_path):
    db, lake, _ = stores
    one = db.sql("SELECT min(trace_id) AS t FROM traces").column("t")[0].as_py()
    assert lake.pull(tmp_path / "a.duckdb", trace_ids=one) == 1 == len(select_ids(lake, Selection(trace_ids=one)))
    assert lake.tables(trace_ids=one)["traces"].column("trace_id").to_pylist() == [one]


def test_an_empty_lake_selects_nothing(tmp_path):
    lake = lakes.init(tmp_path / "L")
    assert resolve_lake(lake, Selection(complete_groups=2, tags={"step": 1}, after=0)) == ([], 0)
    plan = lake.micro_batches(64, complete_groups=2, tags={"step": 1})
    assert plan.report.samples == 0 and plan.report.watermark == 0


def test_lake_pack_takes_complete_groups_and_tags(stores, tmp_path):
    db, lake, _ = stores
    run = CliRunner().invoke
    args = ["--seq-len", "300", "--ranks", "2", "--complete-groups", "8", "--tag", "step=1.5..", "--json"]
    filed = run(app, ["pack", "--db", db.handle.path, "--out", str(tmp_path / "file"), *args])
    assert filed.exit_code == 0, filed.output
    laked = run(app, ["lake", "pack", "--lake", lake.where, "--out", str(tmp_path / "lake"), *args])
    assert laked.exit_code == 0, laked.output
    got = assert_same_step(tmp_path / "lake", tmp_path / "file", lake.watermark())
    assert got["arguments"]["tags"] == {"step": [1.5, None]}
    short = ["lake", "pack", "--lake", lake.where, "--out", str(tmp_path / "x"), "--seq-len", "64"]
    bad = run(app, [*short, "--tag", "nope"])
    assert bad.exit_code == 2 and "--tag: expected name=value" in bad.output
    bad = run(app, [*short, "--tag", "step=1..z"])
    assert bad.exit_code == 2 and "both numbers or both strings" in bad.output
    bad = run(app, [*short, "--complete-groups", "0"])
    assert bad.exit_code == 2 and "complete_groups is a group size" in bad.output


@pytest.mark.parametrize(
    "selection",
    [
        {"complete_groups": 8},
        {"tags": {"step": (2, None)}},
        {"complete_groups": 8, "tags": {"name": "gamma"}, "after": 1},
        {"through": 2},
    ],
)
def test_pull_takes_the_selections_of_branches(stores, tmp_path, selection):
    db, lake, bound = stores
    want = sorted(_expected(db, bound, **selection))
    assert lake.pull(tmp_path / "local.duckdb", **selection) == len(want) > 0
    with tracedb.connect(tmp_path / "local.duckdb", read_only=True) as local:
        got = local.sql("SELECT trace_id FROM traces ORDER BY trace_id").column("trace_id").to_pylist()
        assert got == want
        assert all(local.trace(t) == db.trace(t) for t in got[:3])


def test_lake_pull_cli_selects_and_refuses_bad_filters(stores, tmp_path):
    db, lake, bound = stores
    runner = CliRunner()
    local = tmp_path / "pulled.duckdb"
    args = ["lake", "pull", "--lake", lake.where, "--db", str(local), "--json"]
    done = runner.invoke(app, [*args, "--complete-groups", "8", "--tag", "step=2.."])
    assert done.exit_code == 0, done.output
    want = _expected(db, bound, complete_groups=8, tags={"step": (2, None)})
    assert json.loads(done.output)["traces"] == len(want) > 0
    bad = runner.invoke(app, [*args, "--tag", "step=1..z"])
    assert bad.exit_code == 2 and "both numbers or both strings" in bad.output
    worse = runner.invoke(app, [*args, "--complete-groups", "0"])
    assert worse.exit_code == 2 and "complete_groups is a group size" in worse.output
