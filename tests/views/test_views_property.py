"""Branch views against a plain reference spread, on random verifiers records.

The reference below is the rule of design.md / verifiers ``Branch.spread`` written as
loops over the input dicts, nothing shared with tracedb. Every property ingests the
generated ``traces.jsonl`` through ``db.ingest`` and compares what comes back:
``db.branches()`` (numpy), ``branch_tokens()`` (SQL macros), ``db.trace()`` (round trip)
and verifiers' own ``Trace.branches``.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings

import tracedb
import tracedb.views
from tracedb.views import BRANCH_SCHEMA

from support.golden import canon, canon_record, rows_of
from support.strategies import (
    EPISODE_TEMPLATE,
    OPTIONAL,
    TRACE_TEMPLATE,
    all_traces,
    episodes,
    is_ragged,
    write_jsonl,
)

SETTINGS = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# --------------------------------------------------------------------------- reference


def reference_paths(trace: dict[str, Any]) -> list[tuple[int, bool, list[int]]]:
    """(index, trainable, root-to-leaf node path) per branch, in leaf order."""
    nodes = trace.get("nodes") or []
    has_child = {n.get("parent") for n in nodes if n.get("parent") is not None}
    accepted = {link["node"] for n in nodes for link in n.get("semantic_parents") or [] if link["type"] == "compaction"}
    out = []
    for leaf in range(len(nodes)):
        if leaf in has_child:
            continue
        path = []
        at = leaf
        while at is not None:
            path.append(at)
            at = nodes[at].get("parent")
        path.reverse()
        attempt = any(link["type"] == "compaction_attempt" for link in nodes[leaf].get("semantic_parents") or [])
        out.append((len(out), not attempt or leaf in accepted, path))
    return out


def widen(node: dict[str, Any], values: list[float] | None) -> list[float]:
    """A compact stream on the node's tokens: k-th value on the k-th True of the mask."""
    values = values or []
    out = []
    k = 0
    for sampled in node.get("mask") or []:
        if sampled:
            out.append(float(values[k]) if k < len(values) else 0.0)
            k += 1
        else:
            out.append(0.0)
    return out


def first_branches(trace: dict[str, Any]) -> dict[int, int]:
    """Node -> index of the first trainable branch holding it (first branch if none is)."""
    first: dict[int, int] = {}
    paths = reference_paths(trace)
    for prefer in (True, False):
        for index, trainable, path in paths:
            if trainable == prefer:
                for node in path:
                    first.setdefault(node, index)
    return first


def reference_branches(trace: dict[str, Any], *, train_once: bool = False) -> list[dict[str, Any]]:
    nodes = trace.get("nodes") or []
    first = first_branches(trace)
    rows = []
    for index, trainable, path in reference_paths(trace):
        on = [nodes[i] for i in path]
        row: dict[str, Any] = {"trace_id": trace["id"], "branch_index": index, "trainable": trainable}
        row["token_ids"] = [t for n in on for t in n.get("token_ids") or []]
        row["sampled_mask"] = [
            bool(m) and (not train_once or first[i] == index) for i, n in zip(path, on) for m in n.get("mask") or []
        ]
        row["logprobs"] = [v for n in on for v in widen(n, n.get("logprobs"))]
        for name in OPTIONAL:
            if all(n.get(name) is None for n in on):
                row[name] = None
            else:
                row[name] = [v for n in on for v in widen(n, n.get(name))]
        names = {name for n in on for name in n.get("loss_weights") or {}}
        row["loss_weights"] = {
            name: [
                float(v)
                for n in on
                for v in ((n.get("loss_weights") or {}).get(name) or [0.0] * len(n.get("token_ids") or []))
            ]
            for name in names
        }
        rows.append(row)
    return rows


def reference_view(eps: list[dict[str, Any]], **kw: Any) -> list[dict[str, Any]]:
    rows = [row for t in all_traces(eps) for row in reference_branches(t, **kw)]
    return sorted(rows, key=lambda r: (r["trace_id"], r["branch_index"]))


