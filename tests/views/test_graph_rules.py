"""The owning-branch rule (one node, one value) has one definition in Python,
tracedb.graph.owning_branch, and SQL states it again in the branch_nodes() macro: the two
agree on every fixture and on random forests."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings

import tracedb
from tracedb.graph import owning_branch

from support.strategies import episodes, write_jsonl


def _python_owners(db: tracedb.Database) -> dict[tuple[str, int], int]:
    branches = db.sql("SELECT trace_id, branch_index, trainable, path FROM branches ORDER BY trace_id, branch_index")
    rows: dict[tuple[str, int], int] = {}
    entry_node, entry_branch = [], []
    for b, (trace_id, path) in enumerate(
        zip(branches.column("trace_id").to_pylist(), branches.column("path").to_pylist(), strict=True)
    ):
        for node in path:
            entry_node.append(rows.setdefault((trace_id, node), len(rows)))
            entry_branch.append(b)
    trainable = np.array(branches.column("trainable").to_pylist(), bool)
    owner = owning_branch(np.array(entry_node, np.int64), np.array(entry_branch, np.int64), trainable, len(rows))
    index = branches.column("branch_index").to_pylist()
    return {key: index[owner[row]] for key, row in rows.items()}


def _sql_owners(db: tracedb.Database) -> dict[tuple[str, int], int]:
    rows = db.sql("SELECT DISTINCT trace_id, node_index, first_branch FROM branch_nodes()").to_pylist()
    return {(r["trace_id"], r["node_index"]): r["first_branch"] for r in rows}


def test_the_rule_and_the_macro_agree_on_the_fixtures(fixture_db) -> None:
    owners = _python_owners(fixture_db)
    assert owners == _sql_owners(fixture_db)
    untrainable = fixture_db.sql("SELECT count(*) AS n FROM branches WHERE NOT trainable").column("n")[0].as_py()
    assert untrainable > 0, "the fixtures hold compaction attempts, where the rule prefers a trainable branch"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(eps=episodes())
def test_the_rule_and_the_macro_agree_on_random_forests(eps) -> None:
    with tempfile.TemporaryDirectory() as tmp, tracedb.connect(":memory:") as db:
        assert db.ingest(write_jsonl(Path(tmp) / "gen.traces.jsonl", eps)).ok
        assert _python_owners(db) == _sql_owners(db)


def test_a_node_on_no_branch_has_no_owner() -> None:
    owner = owning_branch(np.array([0, 1]), np.array([0, 0]), np.array([True]), 3)
    assert owner.tolist() == [0, 0, -1]


def test_a_shared_node_belongs_to_its_first_trainable_branch() -> None:
    # node 0 on branches 0 (untrainable), 1 and 2 (trainable); node 1 only on branch 0
    owner = owning_branch(np.array([0, 1, 0, 0]), np.array([0, 0, 1, 2]), np.array([False, True, True]), 2)
    assert owner.tolist() == [1, 0]
