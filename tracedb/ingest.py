"""Ingest of verifiers ``traces.jsonl`` files into a tracedb database.

Files are read line by line (``.jsonl``, ``.jsonl.zst``; a ``.json`` file holds one
record; directories are walked for the first two). Each line is parsed and checked on
its own: a bad line is rejected with its location and kept in ``rejects``, its
neighbours are still ingested. One ``ingest`` call is one transaction: it lands whole
or not at all, and with ``strict=True`` any rejection aborts it.
"""

from __future__ import annotations

import contextlib
import json
import queue
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import duckdb
import numpy as np
import pyarrow as pa
import simdjson

from tracedb._instance import ROW_GROUP_ROWS
from tracedb.blocks import NODE_SCHEMA, Block, Scanner, _open, list_array, read_chunks, scan_chunk, segment_key
from tracedb.errors import IngestAborted, Location, RecordError
from tracedb.models import COMPACT_STREAMS
from tracedb.records import (
    ParsedLine,
    ParsedNode,
    ParsedTrace,
    _Fallback,
    check_trace,
    parse_fast,
    parse_slow,
)
from tracedb.store import existing_ids

if TYPE_CHECKING:
    from tracedb.store import Database

BATCH_TOKENS = 1_000_000
"""Write buffered rows to DuckDB after this many tokens (checked at the end of each chunk
of the file, see :data:`tracedb.blocks.CHUNK_BYTES`), which bounds ingest memory
whatever the input size (a batch is parsed while the one before it is inserted by
``_Writer``, and at most one more waits)."""


@dataclass
class Reject:
    """A rejected input record and why."""

    file: str | None
    line: int | None
    trace_id: str | None
    node: int | None
    field: str | None
    reason: str

    def __str__(self) -> str:
        return str(RecordError(self.reason, Location(self.file, self.line, self.trace_id, self.node, self.field)))


def _text(value: str | None) -> str | None:
    """``value`` as storable text: a lone surrogate (not Unicode) is written as its escape."""
    if value is None:
        return None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    return value


@dataclass
class IngestReport:
    """What one ``ingest`` call did."""

    files: int = 0
    lines: int = 0
    episodes: int = 0
    traces: int = 0
    skipped: int = 0
    """Traces already in the database (or earlier in this ingest): not added again."""
    nodes: int = 0
    tokens: int = 0
    segments_added: int = 0
    rejected: list[Reject] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.rejected

    def to_dict(self) -> dict[str, Any]:
        return {
            "files": self.files,
            "lines": self.lines,
            "episodes": self.episodes,
            "traces": self.traces,
            "skipped": self.skipped,
            "nodes": self.nodes,
            "tokens": self.tokens,
            "segments_added": self.segments_added,
            "rejected": [r.__dict__ for r in self.rejected],
            "seconds": round(self.seconds, 3),
        }

    def __str__(self) -> str:
        text = (
            f"ingested {self.traces} traces ({self.episodes} episodes, {self.nodes} nodes, "
            f"{self.tokens} tokens) from {self.files} files in {self.seconds:.2f}s"
        )
        if self.skipped:
            text += f"; {self.skipped} traces already present, not added again"
        if self.rejected:
            text += f"; {len(self.rejected)} records rejected"
        return text


# --------------------------------------------------------------------------- files


def find_files(paths: Iterable[str | Path]) -> list[Path]:
    """Expand directories (recursively) into their ``.jsonl`` / ``.jsonl.zst`` files."""
    out: list[Path] = []
    for p in paths:
        p = Path(p)
        if p.is_dir():
            found = [q for q in p.rglob("*") if q.is_file() and q.name.endswith((".jsonl", ".jsonl.zst"))]
            out.extend(sorted(found))
        elif p.exists():
            out.append(p)
        else:
            raise FileNotFoundError(f"no such file or directory: {p}")
    return out