# --------------------------------------------------------------------------- harness


@pytest.fixture(scope="module")
def fresh():
    """Returns a function giving an empty database; one connection is reused and wiped,
    because installing the schema costs more than a whole example."""
    db = tracedb.connect(":memory:")
    tables = [
        r[0]
        for r in db.con.execute(
            "SELECT table_name FROM duckdb_tables() WHERE database_name = current_database() "
            "AND table_name <> 'tracedb_meta'"
        ).fetchall()
    ]

    def make() -> tracedb.Database:
        for table in tables:
            db.con.execute(f'DELETE FROM "{table}"')
        db.handle.changed()
        return db

    yield make
    db.close()


def ingest(db: tracedb.Database, eps: list[dict[str, Any]], *, allow_ragged: bool = False) -> Any:
    with tempfile.TemporaryDirectory() as tmp:
        return db.ingest(write_jsonl(Path(tmp) / "gen.traces.jsonl", eps), allow_ragged=allow_ragged)


def load(fresh: Any, eps: list[dict[str, Any]], *, allow_ragged: bool = False) -> tracedb.Database:
    db = fresh()
    report = ingest(db, eps, allow_ragged=allow_ragged)
    assert report.ok, [str(r) for r in report.rejected]
    assert report.traces == len(all_traces(eps))
    return db


def sql_view(db: tracedb.Database, train_once: bool = False) -> list[dict[str, Any]]:
    query = "SELECT * FROM branch_tokens(train_once := true)" if train_once else "SELECT * FROM branch_tokens()"
    return rows_of(db.sql(query))


def verifiers_view(trace: dict[str, Any]) -> list[dict[str, Any]]:
    from verifiers.v1.trace import WireTrace

    rows = []
    for b in WireTrace.model_validate(json.loads(json.dumps(trace))).branches:
        names = {name for n in b.nodes for name in n.loss_weights or {}}
        row = {"trace_id": trace["id"], "branch_index": b.index, "trainable": b.trainable}
        row["token_ids"] = b.token_ids
        row["sampled_mask"] = b.sampled_mask
        row["logprobs"] = b.logprobs
        for name in OPTIONAL:
            row[name] = getattr(b, name)
        row["loss_weights"] = {name: b.loss_weights(name) for name in names}
        rows.append(canon(row))
    return rows


# --------------------------------------------------------------------------- properties


def first_difference(got: list[dict[str, Any]], expected: list[dict[str, Any]]) -> Any:
    """None when equal; else the first differing row pair (or the two lengths)."""
    if got == expected:
        return None
    for g, e in zip(got, expected):
        if g != e:
            fields = [k for k in e if g.get(k) != e[k]]
            return {
                "fields": fields,
                "got": {k: g.get(k) for k in fields},
                "expected": {k: e[k] for k in fields},
                "branch": (e["trace_id"], e["branch_index"]),
            }
    return {"rows": len(got), "expected rows": len(expected)}


