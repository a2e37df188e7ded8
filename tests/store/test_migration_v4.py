"""Schema 3 -> 4 (``tracedb/migrations.py`` ``_v3_to_v4``) on the file schema 3 really wrote
(``tests/fixtures/schema/v3.duckdb``, see its README): the grpo and rloo sets move to one
row per trace, every other set stays per node, every set reads exactly the credit schema 3
stored, and the file's layout is exactly a fresh database's."""

from __future__ import annotations

import shutil
from pathlib import Path

import duckdb
import pytest

import tracedb
import tracedb.credit

from support import REPO

SCHEMA_DIR = REPO / "tests" / "fixtures" / "schema"
SETS = {"grpo": "trace", "rloo": "trace", "gae": "node", "grpo-edited": "node", "manual": "node"}
"""The v3 fixture's sets and the layout each has after the migration."""


def copy_of(tmp_path: Path, version: int) -> Path:
    path = tmp_path / f"v{version}.duckdb"
    shutil.copy(SCHEMA_DIR / f"v{version}.duckdb", path)
    return path


def query(path: Path, sql: str) -> list[tuple]:
    con = duckdb.connect(str(path), read_only=True)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


def stored_credit(path: Path) -> dict[str, dict[tuple[str, int], list[float]]]:
    """Per set, every assigned node's compact credit, read from a schema-3 file by schema 3's
    rule (a row per node: its list, or its value over the node's sampled tokens)."""
    rows = query(
        path,
        "SELECT c.credit_set, n.trace_id, n.node_index, "
        "  coalesce(c.advantages, list_resize([]::FLOAT[], n.n_sampled, c.value)) "
        "FROM credit c JOIN nodes n USING (trace_id, node_index)",
    )
    out: dict[str, dict[tuple[str, int], list[float]]] = {}
    for name, trace_id, node, values in rows:
        out.setdefault(name, {})[(trace_id, node)] = values
    return out


def read_credit(db: tracedb.Database, name: str) -> dict[tuple[str, int], list[float]]:
    rows = db.sql(
        "SELECT trace_id, node_index, advantages FROM credit_advantages(?) WHERE advantages IS NOT NULL", [name]
    )
    return {(r["trace_id"], r["node_index"]): r["advantages"] for r in rows.to_pylist()}


def layout(path: Path) -> tuple[list[tuple], list[tuple]]:
    """Every column (type, nullability, default) and constraint of the file, in order."""
    here = "database_name = current_database() AND schema_name = 'main'"
    columns = query(
        path,
        "SELECT table_name, column_index, column_name, data_type, is_nullable, column_default "
        f"FROM duckdb_columns() WHERE {here} ORDER BY ALL",
    )
    constraints = query(
        path, f"SELECT table_name, constraint_type, constraint_text FROM duckdb_constraints() WHERE {here} ORDER BY ALL"
    )
    return columns, constraints


def test_the_fixture_is_a_version_3_file_with_every_set_per_node():
    path = SCHEMA_DIR / "v3.duckdb"
    assert query(path, "SELECT value FROM tracedb_meta WHERE key = 'schema_version'") == [("3",)]
    assert sorted(r[0] for r in query(path, "SELECT name FROM credit_sets")) == sorted(SETS)
    assert not query(path, "SELECT * FROM duckdb_tables() WHERE table_name = 'trace_credit'")
    assert set(stored_credit(path)) == set(SETS)