def read_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes) of each non-blank record; a ``.json`` file is one record."""
    with _open(path) as f:
        if path.suffix == ".json":
            data = f.read()
            if data.strip():
                yield 1, data
            return
        for number, line in enumerate(f, 1):
            if line.strip():
                yield number, line.rstrip(b"\r\n")


# --------------------------------------------------------------------------- columns


def _list_array(chunks: list[np.ndarray | None], value_type: pa.DataType) -> pa.Array:
    """A list array from numpy chunks (None = a null list) with one copy of the values."""
    lengths = np.fromiter((0 if c is None else len(c) for c in chunks), dtype=np.int64, count=len(chunks))
    offsets = np.zeros(len(chunks) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    present = [c for c in chunks if c is not None and len(c)]
    dtype = value_type.to_pandas_dtype()
    values = pa.array(np.concatenate(present).astype(dtype, copy=False) if present else np.zeros(0, dtype), value_type)
    return list_array(offsets, values, np.fromiter((c is None for c in chunks), dtype=bool, count=len(chunks)))


def branch_paths(
    parents: list[int | None], links: list[list[dict[str, Any]] | None]
) -> list[tuple[int, bool, list[int]]]:
    """(leaf, trainable, root-to-leaf path) per branch, in verifiers' leaf order.

    A leaf with a ``compaction_attempt`` link is trainable only if some node holds a
    ``compaction`` link to it.
    """
    has_child = {p for p in parents if p is not None}
    accepted = {link["node"] for ls in links if ls for link in ls if link["type"] == "compaction"}
    out = []
    for leaf in range(len(parents)):
        if leaf in has_child:
            continue
        path = []
        nid: int | None = leaf
        while nid is not None:
            path.append(nid)
            nid = parents[nid]
        path.reverse()
        attempt = any(link["type"] == "compaction_attempt" for link in links[leaf] or [])
        out.append((leaf, not attempt or leaf in accepted, path))
    return out


def _reward(meta: dict[str, Any]) -> float | None:
    rewards = meta.get("rewards") or {}
    scored = [r for r in rewards.values() if isinstance(r, dict) and r.get("score") is not None]
    if not scored:
        return None
    return float(sum(r["score"] * r.get("weight", 1.0) for r in scored))


class _Batch:
    """Rows buffered for one flush to DuckDB."""

    def __init__(self) -> None:
        self.episodes: list[dict[str, Any]] = []
        self.traces: list[dict[str, Any]] = []
        self.nodes: list[tuple[str, int, ParsedNode, bytes]] = []
        self.blocks: dict[int, tuple[Block, list[np.ndarray]]] = {}
        """Per block (by id): the block and the node rows of its fresh traces."""
        self.branches: list[tuple[str, int, int, bool, list[int], int, int]] = []
        self.segments: dict[bytes, np.ndarray] = {}
        self.pending: list[tuple[ParsedLine, str, int]] = []
        self.tokens = 0

    def add(self, line: ParsedLine, source: str, number: int, group_id: str | None, fresh: list[ParsedTrace]) -> None:
        if line.episode is not None:
            ep = line.episode
            self.episodes.append(
                {
                    "episode_id": ep["id"],
                    "group_id": group_id,
                    "env_id": (ep.get("env") or {}).get("id") if isinstance(ep.get("env"), dict) else None,
                    "ok": ep.get("ok"),
                    "record": json.dumps(ep, separators=(",", ":")),
                    "source": source,
                    "line": number,
                }
            )
        for t in fresh:
            block = t.block
            if block is None:
                parents = [n.parent for n in t.nodes]
                links = [n.semantic_parents for n in t.nodes]
                sizes = [len(n.token_ids) for n in t.nodes]
                sampled = [n.n_sampled for n in t.nodes]
            else:
                lo, hi = t.rows
                parents = block.parents(lo, hi)
                links = block.links(lo, hi)
                sizes = block.n_tokens[lo:hi].tolist()
                sampled = block.n_sampled[lo:hi].tolist()
            paths = branch_paths(parents, links)
            for i, (leaf, trainable, path) in enumerate(paths):
                self.branches.append(
                    (t.trace_id, i, leaf, trainable, path, sum(sizes[j] for j in path), sum(sampled[j] for j in path))
                )
            meta = t.meta
            self.traces.append(
                {
                    "trace_id": t.trace_id,
                    "episode_id": t.episode_id,
                    "position": t.position,
                    "group_id": group_id,
                    "reward": _reward(meta),
                    "ok": meta.get("ok"),
                    "is_completed": meta.get("is_completed"),
                    "is_timeout": meta.get("is_timeout"),
                    "stop_condition": meta.get("stop_condition"),
                    "n_nodes": len(sizes),
                    "n_branches": len(paths),
                    "n_tokens": sum(sizes),
                    "n_sampled": sum(sampled),
                    "record": json.dumps(meta, separators=(",", ":")),
                    "source": source,
                    "line": number,
                }
            )
            if block is None:
                for i, node in enumerate(t.nodes):
                    key = segment_key(node.token_ids)
                    self.segments.setdefault(key, node.token_ids)
                    self.nodes.append((t.trace_id, i, node, key))
                continue
            lo, hi = t.rows
            self.blocks.setdefault(id(block), (block, []))[1].append(np.arange(lo, hi))
            segments = self.segments
            for row in range(lo, hi):
                key = block.keys[row]
                if key not in segments:
                    segments[key] = block.token_ids(row)

    def node_table(self) -> pa.Table:
        """The nodes of both parse paths, in :data:`NODE_SCHEMA`."""
        parts = [self._legacy_table()] if self.nodes else []
        for block, ranges in self.blocks.values():
            parts.append(block.table(np.concatenate(ranges)))
        return parts[0] if len(parts) == 1 else pa.concat_tables(parts)

    def _legacy_table(self) -> pa.Table:

        rows = self.nodes
        nodes = [r[2] for r in rows]
        n_tokens = np.array([len(n.token_ids) for n in nodes], dtype=np.int32)
        n_sampled = np.array([n.n_sampled for n in nodes], dtype=np.int32)
        prefix = [n.mask_prefix for n in nodes]
        slots = [None if n.mask is None else np.where(n.mask, np.cumsum(n.mask), 0).astype(np.int32) for n in nodes]
        lw_type = pa.map_(pa.string(), pa.list_(pa.float32()))
        loss_weights = pa.array(
            [None if n.loss_weights is None else [(k, v.tolist()) for k, v in n.loss_weights.items()] for n in nodes],
            type=lw_type,
        )
        sp_type = pa.list_(pa.struct([("node", pa.int32()), ("type", pa.string())]))
        semantic = pa.array(
            [
                None
                if n.semantic_parents is None
                else [{"node": s["node"], "type": s["type"]} for s in n.semantic_parents]
                for n in nodes
            ],
            type=sp_type,
        )
        columns = {
            "trace_id": pa.array([r[0] for r in rows], pa.string()),
            "node_index": pa.array([r[1] for r in rows], pa.int32()),
            "parent": pa.array([n.parent for n in nodes], pa.int32()),
            "role": pa.array([n.role for n in nodes], pa.string()),
            "sampled": pa.array([n.sampled for n in nodes], pa.bool_()),
            "timestamp": pa.array([None if n.timestamp is None else float(n.timestamp) for n in nodes], pa.float64()),
            "segment_id": pa.array([r[3] for r in rows], pa.binary()),
            "n_tokens": pa.array(n_tokens),
            "n_sampled": pa.array(n_sampled),
            "mask_prefix": pa.array(prefix, pa.int32()),
            "mask_slots": _list_array(slots, pa.int32()),
            "is_content": _list_array([n.is_content for n in nodes], pa.bool_()),
        }
        for name in COMPACT_STREAMS:
            columns[name] = _list_array([n.streams[name] for n in nodes], pa.float32())
        columns["loss_weights"] = loss_weights
        columns["semantic_parents"] = semantic
        columns["semantic_parents_record"] = pa.array(
            [
                json.dumps(n.semantic_parents)
                if n.semantic_parents and any(len(link) != 2 for link in n.semantic_parents)
                else None
                for n in nodes
            ],
            pa.string(),
        )
        columns["message"] = pa.array([n.message for n in nodes], pa.string())
        columns["extra"] = pa.array([n.extra for n in nodes], pa.string())
        columns["present"] = pa.array([n.present for n in nodes], pa.int32())
        return pa.table(columns).cast(NODE_SCHEMA)

    def segment_table(self) -> pa.Table:
        keys = list(self.segments)
        chunks = [self.segments[k] for k in keys]
        return pa.table(
            {
                "segment_id": pa.array(keys, pa.binary()),
                "n_tokens": pa.array([len(c) for c in chunks], pa.int32()),
                "token_ids": _list_array(chunks, pa.int32()),
            }
        )


@dataclass
class _Seen:
    """What one ingest has added so far (not committed yet, so its reader cannot see it)."""

    traces: set[str] = field(default_factory=set)
    episodes: set[str] = field(default_factory=set)
    segments: set[bytes] = field(default_factory=set)


def _existing_segments(reader: Any, keys: list[bytes]) -> set[bytes]:
    if not keys:
        return set()
    reader.register("_tdb_keys", pa.table({"segment_id": pa.array(keys, pa.binary())}))
    try:
        rows = reader.execute(
            "SELECT segment_id FROM segments WHERE segment_id IN (SELECT segment_id FROM _tdb_keys)"
        ).fetchall()
    finally:
        reader.unregister("_tdb_keys")
    return {r[0] for r in rows}


def _resolve(reader: Any, batch: _Batch, report: IngestReport, seen: _Seen) -> None:
    """Turn pending lines into rows, leaving out traces, episodes and token segments the
    database already holds.

    ``reader`` sees the database as committed before this ingest; ``seen`` is what this
    ingest has added so far."""
    ids = [t.trace_id for line, _, _ in batch.pending for t in line.traces]
    episode_ids = [line.episode["id"] for line, _, _ in batch.pending if line.episode is not None]
    known = existing_ids(reader, "traces", "trace_id", ids) | (seen.traces & set(ids))
    known_episodes = existing_ids(reader, "episodes", "episode_id", episode_ids) | (seen.episodes & set(episode_ids))
    for line, source, number in batch.pending:
        fresh = []
        for t in line.traces:
            if t.trace_id in known:
                report.skipped += 1
            else:
                known.add(t.trace_id)
                fresh.append(t)
        group = (line.episode or {}).get("group")
        group_id = group.get("id") if isinstance(group, dict) else None
        if line.episode is not None:
            if line.episode["id"] in known_episodes:
                line.episode = None  # already stored; its new traces still join it
            else:
                known_episodes.add(line.episode["id"])
                seen.episodes.add(line.episode["id"])
                report.episodes += 1
        batch.add(line, source, number, group_id, fresh)
        report.traces += len(fresh)
        report.nodes += sum(t.n_nodes for t in fresh)
        report.tokens += sum(t.n_tokens for t in fresh)
    seen.traces.update(known)
    segments = batch.segments
    new = [k for k in segments if k not in seen.segments]
    stored = _existing_segments(reader, new)
    for key in list(segments):
        if key in seen.segments or key in stored:
            del segments[key]
    seen.segments.update(segments)
    report.segments_added += len(segments)


_Insert = tuple[str, str, pa.Table]  # registered name, INSERT statement reading it, rows


def _batch_inserts(batch: _Batch) -> list[_Insert]:
    """The INSERTs of one batch, its Arrow tables built (the Python half of a flush)."""
    out: list[_Insert] = []
    if batch.episodes:
        out.append(
            (
                "_tdb_episodes",
                "INSERT INTO episodes (episode_id, group_id, env_id, ok, record, source, line) "
                "SELECT episode_id, group_id, env_id, ok, record, source, line FROM _tdb_episodes",
                pa.Table.from_pylist(batch.episodes),
            )
        )
    if batch.traces:
        out.append(
            (
                "_tdb_traces",
                "INSERT INTO traces (trace_id, episode_id, position, group_id, reward, ok, is_completed, is_timeout,"
                " stop_condition, n_nodes, n_branches, n_tokens, n_sampled, record, source, line)"
                " SELECT trace_id, episode_id, position, group_id, reward, ok, is_completed, is_timeout,"
                " stop_condition, n_nodes, n_branches, n_tokens, n_sampled, record, source, line FROM _tdb_traces",
                pa.Table.from_pylist(batch.traces),
            )
        )
    if batch.segments:
        out.append(
            (
                "_tdb_segments",
                "INSERT INTO segments SELECT segment_id, n_tokens, token_ids FROM _tdb_segments",
                batch.segment_table(),
            )
        )
    if batch.nodes or batch.blocks:
        table = batch.node_table()
        out.append(
            ("_tdb_nodes", f"INSERT INTO nodes ({', '.join(table.column_names)}) SELECT * FROM _tdb_nodes", table)
        )
    if batch.branches:
        b = batch.branches
        table = pa.table(
            {
                "trace_id": pa.array([r[0] for r in b], pa.string()),
                "branch_index": pa.array([r[1] for r in b], pa.int32()),
                "leaf": pa.array([r[2] for r in b], pa.int32()),
                "trainable": pa.array([r[3] for r in b], pa.bool_()),
                "path": pa.array([r[4] for r in b], pa.list_(pa.int32())),
                "n_tokens": pa.array([r[5] for r in b], pa.int64()),
                "n_sampled": pa.array([r[6] for r in b], pa.int64()),
            }
        )
        out.append(("_tdb_branches", "INSERT INTO branches SELECT * FROM _tdb_branches", table))
    return out


class _Writer:
    """Runs an ingest's INSERTs on its connection (inside its transaction) in a thread of
    its own: DuckDB releases the GIL while it inserts, so batch k is written while Python
    parses batch k+1. At most one batch waits, which keeps ingest memory bounded."""

    def __init__(self, con: Any) -> None:
        self.con = con
        self.error: BaseException | None = None
        self.cancelled = False
        self._queue: queue.Queue[list[_Insert] | None] = queue.Queue(maxsize=1)
        self._held: dict[str, tuple[str, pa.Table]] = {}
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
        for name, (statement, table) in held.items():
            self._insert(name, statement, table)

    def _write(self, inserts: list[_Insert]) -> None:
        """Insert whole row groups of each table; the rows beyond the last whole group wait
        for the next batch (and the last ones for :meth:`_write_held`), each as one Arrow chunk.
        DuckDB writes a transaction's full row groups into the file as it inserts them,
        unless an INSERT left a row group partly filled or read its rows from several
        chunks (in parallel): then the rows are written again at COMMIT (commit 0.16-0.3 s
        instead of 0.035 s on the benchmark ingest, and the file keeps the first copy's
        blocks as free space, +40%; measured)."""
        held = self._held
        for name, statement, table in inserts:
            if name in held:
                table = pa.concat_tables([held.pop(name)[1], table], promote_options="permissive")
            table = table.combine_chunks()
            rows = len(table) // ROW_GROUP_ROWS * ROW_GROUP_ROWS
            if rows < len(table):
                self._held[name] = (statement, table.slice(rows))
            if rows:
                self._insert(name, statement, table.slice(0, rows))

    def _insert(self, name: str, statement: str, table: pa.Table) -> None:
        if self.cancelled:
            return
        con = self.con
        con.register(name, table)
        try:
            con.execute(statement)
        except BaseException:
            with contextlib.suppress(duckdb.Error):  # the aborted transaction refuses it; ROLLBACK drops it
                con.unregister(name)
            raise  # the INSERT's own error, not the unregister's
        con.unregister(name)

    def submit(self, inserts: list[_Insert]) -> None:
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


def _flush(reader: Any, writer: _Writer, batch: _Batch, report: IngestReport, seen: _Seen) -> None:
    _resolve(reader, batch, report, seen)
    writer.submit(_batch_inserts(batch))


def _record_rejects(db: Database, rejects: list[tuple[Reject, bytes]]) -> None:
    if not rejects:
        return
    rows = [
        {
            "source": r.file,
            "line": r.line,
            "trace_id": r.trace_id,
            "node": r.node,
            "field": r.field,
            "reason": r.reason,
            "record": raw.decode("utf-8", errors="replace"),
        }
        for r, raw in rejects
    ]
    table = pa.Table.from_pylist(
        rows,
        schema=pa.schema(
            [
                ("source", pa.string()),
                ("line", pa.int64()),
                ("trace_id", pa.string()),
                ("node", pa.int32()),
                ("field", pa.string()),
                ("reason", pa.string()),
                ("record", pa.string()),
            ]
        ),
    )
    db.con.register("_tdb_rejects", table)
    db.con.execute(
        "INSERT INTO rejects (source, line, trace_id, node, field, reason, record) SELECT * FROM _tdb_rejects"
    )
    db.con.unregister("_tdb_rejects")


CHECKPOINT_AT_COMMIT = "1MB"
_lowered_lock = threading.Lock()
_lowered: dict[object, list[Any]] = {}  # DuckDB instance -> [ingests committing, its own threshold]


def _commit_into_file(db: Database) -> None:
    """COMMIT with DuckDB's checkpoint threshold lowered for the moment, so that a large
    ingest is written into the database file at commit (DuckDB then skips its WAL)
    instead of into the WAL first and the file again at the next checkpoint: the 146 MB
    benchmark file commits + closes in ~0.3 s instead of ~0.4 s, and the file is compact
    as soon as ``ingest`` returns.

    The setting belongs to the DuckDB instance, which the databases of the process share:
    the first of concurrent ingests lowers it, the last one puts back the value found
    before the first (meanwhile other commits of the instance checkpoint at 1 MB too)."""
    key, con = db._instance_key, db.con
    with _lowered_lock:
        entry = _lowered.get(key)
        if entry is None:
            own = con.execute("SELECT current_setting('checkpoint_threshold')").fetchall()[0][0]
            con.execute(f"SET checkpoint_threshold = '{CHECKPOINT_AT_COMMIT}'")
            entry = _lowered[key] = [0, own]
        entry[0] += 1
    try:
        con.execute("COMMIT")
    finally:
        with _lowered_lock:
            entry[0] -= 1
            if entry[0] == 0:
                del _lowered[key]
                con.execute(f"SET checkpoint_threshold = '{entry[1]}'")


def parse_line(parser: simdjson.Parser, raw: bytes, where: Location, *, allow_ragged: bool = False) -> ParsedLine:
    """Parse and check one record; raises :class:`RecordError` when it is bad."""
    try:
        line = parse_fast(parser, raw)
    except _Fallback:
        line = parse_slow(raw, where)
    for t in line.traces:
        check_trace(t, where, allow_ragged=allow_ragged)
    return line


def ingest(
    db: Database,
    paths: str | Path | Iterable[str | Path],
    *,
    strict: bool = False,
    allow_ragged: bool = False,
    progress: bool = False,
) -> IngestReport:
    """Ingest files or directories into ``db``; see :meth:`tracedb.Database.ingest`."""
    started = time.perf_counter()
    if isinstance(paths, (str, Path)):
        paths = [paths]
    files = find_files(paths)
    report = IngestReport(files=len(files))
    parser = simdjson.Parser()
    rejects: list[tuple[Reject, bytes]] = []
    seen = _Seen()
    con = db.con
    con.execute("BEGIN TRANSACTION")
    reader: Any = None
    writer: _Writer | None = None
    bar = None
    try:
        reader = db.cursor()
        writer = _Writer(con)
        bar = _progress(files) if progress else None
        batch = _Batch()
        scanner = Scanner()
        for path in files:
            source = str(path)
            for chunk in read_chunks(path):
                if bar is not None:
                    bar.advance(len(chunk.data))
                _, scanned = scan_chunk(chunk, scanner, allow_ragged=allow_ragged)
                for k, line in enumerate(scanned):
                    number = int(chunk.numbers[k])
                    if line is None:  # not taken by the scanner (or blank)
                        raw = chunk.raw(k)
                        if not raw.strip():
                            continue
                        try:
                            line = parse_line(parser, raw, Location(source, number), allow_ragged=allow_ragged)
                        except RecordError as e:
                            report.lines += 1
                            loc = e.location
                            trace_id, field, reason = _text(loc.trace_id), _text(loc.field), _text(e.reason)
                            reject = Reject(_text(loc.file), loc.line, trace_id, loc.node, field, reason)
                            if strict:
                                raise IngestAborted(e) from None
                            rejects.append((reject, raw))
                            report.rejected.append(reject)
                            continue
                    report.lines += 1
                    batch.pending.append((line, source, number))
                    batch.tokens += sum(t.n_tokens for t in line.traces)
                if batch.tokens >= BATCH_TOKENS:  # at a chunk's end: a block goes whole into one batch
                    _flush(reader, writer, batch, report, seen)
                    batch = _Batch()
        _flush(reader, writer, batch, report, seen)
        writer.finish()
        _record_rejects(db, rejects)
        _commit_into_file(db)
    except BaseException:
        try:
            if writer is not None:
                writer.cancel()
        finally:
            if writer is not None:
                writer.wait()  # never roll back under a running INSERT
            # A failed COMMIT has ended the transaction already: its error is the one to see.
            with contextlib.suppress(duckdb.TransactionException):
                con.execute("ROLLBACK")
        raise
    finally:
        if reader is not None:
            reader.close()
        if bar is not None:
            bar.stop()
    db._changed()
    report.seconds = time.perf_counter() - started
    return report


class _Bar:
    def __init__(self, total: int) -> None:
        from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

        self.progress = Progress(
            "[progress.description]{task.description}",
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            transient=True,
        )
        self.task = self.progress.add_task("ingest", total=total)
        self.progress.start()

    def advance(self, n: int) -> None:
        self.progress.advance(self.task, n)

    def stop(self) -> None:
        self.progress.stop()


def _progress(files: list[Path]) -> _Bar:
    return _Bar(sum(p.stat().st_size for p in files))
