"""The stored schema's version, and the migrations that bring an older file up to it.

Policy: every change to the stored layout bumps :data:`SCHEMA_VERSION` and adds the
migration from the version before it to :data:`MIGRATIONS`. A read-write open of an older
file runs the migrations it needs, all in one transaction with the new version number
(a failure leaves the file as it was); a read-only open refuses it and says how to
upgrade it (``tracedb migrate --db FILE``); a file newer than this code is refused with
both versions named. ``tests/store/test_migrations.py`` runs each migration on a file
the previous version wrote (``tests/fixtures/schema/v<N>.duckdb``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import duckdb

from tracedb import policy
from tracedb.sqltext import WATERMARK_KEY

SCHEMA_VERSION = 6
"""The stored layout this tracedb reads and writes."""


def _v1_to_v2(con: duckdb.DuckDBPyConnection) -> None:
    """Rejects keep a bounded prefix of the raw line, with its full length and SHA-256."""
    con.execute("ALTER TABLE rejects ADD COLUMN record_bytes BIGINT")
    con.execute("ALTER TABLE rejects ADD COLUMN record_sha256 VARCHAR")
    con.execute(
        "UPDATE rejects SET record_bytes = strlen(record), record_sha256 = sha256(record) WHERE record IS NOT NULL"
    )


def _v2_to_v3(con: duckdb.DuckDBPyConnection) -> None:
    """Live runs: every trace gets an ingest sequence number (the traces already stored
    are numbered in the order they were ingested: time, then file and line), the
    watermark is kept in ``tracedb_meta``, and the tables of ingest tags and follower
    positions are created."""
    con.execute("ALTER TABLE traces ADD COLUMN seq BIGINT")
    con.execute(
        "UPDATE traces SET seq = o.seq FROM (SELECT trace_id, row_number() OVER "
        "(ORDER BY ingested_at, source, line, position, trace_id) AS seq FROM traces) o "
        "WHERE traces.trace_id = o.trace_id"
    )
    con.execute(
        "INSERT OR REPLACE INTO tracedb_meta SELECT ?, coalesce(max(seq), 0)::VARCHAR FROM traces", [WATERMARK_KEY]
    )
    con.execute(
        "CREATE TABLE trace_tags (trace_id VARCHAR NOT NULL, name VARCHAR NOT NULL, value JSON NOT NULL, "
        "number DOUBLE, text VARCHAR)"
    )
    con.execute(
        'CREATE TABLE follow_positions (path VARCHAR PRIMARY KEY, device BIGINT, inode BIGINT, "offset" BIGINT '
        "NOT NULL, line BIGINT NOT NULL, head BLOB, updated_at TIMESTAMP DEFAULT current_timestamp)"
    )


TRACE_ALGORITHMS = ("grpo", "rloo")
"""The algorithms whose credit was constant per trace when schema 4 came (their layout in
``tracedb.credit`` was ``"trace"``): the sets :func:`_v3_to_v4` may store per trace."""


def _v3_to_v4(con: duckdb.DuckDBPyConnection) -> None:
    """Credit constant per trace is stored once per trace: ``credit_sets.layout`` and the
    ``trace_credit`` table. A set a trace-level algorithm (:data:`TRACE_ALGORITHMS`)
    stamped moves there when its rows say it is one: in every trace it assigns, exactly
    the nodes with sampled tokens carry one value each (``value``, no list), the same
    value. Every other set stays per node as it was (a set written by hand, or a grpo set
    edited per node after its stamp): the readers see the same credit either way."""
    con.execute("ALTER TABLE credit_sets ADD COLUMN layout VARCHAR DEFAULT 'node'")
    con.execute("ALTER TABLE credit_sets ALTER COLUMN layout SET NOT NULL")
    con.execute(
        "CREATE TABLE trace_credit (credit_set VARCHAR NOT NULL, trace_id VARCHAR NOT NULL, value FLOAT NOT NULL)"
    )
    con.execute(
        "CREATE TEMP TABLE _tdb_per_trace AS "
        "WITH rows AS (SELECT c.credit_set, c.trace_id, c.value, c.advantages, n.n_sampled "
        "  FROM credit c JOIN credit_sets s ON s.name = c.credit_set "
        "  LEFT JOIN nodes n USING (trace_id, node_index) WHERE s.algorithm IN (SELECT unnest(?::VARCHAR[]))), "
        "per_trace AS (SELECT credit_set, trace_id, count(*) AS n_rows, coalesce(min(value) = max(value) "
        "  AND bool_and(value IS NOT NULL AND advantages IS NULL AND coalesce(n_sampled, 0) > 0), false) AS one "
        "  FROM rows GROUP BY ALL), "
        "sampled AS (SELECT trace_id, count(*) AS n FROM nodes WHERE n_sampled > 0 GROUP BY ALL) "
        "SELECT name AS credit_set FROM credit_sets WHERE algorithm IN (SELECT unnest(?::VARCHAR[])) "
        "AND name NOT IN (SELECT credit_set FROM per_trace p LEFT JOIN sampled s USING (trace_id) "
        "                 WHERE NOT p.one OR p.n_rows <> coalesce(s.n, 0))",
        [list(TRACE_ALGORITHMS), list(TRACE_ALGORITHMS)],
    )
    con.execute(
        "INSERT INTO trace_credit SELECT credit_set, trace_id, min(value) FROM credit "
        "WHERE credit_set IN (SELECT credit_set FROM _tdb_per_trace) GROUP BY ALL ORDER BY ALL"
    )
    con.execute("DELETE FROM credit WHERE credit_set IN (SELECT credit_set FROM _tdb_per_trace)")
    con.execute("UPDATE credit_sets SET layout = 'trace' WHERE name IN (SELECT credit_set FROM _tdb_per_trace)")
    con.execute("DROP TABLE _tdb_per_trace")


def _v4_to_v5(con: duckdb.DuckDBPyConnection) -> None:
    """A follower's position also holds the hash of the bytes just before its offset
    (``tail``: a file truncated and grown again past the offset changes them) and, for a
    rotated file still read by its identity, the followed path it was renamed away from
    (``rotated_from``). A position schema 4 wrote gets no ``tail`` (the migration does not
    read the followed files, which may be on another machine): the first poll of a
    follower that finds the file as the position says (same device, inode and first
    bytes) takes the bytes before the offset as they are then, and commits their hash."""
    con.execute("ALTER TABLE follow_positions ADD COLUMN tail BLOB")
    con.execute("ALTER TABLE follow_positions ADD COLUMN rotated_from VARCHAR")


def _v5_to_v6(con: duckdb.DuckDBPyConnection) -> None:
    """Asynchronous RL (verifiers 0.4.1): ``nodes.weight_versions`` (the spans an older
    tracedb kept among a node's unknown fields, copied out of them; the unknown fields keep
    them too, so records read back as before), ``traces.dropped`` from the records,
    ``episodes`` work type, step and policy span from ``episode.run``, the
    ``policy_labels`` table, and every trace's policy-version bounds."""
    con.execute(
        'ALTER TABLE nodes ADD COLUMN weight_versions STRUCT("version" VARCHAR, "start" INTEGER, "end" INTEGER)[]'
    )
    con.execute(
        "UPDATE nodes SET weight_versions = TRY_CAST(json_extract(extra, '$.weight_versions') "
        'AS STRUCT("version" VARCHAR, "start" INTEGER, "end" INTEGER)[]) '
        "WHERE extra IS NOT NULL AND json_exists(extra, '$.weight_versions')"
    )
    con.execute("ALTER TABLE traces ADD COLUMN dropped VARCHAR")
    for column in ("policy_min", "policy_max", "policy_unknown"):
        con.execute(f"ALTER TABLE traces ADD COLUMN {column} BIGINT")
    con.execute("UPDATE traces SET dropped = record->>'$.dropped' WHERE json_type(record, '$.dropped') = 'VARCHAR'")
    con.execute("ALTER TABLE episodes ADD COLUMN work_type VARCHAR")
    for column in ("work_step", "policy_start", "policy_end"):
        con.execute(f"ALTER TABLE episodes ADD COLUMN {column} BIGINT")
    con.execute(
        "UPDATE episodes SET "
        "work_type = coalesce(record->>'$.run.work.type', CASE WHEN record->>'$.run.type' = 'eval' THEN 'eval' END), "
        "work_step = TRY_CAST(record->>'$.run.work.step' AS BIGINT), "
        "policy_start = TRY_CAST(record->>'$.run.work.policy.start' AS BIGINT), "
        "policy_end = TRY_CAST(record->>'$.run.work.policy.end' AS BIGINT) "
        "WHERE json_exists(record, '$.run')"
    )
    con.execute(
        "CREATE TABLE policy_labels (label VARCHAR PRIMARY KEY, version BIGINT NOT NULL, "
        "set_at TIMESTAMP DEFAULT current_timestamp)"
    )
    con.execute("ALTER TABLE traces ADD COLUMN work_type VARCHAR")
    con.execute(
        "UPDATE traces SET work_type = e.work_type FROM episodes e "
        "WHERE traces.episode_id = e.episode_id AND e.work_type IS NOT NULL"
    )
    policy.recompute_bounds(con)