def view_problems(db: tracedb.Database, eps: list[dict[str, Any]]) -> dict[str, Any]:
    """Every view of the database against the reference (and verifiers); {} when all agree.

    All views are checked on each example so that a failure names every view that is
    off, not only the first.
    """
    expected = [canon(r) for r in reference_view(eps)]
    once = [canon(r) for r in reference_view(eps, train_once=True)]
    table = db.branches()
    python = rows_of(table)
    views = {
        # (a) the numpy view
        "db.branches()": (python, expected),
        "db.branches(trainable=True)": (rows_of(db.branches(trainable=True)), [r for r in expected if r["trainable"]]),
        "db.branches(trainable=False)": (
            rows_of(db.branches(trainable=False)),
            [r for r in expected if not r["trainable"]],
        ),
        # (b) the SQL macros
        "branch_tokens()": (sql_view(db), expected),
        # (d) verifiers' own Trace.branches, against what tracedb serves
        "verifiers Trace.branches vs db.branches()": (
            python,
            sorted(
                (r for t in all_traces(eps) for r in verifiers_view(t)),
                key=lambda r: (r["trace_id"], r["branch_index"]),
            ),
        ),
        # (e) train_once, Python and SQL
        "db.branches(train_once=True)": (rows_of(db.branches(train_once=True)), once),
        "branch_tokens(train_once := true)": (sql_view(db, train_once=True), once),
        "db.branches(train_once=True, trainable=True)": (
            rows_of(db.branches(train_once=True, trainable=True)),
            [r for r in once if r["trainable"]],
        ),
    }
    some = sorted({r["trace_id"] for r in expected})[-1:]
    views["db.branches(trace_ids=[...])"] = (
        rows_of(db.branches(trace_ids=some)),
        [r for r in expected if r["trace_id"] in some],
    )
    views["db.branches(branch_index=1)"] = (
        rows_of(db.branches(branch_index=1)),
        [r for r in expected if r["branch_index"] == 1],
    )
    views["db.branches(branch_index=[0, 2], train_once=True)"] = (
        rows_of(db.branches(branch_index=[0, 2], train_once=True)),
        [r for r in once if r["branch_index"] in (0, 2)],
    )
    every = sorted({r["trace_id"] for r in expected})
    views["db.branches(trace_ids=every id)"] = (rows_of(db.branches(trace_ids=every)), expected)
    problems = {name: d for name, (got, exp) in views.items() if (d := first_difference(got, exp)) is not None}
    if not table.schema.equals(BRANCH_SCHEMA):
        problems["schema"] = str(table.schema)
    return problems


def test_train_once_prefers_the_first_trainable_branch(fresh: Any) -> None:
    """An untrainable branch (index 0) shares the root with two trainable ones: the
    root's sampled token trains in branch 1, the attempt's own token in branch 0."""
    attempt = [{"node": 0, "type": "compaction_attempt"}]
    nodes = [
        _node(None, [1, 2], [False, True], logprobs=[-0.5]),
        _node(0, [3], [True], logprobs=[-0.25], semantic_parents=attempt),
        _node(0, [4], [True], logprobs=[-0.125]),
        _node(2, [5], [True], logprobs=[-1.0]),
        _node(2, [6], [True], logprobs=[-2.0]),
    ]
    eps = [_episode("ep-once", [_trace("t-once", nodes)])]
    rows = reference_branches(eps[0]["traces"][0], train_once=True)
    assert [(r["branch_index"], r["trainable"]) for r in rows] == [(0, False), (1, True), (2, True)]
    masks = [
        [False, False, True],  # untrainable: the root trains in branch 1; node 1 lives only here
        [False, True, True, True],
        [False, False, False, True],
    ]
    assert [r["sampled_mask"] for r in rows] == masks
    db = load(fresh, eps)
    assert [r["sampled_mask"] for r in rows_of(db.branches(train_once=True))] == masks
    assert [r["sampled_mask"] for r in sql_view(db, train_once=True)] == masks
    assert [r["sampled_mask"] for r in rows_of(db.branches(train_once=True, trainable=True))] == masks[1:]


@SETTINGS
@given(eps=episodes())
def test_views_match_reference(fresh: Any, eps: list[dict[str, Any]]) -> None:
    """(a) db.branches(), (b) branch_tokens(), (d) verifiers, (e) train_once."""
    db = load(fresh, eps)
    assert view_problems(db, eps) == {}


@SETTINGS
@given(eps=episodes())
def test_round_trip(fresh: Any, eps: list[dict[str, Any]]) -> None:
    """(c) db.trace() and db.episode() give back what went in (floats at float32)."""
    db = load(fresh, eps)
    for trace in all_traces(eps):
        assert canon_record(db.trace(trace["id"])) == canon_record(trace)
    for ep in eps:
        got = db.episode(ep["id"])
        assert {**got, "traces": [canon_record(t) for t in got["traces"]]} == {
            **ep,
            "traces": [canon_record(t) for t in ep["traces"]],
        }