def test_trace_level_sets_move_to_one_row_per_trace_and_read_the_same(tmp_path):
    path = copy_of(tmp_path, 3)
    before = stored_credit(path)
    counts = dict(query(path, "SELECT credit_set, count(*) FROM credit GROUP BY ALL"))
    with tracedb.connect(path) as db:
        listing = {r["name"]: r for r in db.credit_sets().to_pylist()}
        assert {name: listing[name]["layout"] for name in SETS} == SETS
        for name, kind in SETS.items():
            assert read_credit(db, name) == before[name], name
            assert listing[name]["assigned_nodes"] == counts[name], name
            per_trace = db.sql("SELECT count(*) AS n FROM trace_credit WHERE credit_set = ?", [name]).to_pylist()
            per_node = db.sql("SELECT count(*) AS n FROM credit WHERE credit_set = ?", [name]).to_pylist()
            traces = len({t for t, _ in before[name]})
            assert (per_trace[0]["n"], per_node[0]["n"]) == ((traces, 0) if kind == "trace" else (0, counts[name]))
        # The moved sets are what a fresh stamp stores now.
        tracedb.credit.run(db, "grpo", "grpo-now")
        tracedb.credit.run(db, "rloo", "rloo-now")
        for name in ("grpo", "rloo"):
            assert db.branches(credit=name).equals(db.branches(credit=f"{name}-now"))
            same = "SELECT trace_id, value FROM trace_credit WHERE credit_set = ? ORDER BY trace_id"
            assert db.sql(same, [name]).equals(db.sql(same, [f"{name}-now"]))
        # A set left per node takes per-node writes as before.
        (key, values), *_ = sorted(before["grpo-edited"].items())
        db.write_nodes([{"trace_id": key[0], "node_index": key[1], "value": 1.5}], credit="grpo-edited")
        assert read_credit(db, "grpo-edited")[key] == [1.5] * len(values)
    assert query(path, "SELECT value FROM tracedb_meta WHERE key = 'schema_version'") == [
        (str(tracedb.SCHEMA_VERSION),)
    ]


@pytest.mark.parametrize("version", [1, 2, 3])
def test_the_migrated_layout_is_a_fresh_databases(tmp_path, version):
    path = copy_of(tmp_path, version)
    fresh = tmp_path / "fresh.duckdb"
    with tracedb.connect(path), tracedb.connect(fresh):
        pass
    assert layout(path) == layout(fresh)


@pytest.mark.parametrize(("version", "nodes"), [(1, 0), (2, 124)])
def test_older_grpo_sets_move_too(tmp_path, version, nodes):
    path = copy_of(tmp_path, version)
    with tracedb.connect(path) as db:
        (row,) = [r for r in db.credit_sets().to_pylist() if r["name"] == "grpo"]
        assert (row["layout"], row["assigned_nodes"]) == ("trace", nodes)
        tracedb.credit.run(db, "grpo", "again")
        assert db.branches(credit="grpo").equals(db.branches(credit="again"))


def test_a_set_whose_rows_are_not_one_value_per_trace_stays_per_node(tmp_path):
    """A grpo set with a node row missing, or an extra row on a node without sampled
    tokens, is not constant over exactly the trace's sampled nodes: it keeps its rows."""
    path = copy_of(tmp_path, 3)
    con = duckdb.connect(str(path))
    try:
        con.execute(
            "INSERT INTO credit_sets (name, algorithm, params) VALUES ('short', 'grpo', '{}'), ('wide', 'rloo', '{}')"
        )
        con.execute(
            "INSERT INTO credit SELECT 'short', trace_id, node_index, value, advantages FROM credit "
            "WHERE credit_set = 'grpo'"
        )
        con.execute(
            "DELETE FROM credit WHERE credit_set = 'short' AND (trace_id, node_index) IN "
            "(SELECT (trace_id, min(node_index)) FROM credit WHERE credit_set = 'short' GROUP BY trace_id LIMIT 1)"
        )
        con.execute(
            "INSERT INTO credit SELECT 'wide', trace_id, node_index, value, advantages FROM credit "
            "WHERE credit_set = 'rloo'"
        )
        con.execute(
            "INSERT INTO credit SELECT 'wide', n.trace_id, n.node_index, 0.5, NULL FROM nodes n "
            "WHERE n.n_sampled = 0 AND n.trace_id IN (SELECT trace_id FROM credit WHERE credit_set = 'wide') LIMIT 1"
        )
    finally:
        con.close()
    before = stored_credit(path)
    assert len(before["short"]) == len(before["grpo"]) - 1 and len(before["wide"]) == len(before["rloo"]) + 1
    with tracedb.connect(path) as db:
        layouts = {r["name"]: r["layout"] for r in db.credit_sets().to_pylist()}
        assert (layouts["short"], layouts["wide"]) == ("node", "node")
        for name in ("short", "wide"):
            assert read_credit(db, name) == before[name]
