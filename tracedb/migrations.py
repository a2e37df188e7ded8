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
import numpy as np
import pyarrow as pa

from tracedb import codec, policy
from tracedb.sqltext import WATERMARK_KEY

SCHEMA_VERSION = 7
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


_V7_TABLES = """
CREATE TABLE episodes (
    episode_id VARCHAR PRIMARY KEY, group_id VARCHAR, env_id VARCHAR, ok BOOLEAN,
    record JSON NOT NULL USING COMPRESSION zstd, source VARCHAR, line BIGINT,
    ingested_at TIMESTAMP DEFAULT current_timestamp,
    work_type VARCHAR, work_step BIGINT, policy_start BIGINT, policy_end BIGINT);
CREATE TABLE traces (
    trace_id VARCHAR PRIMARY KEY, episode_id VARCHAR, position INTEGER, group_id VARCHAR, reward DOUBLE,
    ok BOOLEAN, is_completed BOOLEAN, is_timeout BOOLEAN, stop_condition VARCHAR, n_nodes INTEGER,
    n_branches INTEGER, n_tokens BIGINT, n_sampled BIGINT, record JSON NOT NULL USING COMPRESSION zstd,
    source VARCHAR, line BIGINT, ingested_at TIMESTAMP DEFAULT current_timestamp, seq BIGINT, dropped VARCHAR,
    policy_min BIGINT, policy_max BIGINT, policy_unknown BIGINT, work_type VARCHAR);
CREATE TABLE segment_store (
    segment_id BLOB NOT NULL, n_tokens INTEGER NOT NULL, token_ids INTEGER[], tokens VARCHAR USING COMPRESSION zstd);
CREATE TABLE node_store (
    trace_id VARCHAR NOT NULL, node_index INTEGER NOT NULL, parent INTEGER, role VARCHAR, sampled BOOLEAN,
    "timestamp" DOUBLE, segment_id BLOB NOT NULL, n_tokens INTEGER NOT NULL, n_sampled INTEGER NOT NULL,
    mask_prefix INTEGER, mask_slots INTEGER[], is_content BOOLEAN[],
    logprobs VARCHAR USING COMPRESSION zstd, advantages VARCHAR USING COMPRESSION zstd,
    reference_logprobs VARCHAR USING COMPRESSION zstd, trainer_logprobs VARCHAR USING COMPRESSION zstd,
    entropies VARCHAR USING COMPRESSION zstd, loss_weights VARCHAR USING COMPRESSION zstd,
    semantic_parents STRUCT("node" INTEGER, "type" VARCHAR)[], semantic_parents_record JSON,
    message JSON USING COMPRESSION zstd, extra JSON, present INTEGER NOT NULL,
    weight_versions STRUCT("version" VARCHAR, "start" INTEGER, "end" INTEGER)[],
    logprobs_list FLOAT[], advantages_list FLOAT[], reference_logprobs_list FLOAT[], trainer_logprobs_list FLOAT[],
    entropies_list FLOAT[]);
CREATE TABLE branches (
    trace_id VARCHAR NOT NULL, branch_index INTEGER NOT NULL, leaf INTEGER NOT NULL, trainable BOOLEAN NOT NULL,
    path INTEGER[] NOT NULL, n_tokens BIGINT NOT NULL, n_sampled BIGINT NOT NULL);
CREATE TABLE rejects (
    source VARCHAR, line BIGINT, trace_id VARCHAR, node INTEGER, field VARCHAR, reason VARCHAR NOT NULL,
    record VARCHAR USING COMPRESSION zstd, rejected_at TIMESTAMP DEFAULT current_timestamp,
    record_bytes BIGINT, record_sha256 VARCHAR);
"""
"""The tables schema 7 stores differently from schema 6, as schema 7 creates them."""

_V6_STREAMS = ("logprobs", "advantages", "reference_logprobs", "trainer_logprobs", "entropies")
MIGRATE_ROWS = 65_536
"""Rows a migration reads, encodes and writes at a time (its memory stays bounded)."""


