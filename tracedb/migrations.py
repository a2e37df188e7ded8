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

SCHEMA_VERSION = 3
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
    con.execute("INSERT OR REPLACE INTO tracedb_meta SELECT 'last_seq', coalesce(max(seq), 0)::VARCHAR FROM traces")
    con.execute(
        "CREATE TABLE trace_tags (trace_id VARCHAR NOT NULL, name VARCHAR NOT NULL, value JSON NOT NULL, "
        "number DOUBLE, text VARCHAR)"
    )
    con.execute(
        'CREATE TABLE follow_positions (path VARCHAR PRIMARY KEY, device BIGINT, inode BIGINT, "offset" BIGINT '
        "NOT NULL, line BIGINT NOT NULL, head BLOB, updated_at TIMESTAMP DEFAULT current_timestamp)"
    )


MIGRATIONS: dict[int, Callable[[duckdb.DuckDBPyConnection], None]] = {1: _v1_to_v2, 2: _v2_to_v3}
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
