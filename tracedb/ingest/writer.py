"""The ingest writer: INSERTs on a thread of their own, whole row groups at a time, and
the COMMIT that writes an ingest into the file."""

from __future__ import annotations

import contextlib
import queue
import threading
from typing import Any

import pyarrow as pa

from tracedb import runtime, tables
from tracedb.handle import Handle
from tracedb.ingest.rows import Insert


class Writer:
    """Runs an ingest's INSERTs on its connection (inside its transaction) in a thread of
    its own: DuckDB releases the GIL while it inserts, so batch k is written while Python
    parses batch k+1. At most one batch waits, which keeps ingest memory bounded."""

    def __init__(self, con: Any, align_rows: int) -> None:
        self.con = con
        self.align_rows = align_rows
        self.error: BaseException | None = None
        self.cancelled = False
        self._queue: queue.Queue[list[Insert] | None] = queue.Queue(maxsize=1)
        self._held: dict[str, pa.Table] = {}
        self._columns: dict[str, list[str]] = {}  # each table's columns, in the file's order
        self._time: Any = None  # the transaction's current_timestamp, once read
        self._thread = threading.Thread(target=self._run, name="tracedb-ingest-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (inserts := self._queue.get()) is not None:
            if self.error is not None or self.cancelled:
                continue  # failed or cancelled: drain until stopped
            try:
                self._write(inserts)
            except BaseException as e:  # handed to the ingesting thread
                self.error = e
        if self.error is None and not self.cancelled:
            try:
                self._write_held()
            except BaseException as e:
                self.error = e

    def _write_held(self) -> None:
        """Insert the rows still held back (see :meth:`_write`)."""
        held, self._held = self._held, {}
        for name, table in held.items():
            self._insert(name, table)

    def _write(self, inserts: list[Insert]) -> None:
        """Insert whole row groups of each table; the rows beyond the last whole group wait
        for the next batch (and the last ones for :meth:`_write_held`), each as one Arrow chunk.
        DuckDB writes a transaction's full row groups into the file as it inserts them,
        unless an INSERT left a row group partly filled or read its rows from several
        chunks (in parallel): then the rows are written again at COMMIT (commit 0.16-0.3 s
        instead of 0.035 s on the benchmark ingest, and the file keeps the first copy's
        blocks as free space, +40%; measured)."""
        held = self._held
        for name, table in inserts:
            if name in held:
                table = pa.concat_tables([held.pop(name), table], promote_options="permissive")
            table = table.combine_chunks()
            rows = len(table) // self.align_rows * self.align_rows
            if rows < len(table):
                self._held[name] = table.slice(rows)
            if rows:
                self._insert(name, table.slice(0, rows))

    def _insert(self, name: str, table: pa.Table) -> None:
        """Append ``table``'s rows (of :data:`tracedb.tables.STORED` ``[name]``) to the table
        holding them (:func:`tracedb.tables.encode_rows`). The rows go in as a relation over the
        Arrow table, not through a registered view: a view registered and dropped inside
        the transaction stays in DuckDB's undo buffer, with the Arrow table it holds, until
        COMMIT, so an ingest's memory grew with everything it wrote (600 MB per GB of
        input, measured); and unlike a replacement scan of a Python variable, a relation
        works where external access is off (a server that runs user SQL)."""
        if self.cancelled:
            return
        name, table = tables.encode_rows(name, table)  # here, beside the INSERT: off the parsing thread
        columns = self._columns.get(name)
        if columns is None:
            columns = self._columns[name] = [
                r[0]
                for r in self.con.execute(
                    "SELECT column_name FROM duckdb_columns() WHERE database_name = current_database() "
                    "AND schema_name = current_schema() AND table_name = ? ORDER BY column_index",
                    [name],
                ).fetchall()
            ]
        missing = [c for c in columns if c not in table.column_names]
        if missing:  # the columns DuckDB would fill from their default: the transaction's time
            stored = {f.name: f for f in tables.PHYSICAL[name]}
            defaults = {c: tables.default_of(stored[c]) if c in stored else None for c in missing}
            if any(d != "current_timestamp" for d in defaults.values()):
                raise ValueError(f"rows for {name} lack {missing}, which have no time default to fill")
            now = self._now()
            for c in missing:
                table = table.append_column(c, pa.array([now] * len(table), pa.timestamp("us")))
        self.con.from_arrow(table.select(columns)).insert_into(name)

    def _now(self) -> Any:
        if self._time is None:
            self._time = self.con.execute("SELECT current_timestamp::TIMESTAMP").fetchall()[0][0]
        return self._time

    def submit(self, inserts: list[Insert]) -> None:
        self._raise()
        self._queue.put(inserts)

    def finish(self) -> None:
        """Wait until every submitted batch is written; raise the writer's error, if any."""
        self._queue.put(None)
        self._thread.join()
        self._raise()

    def cancel(self) -> None:
        """Drop what is queued and interrupt a running INSERT (then ``wait``)."""
        self.cancelled = True
        with contextlib.suppress(queue.Empty):
            self._queue.get_nowait()  # the one waiting batch, if any: room for the stop
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)
        self.con.interrupt()

    def wait(self) -> None:
        """Until the thread is gone, through further Ctrl-C: the connection must be
        idle before anyone rolls back (an INSERT after the ROLLBACK would autocommit)."""
        while self._thread.is_alive():
            with contextlib.suppress(KeyboardInterrupt):
                self._thread.join()

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error


def commit_into_file(handle: Handle, large: bool = True) -> None:
    """COMMIT; a ``large`` one with DuckDB's checkpoint threshold lowered for the moment,
    so that a large ingest is written into the database file at commit (DuckDB then skips
    its WAL) instead of into the WAL first and the file again at the next checkpoint: the
    146 MB benchmark file commits + closes in ~0.3 s instead of ~0.4 s, and the file is
    compact as soon as ``ingest`` returns. A small one (a follower's poll) goes to the WAL
    as usual: a checkpoint rewrites the tables' key indexes whole (0.3-0.7 s at 5M
    segments, measured), which a commit every 0.25 s cannot pay each time; DuckDB
    checkpoints once its WAL reaches its own threshold."""
    if not large:
        handle.con.execute("COMMIT")
        return
    with runtime.lowered_checkpoint(handle.instance_key, handle.con):
        handle.con.execute("COMMIT")
