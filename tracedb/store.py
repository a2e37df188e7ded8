"""The database: one DuckDB file (or ``:memory:``) holding episodes, traces, nodes,
deduplicated token segments and precomputed branches, with tracedb's SQL macros
installed in it so that any DuckDB client can query it."""

from __future__ import annotations

import json
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa

from tracedb._instance import attach
from tracedb.errors import NotFound, SchemaVersionError
from tracedb.models import COMPACT_STREAMS
from tracedb.records import BIT

SCHEMA_VERSION = 1
"""Version of the stored layout; a file of another version is refused, not guessed at."""


def schema_dir() -> Path:
    """Where the ``.sql`` files are: inside the installed package, or the source tree."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "_schema", here.parent / "schema"):
        if (candidate / "tables.sql").exists():
            return candidate
    raise FileNotFoundError("tracedb schema/*.sql not found")


def load_sql(name: str) -> str:
    return (schema_dir() / name).read_text()


def quote_identifier(name: str) -> str:
    """Quote a SQL identifier; values never go through here, they are bound parameters."""
    return '"' + name.replace('"', '""') + '"'


def _shortest(values: np.ndarray) -> list[float]:
    """float32 values as the shortest decimals that read back to the same float32."""
    if not len(values):
        return []
    text = pa.array(values, pa.float32()).cast(pa.string())
    return [float(v) for v in text.to_pylist()]


class Database:
    """A tracedb database. Create with :func:`tracedb.connect`."""

    def __init__(self, path: str | Path = ":memory:", *, read_only: bool = False, isolated: bool = False) -> None:
        self.path = str(path)
        self._catalog: str | None = None
        self._instance_key: object = "shared"  # which DuckDB instance (its settings) this is on
        fresh = True
        if not isolated:
            try:
                self.con, self._catalog, fresh, release = attach(self.path, read_only=read_only)
                self._release: Callable[[], None] = weakref.finalize(self, _close_then, self.con, release)
            except duckdb.ResourceInUseException:
                isolated = True  # a plain duckdb.connect of this process holds it: join that instance
        if isolated:
            self.con = duckdb.connect(self.path, read_only=read_only)
            self._release = self.con.close
            self._instance_key = self.con
        self._generation = 0
        self._cache: Any = None
        self._in_transaction = False
        try:
            if not read_only and fresh:  # an attachment shared with another handle is installed
                self._install()
            self._check_version()
        except BaseException:
            self.close()  # a refused file is not kept open
            raise

    # ----------------------------------------------------------------- lifecycle

    def _install(self) -> None:
        # An existing file of another version is refused before anything is written to it.
        if self._columns("tracedb_meta"):
            self._check_version()
        self.con.execute(load_sql("tables.sql"))
        row = self._row("SELECT value FROM tracedb_meta WHERE key = 'schema_version'")
        if row is None:
            self.con.execute("INSERT INTO tracedb_meta VALUES ('schema_version', ?)", [str(SCHEMA_VERSION)])
        self.con.execute(load_sql("macros.sql"))

    def _check_version(self) -> None:
        row = self._row("SELECT value FROM tracedb_meta WHERE key = 'schema_version'")
        if row is None or int(row[0]) != SCHEMA_VERSION:
            found = None if row is None else row[0]
            raise SchemaVersionError(f"{self.path}: schema version {found}, this tracedb reads {SCHEMA_VERSION}")

    def close(self) -> None:
        """Close the database (idempotent); a database opened for writing is checkpointed.

        Raises (and can be retried) while another thread is still running a query on the
        connection."""
        self.con.close()
        self._release()

    def cursor(self) -> duckdb.DuckDBPyConnection:
        """A new connection to this database, for another thread (a DuckDB connection is
        not meant to be shared between threads that run queries at the same time)."""
        con = self.con.cursor()
        if self._catalog is not None:
            con.execute(f"USE {quote_identifier(self._catalog)}")
        return con

    def __enter__(self) -> Database:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        """All or nothing: commit on success, roll back on any error. Nests as one."""
        if self._in_transaction:
            try:
                yield
            finally:
                self._changed()  # views read inside the transaction must see its writes
            return
        self.con.execute("BEGIN TRANSACTION")
        self._in_transaction = True
        try:
            yield
        except BaseException:
            self.con.execute("ROLLBACK")
            raise
        else:
            self.con.execute("COMMIT")
        finally:
            self._in_transaction = False
            self._changed()

    def _changed(self) -> None:
        """Something was written: cached views are stale."""
        self._generation += 1
        self._cache = None

    @property
    def schema_version(self) -> int:
        return SCHEMA_VERSION

    # ----------------------------------------------------------------- queries

    def sql(self, query: str, params: Sequence[Any] | dict[str, Any] | None = None) -> pa.Table:
        """Run SQL (tracedb's macros are available) and return the result as Arrow."""
        result = self.con.sql(query, params=params)
        if result is None:  # a statement without a result set
            return pa.table({})
        return result.to_arrow_table()

    def _row(self, query: str, params: Sequence[Any] | None = None) -> tuple[Any, ...] | None:
        """The first row of a query, or None; the result is always consumed whole."""
        rows = self.con.execute(query, params or []).fetchall()
        return rows[0] if rows else None

    def _scalar(self, query: str, params: Sequence[Any] | None = None) -> Any:
        row = self._row(query, params)
        return None if row is None else row[0]

    def _columns(self, table: str) -> list[str]:
        """Column names of one of this database's tables ([] when there is no such table).
        Other databases of the process share the DuckDB instance, hence the catalog filter."""
        rows = self.con.execute(
            "SELECT column_name FROM duckdb_columns() WHERE table_name = ? AND database_name = current_database() "
            "AND schema_name = current_schema() ORDER BY column_index",
            [table],
        ).fetchall()
        return [r[0] for r in rows]

    def _existing(self, table: str, column: str, ids: Iterable[str]) -> set[str]:
        return existing_ids(self.con, table, column, ids)

    # ----------------------------------------------------------------- ingest

    def ingest(
        self,
        paths: str | Path | Iterable[str | Path],
        *,
        strict: bool = False,
        allow_ragged: bool = False,
        progress: bool = False,
    ) -> Any:
        """Ingest ``traces.jsonl`` / ``.jsonl.zst`` / ``.json`` files or directories.

        Idempotent by trace id. Bad records are rejected with their location and kept in
        the ``rejects`` table while good ones are ingested; ``strict=True`` aborts on the
        first rejection and leaves the database unchanged (:class:`IngestAborted`).
        ``allow_ragged`` accepts compact streams whose length differs from the sampled
        count (they spread as verifiers spreads them). Returns an ``IngestReport``.
        """
        from tracedb.ingest import ingest

        return ingest(self, paths, strict=strict, allow_ragged=allow_ragged, progress=progress)

    # ----------------------------------------------------------------- records

    def trace(self, trace_id: str, *, credit: str | None = None) -> dict[str, Any]:
        """The trace record exactly as ingested (per-token floats at float32 precision).

        Later writes show: streams written back are in the record. ``credit="name"``
        puts that credit set's advantages on the nodes instead of the default set's
        (a node the set does not assign has no ``advantages``, i.e. None).
        """
        row = self._row("SELECT record FROM traces WHERE trace_id = ?", [trace_id])
        if row is None:
            raise NotFound(f"trace {trace_id!r} is not in {self.path}")
        record = json.loads(row[0])
        credit = self._credit_name(credit)
        nodes = self.sql(
            "SELECT n.* EXCLUDE (advantages), a.advantages, s.token_ids FROM nodes n "
            "JOIN segments s USING (segment_id) "
            "JOIN credit_advantages(?) a USING (trace_id, node_index) "
            "WHERE trace_id = ? ORDER BY node_index",
            [credit, trace_id],
        )
        if "nodes" in record:
            record["nodes"] = [_node_record(row, named_credit=credit is not None) for row in _rows(nodes)]
        return record

    def _credit_name(self, credit: str | None) -> str | None:
        from tracedb.writeback import _credit

        return _credit(self, credit)

    def episode(self, episode_id: str) -> dict[str, Any]:
        """The episode record exactly as ingested, with its traces."""
        row = self._row("SELECT record FROM episodes WHERE episode_id = ?", [episode_id])
        if row is None:
            raise NotFound(f"episode {episode_id!r} is not in {self.path}")
        record = json.loads(row[0])
        ids = self.con.execute(
            "SELECT trace_id FROM traces WHERE episode_id = ? ORDER BY position", [episode_id]
        ).fetchall()
        record["traces"] = [self.trace(r[0]) for r in ids]
        return record

    # ----------------------------------------------------------------- write-back

    def write_nodes(
        self, data: Any, *, stream: str = "advantages", credit: str | None = None, name: str | None = None
    ) -> int:
        """Write per-node compact values ``(trace_id, node_index, values)``; see :mod:`tracedb.writeback`."""
        from tracedb.writeback import write_nodes

        return write_nodes(self, data, stream=stream, credit=credit, name=name)

    def write_traces(self, data: Any, *, stream: str = "advantages", credit: str | None = None) -> int:
        """Write per trace: ``value`` broadcast over its sampled tokens, or ``values`` over all of them."""
        from tracedb.writeback import write_traces

        return write_traces(self, data, stream=stream, credit=credit)

    def write_branches(
        self, data: Any, *, stream: str = "advantages", credit: str | None = None, name: str | None = None
    ) -> int:
        """Write full-layout branch values ``(trace_id, branch_index, values)``, projected onto nodes."""
        from tracedb.writeback import write_branches

        return write_branches(self, data, stream=stream, credit=credit, name=name)

    def clear(
        self,
        *,
        stream: str = "advantages",
        credit: str | None = None,
        trace_ids: Sequence[str] | None = None,
        name: str | None = None,
    ) -> int:
        """Return ``stream`` to unassigned (None) on every node of ``trace_ids`` (default: all)."""
        from tracedb.writeback import clear

        return clear(self, stream=stream, credit=credit, trace_ids=trace_ids, name=name)

    def create_credit_set(
        self,
        name: str,
        *,
        algorithm: str = "manual",
        params: dict[str, Any] | None = None,
        description: str | None = None,
        replace: bool = False,
    ) -> None:
        """Register a named credit set; its advantages are then written with ``credit=name``."""
        from tracedb.writeback import create_credit_set

        create_credit_set(self, name, algorithm=algorithm, params=params, description=description, replace=replace)

    def drop_credit_set(self, name: str) -> None:
        """Remove a named credit set and all its credit."""
        from tracedb.writeback import drop_credit_set

        drop_credit_set(self, name)

    def has_credit_set(self, name: str) -> bool:
        """True for ``"default"`` (the ingested credit) and for every named set created."""
        return name == "default" or bool(self._scalar("SELECT count(*) FROM credit_sets WHERE name = ?", [name]))

    def credit_sets(self) -> pa.Table:
        """The credit sets: name, algorithm, params, description, created_at, assigned nodes."""
        return self.sql(
            "SELECT 'default' AS name, 'ingested' AS algorithm, NULL::JSON AS params, "
            "'credit ingested with the records' AS description, NULL::TIMESTAMP AS created_at, "
            "(SELECT count(*) FROM nodes WHERE advantages IS NOT NULL) AS assigned_nodes "
            "UNION ALL SELECT s.name, s.algorithm, s.params, s.description, s.created_at, "
            "(SELECT count(*) FROM credit c WHERE c.credit_set = s.name) FROM credit_sets s "
            "ORDER BY created_at NULLS FIRST, name"
        )

    # ----------------------------------------------------------------- views

    def branches(self, **kwargs: Any) -> pa.Table:
        """One row per branch, aligned per-token arrays; see :func:`tracedb.views.branches`."""
        from tracedb.views import branches

        return branches(self, **kwargs)

    def export(self, path: str | Path, **kwargs: Any) -> dict[str, Any]:
        """Stream branch views to Parquet or Arrow IPC; see :func:`tracedb.export.export`."""
        from tracedb.export import export

        return export(self, path, **kwargs)

    def stats(self) -> dict[str, Any]:
        """Counts and sizes: episodes, traces, nodes, branches, tokens, bytes, dedup ratio."""
        one = self._scalar
        node_tokens = one("SELECT coalesce(sum(n_tokens), 0) FROM nodes")
        stored_tokens = one("SELECT coalesce(sum(n_tokens), 0) FROM segments")
        branch_tokens = one("SELECT coalesce(sum(n_tokens), 0) FROM branches")
        size = None
        if self.path != ":memory:":
            size = sum(p.stat().st_size for p in (Path(self.path), Path(self.path + ".wal")) if p.exists())
        return {
            "path": self.path,
            "schema_version": SCHEMA_VERSION,
            "episodes": one("SELECT count(*) FROM episodes"),
            "traces": one("SELECT count(*) FROM traces"),
            "nodes": one("SELECT count(*) FROM nodes"),
            "branches": one("SELECT count(*) FROM branches"),
            "segments": one("SELECT count(*) FROM segments"),
            "rejects": one("SELECT count(*) FROM rejects"),
            "tokens": int(node_tokens),
            "sampled_tokens": int(one("SELECT coalesce(sum(n_sampled), 0) FROM nodes")),
            "branch_tokens": int(branch_tokens),
            "stored_tokens": int(stored_tokens),
            "dedup_ratio": round(branch_tokens / stored_tokens, 3) if stored_tokens else None,
            "bytes": size,
        }


def _rows(table: pa.Table) -> list[dict[str, Any]]:
    cols = {name: table.column(name) for name in table.column_names}
    out = []
    for i in range(table.num_rows):
        out.append({name: col[i] for name, col in cols.items()})
    return out


def _floats(scalar: pa.Scalar) -> list[float] | None:
    if not scalar.is_valid:
        return None
    return _shortest(scalar.values.to_numpy(zero_copy_only=False))


def _node_record(row: dict[str, pa.Scalar], named_credit: bool = False) -> dict[str, Any]:
    present = row["present"].as_py()
    if named_credit:  # a named set decides by itself whether the node has advantages
        present = present | BIT["advantages"] if row["advantages"].is_valid else present & ~BIT["advantages"]
    has = lambda key: bool(present & BIT[key])  # noqa: E731
    node: dict[str, Any] = {}
    if has("parent"):
        node["parent"] = row["parent"].as_py()
    if has("semantic_parents"):
        kept = row["semantic_parents_record"].as_py()
        node["semantic_parents"] = json.loads(kept) if kept else row["semantic_parents"].as_py()
    if has("message"):
        node["message"] = json.loads(row["message"].as_py())
    if has("sampled"):
        node["sampled"] = row["sampled"].as_py()
    if has("timestamp"):
        node["timestamp"] = row["timestamp"].as_py()
    if has("token_ids"):
        node["token_ids"] = row["token_ids"].as_py()
    if has("mask"):
        n = row["n_tokens"].as_py()
        prefix = row["mask_prefix"].as_py()
        if prefix is not None:
            node["mask"] = [False] * prefix + [True] * (n - prefix)
        else:
            node["mask"] = [k > 0 for k in row["mask_slots"].as_py()]
    if has("is_content"):
        node["is_content"] = row["is_content"].as_py()
    for name in COMPACT_STREAMS:
        if has(name):
            node[name] = _floats(row[name])
    if has("loss_weights"):
        lw = row["loss_weights"]
        node["loss_weights"] = (
            None if not lw.is_valid else {k: _shortest(np.asarray(v, np.float32)) for k, v in lw.as_py()}
        )
    extra = row["extra"].as_py()
    if extra:
        node.update(json.loads(extra))
    return node


def existing_ids(con: duckdb.DuckDBPyConnection, table: str, column: str, ids: Iterable[str]) -> set[str]:
    """Which of ``ids`` are in ``table.column``."""
    ids = list(ids)
    if not ids:
        return set()
    rows = con.execute(
        f"SELECT {quote_identifier(column)} FROM {quote_identifier(table)} "
        f"WHERE {quote_identifier(column)} IN (SELECT unnest(?::VARCHAR[]))",
        [ids],
    ).fetchall()
    return {r[0] for r in rows}


def _close_then(con: duckdb.DuckDBPyConnection, release: Callable[[], None]) -> None:
    try:
        con.close()
    finally:
        release()


def connect(path: str | Path = ":memory:", *, read_only: bool = False, isolated: bool = False) -> Database:
    """Open (creating if needed) a tracedb database; ``":memory:"`` for a throwaway one.

    Databases are attached to one DuckDB instance per process (see
    :mod:`tracedb._instance`: opening is ~2 ms instead of ~15 ms, and the instance's
    memory is reused); ``SET`` statements therefore apply to all of them. ``isolated=True``
    gives this database a DuckDB instance of its own.
    """
    return Database(path, read_only=read_only, isolated=isolated)
