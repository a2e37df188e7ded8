"""The compiled scanner's Python side: chunks of lines scanned into columns of nodes.

:func:`scan_chunk` runs the scanner (:mod:`tracedb.ingest._scan`) over a chunk of whole
lines (:func:`tracedb.ingest.files.read_chunks`) and returns :class:`ScannedNodes` (every
node of the chunk's accepted lines, as flat buffers) plus, per line, either a
:class:`~tracedb.ingest.parse.ParsedLine` whose traces point into those nodes or
``None``: that line goes through :func:`tracedb.ingest.parse.parse_line`, which parses
what the scanner does not take and words every error.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pyarrow as pa
import pydantic

from tracedb import policy, runtime, tables
from tracedb.ingest import _scan as S
from tracedb.ingest.columns import list_array, segment_keys
from tracedb.ingest.files import Chunk
from tracedb.ingest.parse import ParsedLine, ParsedTrace
from tracedb.records import COMPACT_STREAMS, NUMBERS_CHECKED, Episode, Trace

# --------------------------------------------------------------------------- scanning


def _strings(n: int, offsets: np.ndarray, data: np.ndarray, valid: np.ndarray | None) -> pa.Array:
    """A string array over ``data`` (offsets per entry plus the end), nulls where not valid."""
    bitmap = None
    if valid is not None and not valid.all():
        bitmap = pa.array(valid).buffers()[1]
    arr = pa.Array.from_buffers(pa.string(), n, [bitmap, pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(data)])
    arr.validate(full=True)  # UTF-8
    return arr


class ScannedNodes:
    """The nodes a scan accepted, as columns; traces refer to them by row range."""

    def __init__(self, out: dict[str, np.ndarray], keys: list[bytes] | None = None) -> None:
        """Copy what the scan wrote out of the scanner's buffers (which the next chunk reuses);
        ``keys``: the segment keys of its rows when already computed (:func:`scan_only`)."""
        counts = out["counts"]
        n = int(counts[S.C_NODE])
        nodes = out["nodes"][:n].copy()
        self.n = n
        self.nodes = nodes
        self.nulls = nodes[:, S.N_NULLS]

        def ends(col: int, counter: int) -> np.ndarray:
            return np.append(nodes[:, col], counts[counter])

        def used(name: str, counter: int) -> np.ndarray:
            return out[name][: counts[counter]].copy()

        self.tok_off = ends(S.N_TOK_OFF, S.C_TOK)
        self.tokens = used("tokens", S.C_TOK)
        self.n_tokens = np.diff(self.tok_off).astype(np.int32)
        self.n_sampled = nodes[:, S.N_NSAMP].astype(np.int32)
        self.link_off = ends(S.N_LINK_OFF, S.C_LINK)
        self.link_nodes = used("link_nodes", S.C_LINK)
        type_off = np.append(out["link_type_off"][: counts[S.C_LINK]], counts[S.C_LTXT])
        self.link_types = _strings(len(self.link_nodes), type_off, used("link_text", S.C_LTXT), None)
        self.message = _strings(n, ends(S.N_MSG_OFF, S.C_MSG), used("messages", S.C_MSG), None)
        self.role = _strings(n, ends(S.N_ROLE_OFF, S.C_ROLE), used("roles", S.C_ROLE), (self.nulls & S.NULL_ROLE) == 0)
        self.extra = _strings(
            n, ends(S.N_EXTRA_OFF, S.C_EXTRA), used("extras", S.C_EXTRA), (self.nulls & S.NULL_EXTRA) == 0
        )
        self.timestamps = out["timestamps"][:n].copy()
        self.stream_off = [ends(S.N_STREAM_OFF + s, S.C_STREAM + s) for s in range(len(COMPACT_STREAMS))]
        self.streams = [out["streams"][s, : counts[S.C_STREAM + s]].copy() for s in range(len(COMPACT_STREAMS))]
        self.slot_off = ends(S.N_SLOT_OFF, S.C_SLOT)
        self.slots = used("slots", S.C_SLOT)
        self.ic_off = ends(S.N_IC_OFF, S.C_IC)
        self.is_content = used("is_content", S.C_IC)
        self._hard(out)
        self.unfit = self._unfit()
        """Per row: a stream value beyond the float32 range, or a timestamp beyond the
        double range (its line goes the other way, which rejects it naming the field)."""
        self.keys = segment_keys(self.tokens, self.tok_off) if keys is None else keys
        """Per row, the content address of its tokens."""
        self.trace_ids: list[str | None] = [None] * int(counts[S.C_TRACE])
        """Per trace of the scan, its id once its line is accepted."""

    def _hard(self, out: dict[str, np.ndarray]) -> None:
        """Convert the floats the scanner left as text (Arrow's parser is exact)."""
        counts = out["counts"]
        h = int(counts[S.C_HARD])
        if not h:
            return
        offsets = np.append(out["hard_off"][:h], counts[S.C_HTXT])
        text = pa.Array.from_buffers(
            pa.string(), h, [None, pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(out["hard_text"])]
        )
        # float32 streams round from these doubles; one beyond the double range is infinity,
        # which sends its line (only) the other way (see _unfit)
        import pyarrow.compute as pc  # only here: an ingest without such floats does not import it

        values = pc.cast(text, pa.float64()).to_numpy()
        target, index = out["hard_target"][:h], out["hard_index"][:h]
        ts = target == S.HARD_TS
        self.timestamps[index[ts]] = values[ts]
        with np.errstate(over="ignore"):  # beyond float32: infinity, refused below
            for s in range(len(COMPACT_STREAMS)):
                mine = target == s
                self.streams[s][index[mine]] = values[mine]

    def _unfit(self) -> np.ndarray:
        unfit = ~np.isfinite(self.timestamps) & ((self.nulls & S.NULL_TS) == 0)
        for off, values in zip(self.stream_off, self.streams, strict=True):
            bad = np.flatnonzero(~np.isfinite(values))
            if len(bad):
                unfit[np.searchsorted(off, bad, side="right") - 1] = True
        return unfit

    def token_ids(self, row: int) -> np.ndarray:
        return self.tokens[self.tok_off[row] : self.tok_off[row + 1]]

    def parents(self, lo: int, hi: int) -> list[int | None]:
        return [None if p < 0 else p for p in self.nodes[lo:hi, S.N_PARENT].tolist()]

    def links(self, lo: int, hi: int) -> list[list[dict[str, Any]] | None]:
        out: list[list[dict[str, Any]] | None] = [None] * (hi - lo)
        off = self.link_off
        for r in np.flatnonzero(np.diff(off[lo : hi + 1])).tolist():
            a, b = off[lo + r], off[lo + r + 1]
            out[r] = [
                {"node": int(node), "type": kind}
                for node, kind in zip(self.link_nodes[a:b].tolist(), self.link_types[a:b].to_pylist(), strict=True)
            ]
        return out

    def table(self, rows: np.ndarray) -> pa.Table:
        """The ``nodes`` rows of ``rows`` (row numbers here), in :data:`tracedb.tables.NODES`."""
        nodes, nulls = self.nodes, self.nulls
        parent = nodes[:, S.N_PARENT]
        sampled = nodes[:, S.N_SAMPLED]
        prefix = nodes[:, S.N_PREFIX]
        links = pa.StructArray.from_arrays(
            [pa.array(self.link_nodes, pa.int32()), self.link_types], names=["node", "type"]
        )
        columns: dict[str, Any] = {
            "trace_id": pa.array(self.trace_ids, pa.string()).take(pa.array(nodes[:, S.N_TRACE])),
            "node_index": pa.array(nodes[:, S.N_INDEX].astype(np.int32)),
            "parent": pa.array(parent.astype(np.int32), mask=parent < 0),
            "role": self.role,
            "sampled": pa.array(sampled == 1, mask=sampled < 0),
            "timestamp": pa.array(self.timestamps, mask=(nulls & S.NULL_TS) != 0),
            "n_tokens": pa.array(self.n_tokens),
            "n_sampled": pa.array(self.n_sampled),
            "mask_prefix": pa.array(prefix.astype(np.int32), mask=prefix < 0),
            "mask_slots": list_array(self.slot_off, pa.array(self.slots, pa.int32()), (nulls & S.NULL_SLOTS) != 0),
            "is_content": list_array(self.ic_off, pa.array(self.is_content.view(np.bool_)), (nulls & S.NULL_IC) != 0),
            **{
                name: list_array(off, pa.array(values), (nulls & (1 << (S.NULL_STREAM + s))) != 0)
                for s, (name, off, values) in enumerate(
                    zip(COMPACT_STREAMS, self.stream_off, self.streams, strict=True)
                )
            },
            "loss_weights": pa.nulls(self.n, tables.LOSS_WEIGHTS),
            "semantic_parents": list_array(self.link_off, links, (nulls & S.NULL_LINKS) != 0),
            "semantic_parents_record": pa.nulls(self.n, pa.string()),
            "message": self.message,
            "extra": self.extra,
            "present": pa.array(nodes[:, S.N_PRESENT].astype(np.int32)),
            "weight_versions": pa.nulls(self.n, tables.WEIGHT_VERSIONS),
        }
        if len(rows) != self.n or (len(rows) and (rows[0] != 0 or (np.diff(rows) != 1).any())):
            index = pa.array(rows)
            columns = {name: column.take(index) for name, column in columns.items()}
        keys = self.keys
        columns["segment_id"] = pa.array([keys[r] for r in rows.tolist()], pa.binary())
        return tables.table_from(tables.NODES, columns)


class Scanner:
    """The scanner's output buffers, reused from chunk to chunk: fresh memory costs a
    page fault per 4 KiB on first touch, and a chunk writes ~4x its size."""

    def __init__(self) -> None:
        self.size = -1
        self.n_lines = -1
        self.out: dict[str, np.ndarray] = {}
        self.keys: list[bytes] | None = None  # the segment keys of the last scan's nodes
        self.stack = np.empty(S.MAX_DEPTH, np.uint8)

    def buffers(self, size: int, n_lines: int) -> dict[str, np.ndarray]:
        """Buffers a scan of ``size`` bytes and ``n_lines`` lines cannot overrun (pages
        never written cost nothing)."""
        if size > self.size:
            self.size = max(size, runtime.settings().chunk_bytes)
            size = self.size
            # A value takes 2 bytes of JSON at least (a digit and a comma): every row of
            # values has room for size // 2; text is never longer than the input.
            n_nodes = size // 14 + 4  # {"message":{}} is the smallest node
            out = {
                "traces": np.empty((size // 6 + 4, S.T_COLS), np.int64),  # {"":0}, is the smallest trace
                "nodes": np.empty((n_nodes, S.N_COLS), np.int64),
                "timestamps": np.empty(n_nodes, np.float64),
                "u8": np.empty((S.U_ROWS, size + 4), np.uint8),
                "i32": np.empty((S.I_ROWS, size // 2 + 4), np.int32),
                "i64": np.empty((S.J_ROWS, size // 2 + 4), np.int64),
                "streams": np.empty((len(COMPACT_STREAMS), size // 2 + 4), np.float32),
                "counts": np.zeros(S.C_COLS, np.int64),
            }
            u8, i32, i64 = out["u8"], out["i32"], out["i64"]
            for name, row in (
                ("is_content", u8[S.U_IS_CONTENT]),
                ("link_text", u8[S.U_LINK_TEXT]),
                ("messages", u8[S.U_MESSAGES]),
                ("roles", u8[S.U_ROLES]),
                ("extras", u8[S.U_EXTRAS]),
                ("hard_text", u8[S.U_HARD_TEXT]),
                ("tokens", i32[S.I_TOKENS]),
                ("slots", i32[S.I_SLOTS]),
                ("link_nodes", i32[S.I_LINK_NODES]),
                ("link_type_off", i64[S.J_LINK_TYPE_OFF]),
                ("hard_off", i64[S.J_HARD_OFF]),
                ("hard_target", i64[S.J_HARD_TARGET]),
                ("hard_index", i64[S.J_HARD_INDEX]),
            ):
                out[name] = row
            self.out.update(out)
        if n_lines > self.n_lines:
            self.n_lines = n_lines
            self.out["lines"] = np.empty((n_lines, S.L_COLS), np.int64)
        self.out["counts"][:] = 0
        return self.out


def scan_chunk(
    chunk: Chunk, scanner: Scanner | None = None, *, allow_ragged: bool = False
) -> tuple[ScannedNodes | None, list[ParsedLine | None]]:
    """Scan a chunk: its block and a ParsedLine per line (None: blank, or parse it the other way)."""
    scanner = scanner or Scanner()
    scan_only(chunk, scanner, allow_ragged=allow_ragged)
    return collect(chunk, scanner)


def scan_only(chunk: Chunk, scanner: Scanner, *, allow_ragged: bool = False) -> None:
    """The half of :func:`scan_chunk` that holds the GIL little, so another thread runs it
    beside Python work (then :func:`collect` on the thread that takes the lines): the
    kernel fills ``scanner``'s buffers, and the nodes' segment keys are hashed (BLAKE2b
    lets the GIL go for each segment over 2 KiB)."""
    data = chunk.data
    buf = np.frombuffer(data, dtype=np.uint8)
    out = scanner.buffers(len(data), len(chunk.starts))
    S.scan(
        buf,
        chunk.starts,
        chunk.ends,
        allow_ragged,
        scanner.stack,
        out["lines"],
        out["traces"],
        out["nodes"],
        out["timestamps"],
        out["u8"],
        out["i32"],
        out["i64"],
        out["streams"],
        out["counts"],
    )
    counts = out["counts"]
    n = int(counts[S.C_NODE])
    if (out["lines"][: len(chunk.starts), S.L_STATUS] == S.OK).any():
        offsets = np.append(out["nodes"][:n, S.N_TOK_OFF], counts[S.C_TOK])
        scanner.keys = segment_keys(out["tokens"][: counts[S.C_TOK]], offsets)
    else:
        scanner.keys = None


def collect(chunk: Chunk, scanner: Scanner) -> tuple[ScannedNodes | None, list[ParsedLine | None]]:
    """The Python half of :func:`scan_chunk`, after :func:`scan_only` of the same chunk into
    ``scanner``: the columns copied out of its buffers, a ParsedLine per accepted line."""
    data = chunk.data
    out = scanner.out
    lines = out["lines"][: len(chunk.starts)]
    status = lines[:, S.L_STATUS]
    parsed: list[ParsedLine | None] = [None] * len(status)
    if not (status == S.OK).any():
        return None, parsed
    try:
        block = ScannedNodes(out, scanner.keys)
    except (pa.ArrowInvalid, ValueError):
        return None, parsed  # text that is not UTF-8, a float out of range: the other way
    traces = out["traces"]
    ok = status == S.OK
    if block.unfit.any():  # the lines of traces holding a value beyond float32: the other way
        unfit_traces = np.unique(block.nodes[block.unfit, S.N_TRACE])
        ok[traces[unfit_traces, S.T_LINE]] = False
    for k in np.flatnonzero(ok).tolist():
        parsed[k] = _line(data, int(chunk.starts[k]), int(chunk.ends[k]), lines[k], traces, block)
    return block, parsed


class _Duplicate(ValueError):
    pass


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object whose keys are all distinct (which value a repeated key means differs
    between JSON readers; the other path decides)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        raise _Duplicate
    return out


def _json(text: bytes | str) -> Any:
    return json.loads(text, object_pairs_hook=_unique)


def _meta(data: bytes, lo: int, hi: int, cut_lo: int, cut_hi: int) -> Any:
    """JSON of ``data[lo:hi]`` with ``data[cut_lo:cut_hi]`` (a node or trace list) read as null."""
    # Decoded strictly: json.loads(bytes) would let UTF-8-encoded surrogates through.
    if cut_lo < 0:
        return _json(data[lo:hi].decode("utf-8"))
    return _json(b"".join((data[lo:cut_lo], b"null", data[cut_hi:hi])).decode("utf-8"))


def _line(
    data: bytes, start: int, end: int, line: np.ndarray, traces: np.ndarray, block: ScannedNodes
) -> ParsedLine | None:
    """The record of ``data[start:end]``, its traces' nodes left in the block; None when
    Python's JSON or the contract of the non-node fields disagrees (the other path words it)."""
    try:
        episode = None
        lo, hi = int(line[S.L_TRACE_LO]), int(line[S.L_TRACE_HI])
        if not line[S.L_BARE]:
            episode = _meta(data, start, end, line[S.L_TRACES_LO], line[S.L_TRACES_HI])
            if type(episode) is not dict or type(episode.get("id")) is not str:
                return None
            Episode.model_validate({**episode, "traces": []}, context=NUMBERS_CHECKED)  # the scan read every number
        out = []
        for t in range(lo, hi):
            row = traces[t]
            meta = _meta(data, row[S.T_LO], row[S.T_HI], row[S.T_NODES_LO], row[S.T_NODES_HI])
            if type(meta) is not dict or type(meta.get("id")) is not str:
                return None
            Trace.model_validate({**meta, "nodes": []}, context=NUMBERS_CHECKED)
            parsed = ParsedTrace(meta["id"], None if episode is None else episode["id"], t - lo, meta)
            parsed.block, parsed.rows = block, (int(row[S.T_NODE_LO]), int(row[S.T_NODE_HI]))
            for r in np.flatnonzero((block.nulls[parsed.rows[0] : parsed.rows[1]] & S.NULL_EXTRA) == 0).tolist():
                row_extra = _json(block.extra[parsed.rows[0] + r].as_py())  # unknown node fields: distinct keys
                spans = row_extra.get("weight_versions")
                if spans is not None and (
                    not policy.typed(spans)
                    or policy.span_problem(spans, int(block.n_sampled[parsed.rows[0] + r])) is not None
                ):
                    return None  # the parser words it
            block.trace_ids[t] = meta["id"]
            out.append(parsed)
        return ParsedLine(episode, out)
    except (ValueError, RecursionError, pydantic.ValidationError):
        return None