MIGRATIONS: dict[int, Callable[[duckdb.DuckDBPyConnection], None]] = {
    1: _v1_to_v2,
    2: _v2_to_v3,
    3: _v3_to_v4,
    4: _v4_to_v5,
    5: _v5_to_v6,
}
"""``MIGRATIONS[n]`` upgrades a file of version ``n`` to ``n + 1``."""


def can_upgrade(found: int) -> bool:
    """Whether the migrations reach :data:`SCHEMA_VERSION` from version ``found``."""
    return found <= SCHEMA_VERSION and all(v in MIGRATIONS for v in range(found, SCHEMA_VERSION))


def upgrade(con: duckdb.DuckDBPyConnection, found: int) -> list[int]:
    """Run the migrations from version ``found`` to :data:`SCHEMA_VERSION` on ``con``
    (inside the caller's transaction); returns the versions passed through."""
    steps = []
    for version in range(found, SCHEMA_VERSION):
        MIGRATIONS[version](con)
        steps.append(version + 1)
    con.execute("UPDATE tracedb_meta SET value = ? WHERE key = 'schema_version'", [str(SCHEMA_VERSION)])
    return steps


def stored_version(path: str | Path) -> int | None:
    """The schema version a closed database file holds (None without one), read with a
    connection of its own, read-only."""
    con = duckdb.connect(str(path), read_only=True)
    try:
        rows = con.execute("SELECT value FROM tracedb_meta WHERE key = 'schema_version'").fetchall()
    except duckdb.CatalogException:
        return None
    finally:
        con.close()
    return int(rows[0][0]) if rows else None