@SETTINGS
@given(eps=episodes(ragged=True))
def test_ragged_streams(fresh: Any, eps: list[dict[str, Any]]) -> None:
    """Without allow_ragged a line holding a ragged stream is rejected (and only such
    lines); with it, every view spreads ragged streams as verifiers does."""
    db = fresh()
    report = ingest(db, eps, allow_ragged=False)
    bad_lines = {i + 1 for i, ep in enumerate(eps) if any(is_ragged(t) for t in ep["traces"])}
    assert {r.line for r in report.rejected} == bad_lines
    kept = [t["id"] for i, ep in enumerate(eps) if i + 1 not in bad_lines for t in ep["traces"]]
    assert sorted(db.sql("SELECT trace_id FROM traces").column("trace_id").to_pylist()) == sorted(kept)

    db = load(fresh, eps, allow_ragged=True)
    assert view_problems(db, eps) == {}


# --------------------------------------------------------------------------- explicit cases


def _trace(trace_id: str, nodes: list[dict[str, Any]]) -> dict[str, Any]:
    return {**json.loads(json.dumps(TRACE_TEMPLATE)), "id": trace_id, "nodes": nodes}


def _node(parent: int | None, tokens: list[int], mask: list[bool], **fields: Any) -> dict[str, Any]:
    node: dict[str, Any] = {"semantic_parents": [], "message": {"role": "user", "content": ""}, "sampled": False}
    if parent is not None:
        node["parent"] = parent
    return {**node, "token_ids": tokens, "mask": mask, "is_content": [], "logprobs": [], **fields}


def _episode(eid: str, trace_list: list[dict[str, Any]]) -> dict[str, Any]:
    return {**json.loads(json.dumps(EPISODE_TEMPLATE)), "id": eid, "traces": trace_list}


def test_none_versus_zero_and_partial_paths(fresh: Any) -> None:
    """None on every node -> None; [] or zeros on one node -> a spread; a path partly
    assigned spreads with zeros on the unassigned nodes."""
    nodes = [
        _node(None, [1, 2], [False, False]),
        _node(0, [3, 4], [False, True], logprobs=[-0.5], advantages=[0.25]),  # assigned
        _node(0, [5, 6], [True, False], logprobs=[-0.75], advantages=[]),  # assigned, empty
        _node(0, [7], [True], logprobs=[-1.0]),  # never assigned
        _node(0, [8, 9], [True, True], advantages=None, entropies=[0.0, 0.0]),
    ]
    eps = [_episode("ep-none", [_trace("t-none", nodes)])]
    db = load(fresh, eps)
    got = rows_of(db.branches())
    assert [r["advantages"] for r in got] == [[0, 0, 0, 0.25], [0, 0, 0, 0], None, None]
    assert [r["entropies"] for r in got] == [None, None, None, [0, 0, 0, 0]]
    assert got == [canon(r) for r in reference_view(eps)]
    assert sql_view(db) == got


def test_round_trip_keeps_unknown_semantic_link_fields(fresh: Any) -> None:
    """tracedb's ParentLink keeps unknown fields (extra="allow"), and a trace read back
    must equal the one that went in: a newer producer's link field must survive."""
    nodes = [
        _node(None, [1], [False]),
        _node(0, [2], [True], logprobs=[-0.5], semantic_parents=[{"node": 0, "type": "vendor:review", "weight": 2}]),
    ]
    trace = _trace("t-link", nodes)
    db = load(fresh, [_episode("ep-link", [trace])])
    assert db.trace("t-link")["nodes"][1]["semantic_parents"] == [{"node": 0, "type": "vendor:review", "weight": 2}]