def _batches(con: duckdb.DuckDBPyConnection, table: str) -> list[tuple[int, int]]:
    """Row-id ranges of ``table`` of at most :data:`MIGRATE_ROWS` rows, in row order. The
    bounds are rows' own ids: rows an earlier migration of the same transaction wrote have
    ids from 2**62 on (DuckDB's transaction-local ids), so ranges over 0..max would not end."""
    bounds = [
        r[0]
        for r in con.execute(
            f"SELECT rowid FROM (SELECT rowid, row_number() OVER (ORDER BY rowid) - 1 AS k FROM {table}) "
            f"WHERE k % {MIGRATE_ROWS} = 0 ORDER BY rowid"
        ).fetchall()
    ]
    if not bounds:
        return []
    top = con.execute(f"SELECT max(rowid) + 1 FROM {table}").fetchall()[0][0]
    return list(zip(bounds, [*bounds[1:], top], strict=True))


def _v6_to_v7(con: duckdb.DuckDBPyConnection) -> None:
    """Compact storage: token ids and per-token streams kept as text that DuckDB compresses
    with zstd (``segment_store``, ``node_store``; ``segments`` and ``nodes`` become views of
    them, installed with the macros: :mod:`tracedb.codec`), the JSON records and message
    text compressed with zstd, and no key index on nodes, branches and segments. The
    tables are rewritten in row order, a batch at a time; a file keeps its block size
    (files schema 7 creates have 64 KiB blocks)."""
    for name in ("episodes", "traces", "segments", "nodes", "branches", "rejects"):
        con.execute(f"ALTER TABLE {name} RENAME TO _v6_{name}")
    con.execute(_V7_TABLES)
    for name in ("episodes", "traces", "branches", "rejects"):
        con.execute(f"INSERT INTO {name} BY NAME SELECT * FROM _v6_{name} ORDER BY rowid")
    for lo, hi in _batches(con, "_v6_segments"):
        rows = con.sql(
            "SELECT segment_id, n_tokens, token_ids FROM _v6_segments WHERE rowid >= ? AND rowid < ? ORDER BY rowid",
            params=[lo, hi],
        ).to_arrow_table()
        lists = rows.column("token_ids").combine_chunks()
        offsets = lists.offsets.to_numpy().astype(np.int64)
        ids = lists.values.to_numpy(zero_copy_only=False)[offsets[0] : offsets[-1]]
        if codec.token_form(ids) == "text":
            rows = rows.append_column("tokens", codec.token_text(ids, offsets - offsets[0]))
            rows = rows.set_column(2, "token_ids", pa.nulls(len(rows), pa.list_(pa.int32())))
        else:
            rows = rows.append_column("tokens", pa.nulls(len(rows), pa.string()))
        con.from_arrow(rows).insert_into("segment_store")
    columns = [r[0] for r in con.execute("SELECT name FROM pragma_table_info('node_store') ORDER BY cid").fetchall()]
    for lo, hi in _batches(con, "_v6_nodes"):
        rows = con.sql(
            "SELECT * FROM _v6_nodes WHERE rowid >= ? AND rowid < ? ORDER BY rowid", params=[lo, hi]
        ).to_arrow_table()
        for name in _V6_STREAMS:
            text, lists = codec.stream_columns(rows.column(name))
            rows = rows.set_column(rows.schema.get_field_index(name), name, text).append_column(f"{name}_list", lists)
        weights = rows.column("loss_weights")
        index = rows.schema.get_field_index("loss_weights")
        rows = rows.set_column(index, "loss_weights", codec.loss_weights_text(weights.to_pylist()))
        con.from_arrow(rows.select(columns)).insert_into("node_store")
    for name in ("episodes", "traces", "segments", "nodes", "branches", "rejects"):
        con.execute(f"DROP TABLE _v6_{name}")


MIGRATIONS: dict[int, Callable[[duckdb.DuckDBPyConnection], None]] = {
    1: _v1_to_v2,
    2: _v2_to_v3,
    3: _v3_to_v4,
    4: _v4_to_v5,
    5: _v5_to_v6,
    6: _v6_to_v7,
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