# --------------------------------------------------------------------------- many runs


def _fork_episode(n_leaves: int, seed: int) -> list[dict[str, Any]]:
    """One trace: a root, an empty-token child of it, and many leaves hanging off either,
    random masks and streams, many of them with no tokens (empty runs)."""
    rng = np.random.default_rng(seed)
    nodes = [
        _node(None, [1, 2, 3], [False, False, True], logprobs=[-0.5]),
        _node(0, [], [], advantages=[]),
    ]
    for i in range(n_leaves):
        n = int(rng.integers(0, 4))
        tokens = rng.integers(0, 50, n).tolist()
        mask = (rng.random(n) < 0.5).tolist()
        k = sum(mask)
        fields: dict[str, Any] = {"logprobs": [round(float(x), 4) for x in rng.normal(size=k)]}
        if i % 3 == 0:
            fields["advantages"] = [round(float(x), 4) for x in rng.normal(size=k)]
        if i % 7 == 0:
            fields["loss_weights"] = {"rl": [round(float(x), 4) for x in rng.random(n)]}
        if i % 11 == 0:
            fields["semantic_parents"] = [{"node": 0, "type": "compaction_attempt"}]
        nodes.append(_node(int(rng.integers(0, 2)), tokens, mask, **fields))
    return [_episode("ep-fork", [_trace("t-fork", nodes)])]


def test_many_branches(fresh: Any) -> None:
    """Thousands of branches over many empty and one-token nodes give the reference spread,
    with train_once and the trainable filter too."""
    eps = _fork_episode(4200, seed=7)
    db = load(fresh, eps)
    expected = [canon(r) for r in reference_view(eps)]
    assert rows_of(db.branches()) == expected
    once = [canon(r) for r in reference_view(eps, train_once=True)]
    assert rows_of(db.branches(train_once=True)) == once
    trainable = [r for r in expected if r["trainable"]]
    assert 0 < len(trainable) < len(expected)
    assert rows_of(db.branches(trainable=True)) == trainable
    db.handle.view_cache = None
    assert rows_of(db.branches(trainable=True, train_once=True)) == [r for r in once if r["trainable"]]


def test_segments_written_between_reads_are_read_again(fresh: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole-database view reads segments on a second cursor; when that read misses a
    segment a node names (a write landed in between), the tokens are read again."""
    eps = _fork_episode(30, seed=11)
    db = load(fresh, eps)
    expected = db.branches()
    db.handle.view_cache = None
    real = tracedb.views.nodes.read_segments
    calls: list[int] = []

    def stale(con: Any, own_cursor: bool) -> Any:
        ids, tokens = real(con, own_cursor)
        calls.append(1)
        return (ids.slice(1), tokens) if len(calls) == 1 else (ids, tokens)  # first read lacks one

    monkeypatch.setattr(tracedb.views.nodes, "read_segments", stale)
    assert db.branches().equals(expected)
    assert len(calls) == 2


def test_views_inside_a_transaction_see_its_writes(fresh: Any) -> None:
    """Inside an open transaction the view reads on the transaction's own connection."""
    eps = _fork_episode(20, seed=3)
    db = load(fresh, eps)
    before = db.branches(columns=["advantages"])
    with db.handle.transaction():
        db.write_traces(pa.table({"trace_id": ["t-fork"], "value": [0.5]}))
        inside = db.branches(columns=["advantages"])
    assert not inside.equals(before)
    assert inside.equals(db.branches(columns=["advantages"]))


def test_branch_index_takes_ints_only(fresh: Any) -> None:
    db = load(fresh, _fork_episode(3, seed=1))
    with pytest.raises(TypeError, match="branch_index"):
        db.branches(branch_index="1")
    with pytest.raises(TypeError, match="branch_index"):
        db.branches(branch_index=[True])
    assert db.branches(branch_index=[]).num_rows == 0
