"""Experiments: tracedb's tables rewritten in candidate encodings, measured (issue 24).

``python -m benchmarks.encodings DB [DB ...] --out DIR`` reads a tracedb file (today's
encodings) and writes the same rows into fresh DuckDB files, one per candidate, each
checkpointed, then measures each file's bytes (``tracedb.storage.breakdown``) and what
the candidate costs: the seconds to encode its columns (the work an ingest would add) and
to decode the view's columns from the file (token ids of every segment, logprobs of every
node, as flat arrays) and the messages (all of them, and one trace's). Nothing here
changes tracedb's stored schema: the files are experiments, their rows are compared with
the source's (each decoded column must equal the source column exactly).

Candidates:

- ``copy``: the source's schema and rows, copied (the baseline: one fresh checkpoint);
- ``block-64k`` / ``block-16k``: the same in blocks of 64 or 16 KiB (DuckDB's default is
  256 KiB; a table's last, partly filled block and every ART index take whole blocks);
- ``no-pk``: the same without PRIMARY KEY constraints (no ART indexes);
- ``zstd-strings``: DuckDB's own zstd (``USING COMPRESSION zstd``) on the JSON columns;
- ``fixed-streams``: logprobs as fixed-point integers (``round(x * 10**4)``, INTEGER[]),
  exact for every value written with 4 decimals (checked);
- ``chunked-zstd-L``: no PK, 16 KiB blocks, and the big columns as zstd frames (level L)
  of about 1 MiB of rows each, in insertion order: token ids (uint16 when every id is
  below 65536, else int32, byte planes shuffled), logprobs fixed-point (int32, shuffled),
  message JSON, trace and episode records; a row keeps (chunk, offset) into its chunk
  table;
- ``chunked-zstd-L+ref``: as above, and a message's ``content`` left out when it is
  exactly the decode of the node's tokens between two offsets (kept instead), which
  needs the run's tokenizer (``--tokenizer``; only for the realistic workload).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import zstandard

from tracedb.storage import breakdown

CHUNK_BYTES = 1 << 20
_REFS: dict[str, Any] = {}
FIXED_SCALE = 10_000


def _q(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


SCHEMA6 = Path(__file__).with_name("schema6_tables.sql")
"""The layout these experiments start from and vary: schema 6's (nodes and segments as
plain tables of lists), whatever the source file's schema; a schema-7 source is read
through its views ``nodes`` and ``segments``."""


def source_tables(con: duckdb.DuckDBPyConnection, catalog: str = "src") -> list[str]:
    """The source's tables as schema 6 names them (a schema-7 file's views for the two it
    keeps encoded)."""
    rows = con.execute(
        "SELECT table_name FROM duckdb_tables() WHERE database_name = ? UNION ALL "
        "SELECT view_name FROM duckdb_views() WHERE database_name = ? AND NOT internal",
        [catalog, catalog],
    ).fetchall()
    return [r[0] for r in rows if r[0] not in ("node_store", "segment_store")]


def _order(table: str) -> str:
    """Row order of a source table: its rowid, or (a view has none) its plain scan, which
    keeps insertion order too."""
    return "" if table in ("nodes", "segments") else " ORDER BY rowid"


def _ddl(no_pk: bool = False, zstd_strings: bool = False, fixed: bool = False) -> str:
    sql = re.sub(r"--[^\n]*", "", SCHEMA6.read_text())
    if no_pk:
        sql = re.sub(r",\s*PRIMARY KEY \([^)]*\)", "", sql)
        sql = sql.replace(" PRIMARY KEY", "")
    if zstd_strings:
        sql = re.sub(r"\b(JSON)( NOT NULL)?", r"\1 USING COMPRESSION zstd\2", sql)
    if fixed:
        sql = sql.replace("logprobs           FLOAT[]", "logprobs           INTEGER[]")
    return sql


def _attach(con: duckdb.DuckDBPyConnection, path: Path, block: int | None) -> None:
    for p in (path, Path(str(path) + ".wal")):
        p.unlink(missing_ok=True)
    opt = f" (BLOCK_SIZE {block})" if block else ""
    con.execute(f"ATTACH {_q(str(path))} AS dst{opt}")


def _finish(con: duckdb.DuckDBPyConnection, path: Path) -> dict[str, Any]:
    con.execute("USE dst")
    con.execute("CHECKPOINT dst")
    out = breakdown(con, str(path))
    con.execute("USE memory")
    con.execute("DETACH dst")
    return out


def copy_candidate(src: Path, path: Path, *, block: int | None = None, **ddl: bool) -> dict[str, Any]:
    con = duckdb.connect()
    con.execute(f"ATTACH {_q(str(src))} AS src (READ_ONLY)")
    _attach(con, path, block)
    con.execute("USE dst")
    con.execute(_ddl(**ddl))
    tables = source_tables(con)
    for t in tables:
        if ddl.get("fixed") and t == "nodes":
            cols = [
                r[0]
                for r in con.execute(
                    "SELECT column_name FROM duckdb_columns() WHERE database_name='src' "
                    "AND table_name='nodes' ORDER BY column_index"
                ).fetchall()
            ]
            sel = ", ".join(
                f"list_transform(logprobs, lambda x: CAST(round(CAST(x AS DOUBLE) * {FIXED_SCALE}) AS INTEGER))"
                if c == "logprobs"
                else f'"{c}"'
                for c in cols
            )
            con.execute(f"INSERT INTO dst.nodes SELECT {sel} FROM src.nodes")
        else:
            con.execute(f'INSERT INTO dst."{t}" SELECT * FROM src."{t}"{_order(t)}')
    return _finish(con, path)


# --------------------------------------------------------------------------- chunked zstd


def _shuffle(raw: bytes, width: int) -> bytes:
    return np.frombuffer(raw, np.uint8).reshape(-1, width).T.tobytes() if width > 1 else raw


def _unshuffle(raw: bytes, width: int) -> bytes:
    return np.frombuffer(raw, np.uint8).reshape(width, -1).T.tobytes() if width > 1 else raw


def chunk_rows(sizes: np.ndarray, target: int | None = None) -> np.ndarray:
    """A chunk number per row: rows in order, a new chunk once ``target`` bytes are in one."""
    target = target or CHUNK_BYTES
    chunk = np.zeros(len(sizes), np.int32)
    acc, c = 0, 0
    for i, s in enumerate(sizes):
        chunk[i] = c
        acc += int(s)
        if acc >= target:
            c, acc = c + 1, 0
    return chunk


def compress_lists(
    values: np.ndarray, offsets: np.ndarray, width: int, level: int
) -> tuple[pa.Table, np.ndarray, np.ndarray]:
    """Flat values cut by row ``offsets`` into ~1 MiB chunks: the chunk table (chunk, width,
    n, data) and each row's (chunk, offset in the chunk's values)."""
    dtype = {2: np.uint16, 4: np.int32}[width]
    sizes = np.diff(offsets) * width
    chunk = chunk_rows(sizes)
    starts = np.flatnonzero(np.r_[True, chunk[1:] != chunk[:-1]]) if len(chunk) else np.zeros(0, np.int64)
    bounds = np.r_[offsets[starts], offsets[-1]] if len(chunk) else np.zeros(1, np.int64)
    cctx = zstandard.ZstdCompressor(level=level)
    data = [
        cctx.compress(_shuffle(values[a:b].astype(dtype).tobytes(), width)) for a, b in zip(bounds[:-1], bounds[1:])
    ]
    row_offset = offsets[:-1] - bounds[chunk] if len(chunk) else np.zeros(0, np.int64)
    table = pa.table(
        {
            "chunk": pa.array(np.arange(len(data), dtype=np.int32)),
            "width": pa.array(np.full(len(data), width, np.int8)),
            "n": pa.array(np.diff(bounds).astype(np.int32)),
            "data": pa.array(data, pa.binary()),
        }
    )
    return table, chunk, row_offset.astype(np.int32)


def decompress_lists(table: pa.Table) -> np.ndarray:
    dctx = zstandard.ZstdDecompressor()
    out = []
    for width, blob in zip(table["width"].to_pylist(), table["data"].to_pylist(), strict=True):
        raw = _unshuffle(dctx.decompress(blob), width)
        out.append(np.frombuffer(raw, {2: np.uint16, 4: np.int32}[width]).astype(np.int32))
    return np.concatenate(out) if out else np.zeros(0, np.int32)


def compress_strings(texts: list[bytes], level: int) -> tuple[pa.Table, np.ndarray, np.ndarray]:
    sizes = np.array([len(t) for t in texts], np.int64)
    chunk = chunk_rows(sizes)
    cctx = zstandard.ZstdCompressor(level=level)
    data, offset, cur, pos, last = [], np.zeros(len(texts), np.int32), [], 0, 0
    for i, t in enumerate(texts):
        if chunk[i] != last:
            data.append(cctx.compress(b"".join(cur)))
            cur, pos, last = [], 0, chunk[i]
        offset[i] = pos
        cur.append(t)
        pos += len(t)
    if cur:
        data.append(cctx.compress(b"".join(cur)))
    table = pa.table({"chunk": pa.array(np.arange(len(data), dtype=np.int32)), "data": pa.array(data, pa.binary())})
    return table, chunk, offset


def _lists(arr: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    a = arr.combine_chunks()
    return a.values.to_numpy(zero_copy_only=False), a.offsets.to_numpy().astype(np.int64)


def _span_of(content: str, ids: np.ndarray, tokenizer: Any) -> tuple[int, int] | None:
    """``(a, b)`` with ``decode(ids[a:b]) == content`` (``a`` within the template's head),
    found by a binary search on the decoded length; None when there is none."""
    n = len(ids)
    for a in range(min(8, n)):
        lo, hi = a + 1, n
        while lo < hi:
            mid = (lo + hi) // 2
            if len(tokenizer.decode(ids[a:mid].tolist(), skip_special_tokens=False)) < len(content):
                lo = mid + 1
            else:
                hi = mid
        if lo <= n and tokenizer.decode(ids[a:lo].tolist(), skip_special_tokens=False) == content:
            return a, lo
    return None


def _content_refs(nodes: pa.Table, tokens_of: dict[bytes, np.ndarray], tokenizer: Any) -> tuple[list[bytes], int]:
    """Each message JSON without ``content`` when the content is the decode of a span of
    the node's tokens (the span kept as ``[start, end]`` under ``"~content"``)."""
    out, hits = [], 0
    for seg, text in zip(nodes["segment_id"].to_pylist(), nodes["message"].to_pylist(), strict=True):
        if text is None:
            out.append(b"")
            continue
        message = json.loads(text)
        content = message.get("content") if isinstance(message, dict) else None
        span = _span_of(content, tokens_of[seg], tokenizer) if isinstance(content, str) and content else None
        if span is not None:
            message = {k: v for k, v in message.items() if k != "content"}
            message["~content"] = list(span)
            hits += 1
            out.append(json.dumps(message, separators=(",", ":")).encode())
        else:
            out.append(text.encode())
    return out, hits


def chunked_candidate(
    src: Path, path: Path, level: int, tokenizer: Any = None, block: int | None = 65_536, chunk: int = 1 << 20
) -> tuple[dict[str, Any], dict[str, float], dict[str, Any]]:
    """The chunked-zstd layout; returns the breakdown, encode seconds, facts."""
    global CHUNK_BYTES
    CHUNK_BYTES = chunk
    con = duckdb.connect()
    con.execute(f"ATTACH {_q(str(src))} AS src (READ_ONLY)")
    seg = con.execute("SELECT * FROM src.segments").to_arrow_table()
    nodes = con.execute("SELECT * FROM src.nodes").to_arrow_table()
    traces = con.execute("SELECT * FROM src.traces ORDER BY rowid").to_arrow_table()
    episodes = con.execute("SELECT * FROM src.episodes ORDER BY rowid").to_arrow_table()
    seconds: dict[str, float] = {}
    facts: dict[str, Any] = {}

    def timed(name: str, fn: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        out = fn()
        seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - start
        return out

    tok, tok_off = _lists(seg["token_ids"])
    width = 2 if tok.size and tok.max() < 65536 and tok.min() >= 0 else 4
    tok_chunks, tok_chunk, tok_pos = timed("token_ids", lambda: compress_lists(tok, tok_off, width, level))
    lp, lp_off = _lists(nodes["logprobs"])
    fixed = np.round(lp.astype(np.float64) * FIXED_SCALE)
    if not np.array_equal((fixed / FIXED_SCALE).astype(np.float32), lp):
        raise ValueError("a logprob is not a 4-decimal number: the fixed-point candidate would not be exact")
    lp_chunks, lp_chunk, lp_pos = timed("logprobs", lambda: compress_lists(fixed.astype(np.int64), lp_off, 4, level))
    messages = [b"" if m is None else m.encode() for m in nodes["message"].to_pylist()]
    if tokenizer is not None:
        tokens_of = {s: tok[a:b] for s, a, b in zip(seg["segment_id"].to_pylist(), tok_off[:-1], tok_off[1:])}
        key = str(src)
        if key not in _REFS:  # the same rows every time: computed once per source
            _REFS[key] = timed("content refs", lambda: _content_refs(nodes, tokens_of, tokenizer))
        messages, hits = _REFS[key]
        facts["contents_by_reference"] = hits
        facts["contents"] = sum(1 for m in nodes["message"].to_pylist() if m and '"content":"' in m)
    msg_chunks, msg_chunk, msg_pos = timed("message", lambda: compress_strings(messages, level))
    rec = {}
    for name, t in (("traces", traces), ("episodes", episodes)):
        rec[name] = timed("records", lambda t=t: compress_strings([r.encode() for r in t["record"].to_pylist()], level))

    _attach(con, path, block)
    con.execute("USE dst")
    con.execute(_ddl(no_pk=True))
    segments_new = pa.table(
        {
            "segment_id": seg["segment_id"],
            "n_tokens": seg["n_tokens"],
            "chunk": pa.array(tok_chunk),
            "offset": pa.array(tok_pos),
        }
    )
    nodes_new = nodes.drop_columns(["logprobs", "message"]).append_column("lp_chunk", pa.array(lp_chunk))
    nodes_new = nodes_new.append_column("lp_offset", pa.array(lp_pos))
    nodes_new = nodes_new.append_column("msg_chunk", pa.array(msg_chunk)).append_column("msg_offset", pa.array(msg_pos))
    nodes_new = nodes_new.append_column("msg_len", pa.array([len(m) for m in messages], pa.int32()))
    con.execute("DROP TABLE segments")
    con.execute("DROP TABLE nodes")
    con.execute("DROP TABLE traces")
    con.execute("DROP TABLE episodes")
    for name, table in (
        ("segments", segments_new),
        ("token_chunks", tok_chunks),
        ("nodes", nodes_new),
        ("stream_chunks", lp_chunks),
        ("message_chunks", msg_chunks),
        ("record_chunks_traces", rec["traces"][0]),
        ("record_chunks_episodes", rec["episodes"][0]),
    ):
        con.register("_t", table)
        con.execute(f'CREATE TABLE "{name}" AS SELECT * FROM _t')
        con.unregister("_t")
    for name, t in (("traces", traces), ("episodes", episodes)):
        _, ch, off = rec[name]
        con.register(
            "_t",
            t.drop_columns(["record"])
            .append_column("rec_chunk", pa.array(ch))
            .append_column("rec_offset", pa.array(off)),
        )
        con.execute(f'CREATE TABLE "{name}" AS SELECT * FROM _t')
        con.unregister("_t")
    for t in (
        "branches",
        "trace_tags",
        "tracedb_meta",
        "rejects",
        "credit_sets",
        "credit",
        "trace_credit",
        "follow_positions",
    ):
        con.execute(f'INSERT INTO "{t}" SELECT * FROM src."{t}"')
    facts["token_width"] = width
    facts["chunks"] = {"tokens": tok_chunks.num_rows, "logprobs": lp_chunks.num_rows, "messages": msg_chunks.num_rows}
    return _finish(con, path), seconds, facts


# --------------------------------------------------------------------------- decoding


def _best(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    times, out = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def decode_today(path: Path, repeat: int) -> dict[str, Any]:
    con = duckdb.connect(str(path), read_only=True)

    def view() -> tuple[np.ndarray, np.ndarray]:
        t = _lists(con.execute("SELECT token_ids FROM segments").to_arrow_table()["token_ids"])[0]
        lp = _lists(con.execute("SELECT logprobs FROM nodes").to_arrow_table()["logprobs"])[0]
        return t, lp

    view_s, (tok, lp) = _best(view, repeat)
    msgs_s, _ = _best(lambda: con.execute("SELECT message FROM nodes").to_arrow_table(), repeat)
    ids = [r[0] for r in con.execute("SELECT trace_id FROM traces ORDER BY seq LIMIT 20").fetchall()]
    one_s, _ = _best(
        lambda: [con.execute("SELECT message FROM nodes WHERE trace_id = ?", [i]).fetchall() for i in ids], repeat
    )
    con.close()
    return {
        "view_s": view_s,
        "view_bytes": tok.nbytes + lp.nbytes,
        "messages_s": msgs_s,
        "one_trace_messages_s": one_s / 20,
    }


def decode_chunked(path: Path, src: Path, repeat: int) -> dict[str, Any]:
    con = duckdb.connect(str(path), read_only=True)

    def view() -> tuple[np.ndarray, np.ndarray]:
        tok = decompress_lists(con.execute("SELECT width, data FROM token_chunks ORDER BY chunk").to_arrow_table())
        lp = decompress_lists(con.execute("SELECT width, data FROM stream_chunks ORDER BY chunk").to_arrow_table())
        return tok, (lp / FIXED_SCALE).astype(np.float32)

    view_s, (tok, lp) = _best(view, repeat)
    dctx = zstandard.ZstdDecompressor()

    def messages() -> list[bytes]:
        blobs = con.execute("SELECT data FROM message_chunks ORDER BY chunk").to_arrow_table()["data"].to_pylist()
        return [dctx.decompress(b) for b in blobs]

    msgs_s, _ = _best(messages, repeat)
    ids = [r[0] for r in con.execute("SELECT trace_id FROM traces ORDER BY seq LIMIT 20").fetchall()]

    def one(tid: str) -> list[bytes]:
        rows = con.execute(
            "SELECT n.msg_chunk, n.msg_offset, n.msg_len, c.data FROM nodes n JOIN message_chunks c "
            "ON c.chunk = n.msg_chunk WHERE n.trace_id = ? ORDER BY n.node_index",
            [tid],
        ).fetchall()
        cache: dict[int, bytes] = {}
        out = []
        for ch, off, n, data in rows:
            if ch not in cache:
                cache[ch] = dctx.decompress(data)
            out.append(cache[ch][off : off + n])
        return out

    one_s, _ = _best(lambda: [one(i) for i in ids], repeat)
    con.close()
    # exactness: the decoded columns equal the source's
    s = duckdb.connect(str(src), read_only=True)
    want_tok = _lists(s.sql("SELECT token_ids FROM segments").to_arrow_table()["token_ids"])[0]
    want_lp = _lists(s.sql("SELECT logprobs FROM nodes").to_arrow_table()["logprobs"])[0]
    s.close()
    exact = bool(np.array_equal(tok, want_tok) and np.array_equal(lp, want_lp))
    out_bytes = tok.nbytes + lp.nbytes
    return {
        "view_s": view_s,
        "view_bytes": out_bytes,
        "view_GB_per_s": round(out_bytes / 1e9 / view_s, 2),
        "messages_s": msgs_s,
        "one_trace_messages_s": one_s / 20,
        "exact": exact,
    }


def run_round2(src: Path, out: Path, repeat: int, tokenizer: Any, log: Callable[[str], None]) -> dict[str, Any]:
    """The second round: the DuckDB-native combination, and the chunked layout over block
    and chunk sizes and zstd levels (16 KiB blocks turned out to leave integers and lists
    uncompressed in DuckDB 2.0.1, so 64 KiB and 256 KiB here)."""
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"source": str(src), "source_bytes": src.stat().st_size, "candidates": {}}
    log("encodings: duckdb-native (no-pk, 64 KiB blocks, zstd strings, fixed-point streams)")
    b = copy_candidate(src, out / "native.duckdb", block=65_536, no_pk=True, zstd_strings=True, fixed=True)
    results["candidates"]["native: no-pk+block-64k+zstd-strings+fixed-streams"] = {
        "breakdown": b,
        "bytes": b["file_bytes"],
    }
    b = copy_candidate(src, out / "native256.duckdb", no_pk=True, zstd_strings=True, fixed=True)
    results["candidates"]["native: no-pk+zstd-strings+fixed-streams"] = {"breakdown": b, "bytes": b["file_bytes"]}
    for block in (65_536, None):
        for chunk in (1 << 20, 8 << 20):
            for level in (3, 9):
                for ref in (False, True) if tokenizer is not None else (False,):
                    name = f"chunked-zstd-{level} chunk {chunk >> 20}MiB block {block >> 10 if block else 256}k" + (
                        "+ref" if ref else ""
                    )
                    log(f"encodings: {name}")
                    b, seconds, facts = chunked_candidate(
                        src, out / "c.duckdb", level, tokenizer if ref else None, block=block, chunk=chunk
                    )
                    results["candidates"][name] = {
                        "breakdown": b,
                        "bytes": b["file_bytes"],
                        "encode_s": seconds,
                        "facts": facts,
                        "decode": decode_chunked(out / "c.duckdb", src, repeat),
                    }
    for c in results["candidates"].values():
        c["tables"] = {t["table"]: t["bytes"] for t in c["breakdown"]["tables"] if t["bytes"]}
        c["overheads"] = {k: c["breakdown"][k] for k in ("index_bytes", "metadata_bytes", "free_bytes", "header_bytes")}
    return results


def run(src: Path, out: Path, repeat: int, tokenizer: Any, log: Callable[[str], None]) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"source": str(src), "source_bytes": src.stat().st_size, "candidates": {}}
    plain = {
        "copy": {},
        "block-64k": {"block": 65_536},
        "block-16k": {"block": 16_384},
        "no-pk": {"no_pk": True},
        "no-pk+block-16k": {"no_pk": True, "block": 16_384},
        "zstd-strings": {"zstd_strings": True},
        "fixed-streams": {"fixed": True},
    }
    for name, kw in plain.items():
        log(f"encodings: {name}")
        start = time.perf_counter()
        b = copy_candidate(src, out / f"{name}.duckdb", **kw)
        results["candidates"][name] = {"breakdown": b, "bytes": b["file_bytes"], "write_s": time.perf_counter() - start}
    results["decode_today"] = decode_today(src, repeat)
    for level in (3, 19):
        for ref in (False, True) if tokenizer is not None else (False,):
            name = f"chunked-zstd-{level}" + ("+ref" if ref else "")
            log(f"encodings: {name}")
            b, seconds, facts = chunked_candidate(
                src, out / f"{name}.duckdb", level, tokenizer if ref else None, block=16_384
            )
            results["candidates"][name] = {
                "breakdown": b,
                "bytes": b["file_bytes"],
                "encode_s": seconds,
                "facts": facts,
                "decode": decode_chunked(out / f"{name}.duckdb", src, repeat),
            }
    for c in results["candidates"].values():
        c["tables"] = {t["table"]: t["bytes"] for t in c["breakdown"]["tables"] if t["bytes"]}
        c["overheads"] = {k: c["breakdown"][k] for k in ("index_bytes", "metadata_bytes", "free_bytes", "header_bytes")}
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.encodings", description=__doc__.split("\n\n")[0])
    p.add_argument("db", type=Path, help="a tracedb file (today's encodings)")
    p.add_argument("--out", type=Path, required=True, help="directory for the candidate files and results.json")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--tokenizer", type=Path, help="the run's tokenizer.json (for the content-by-reference candidate)")
    p.add_argument("--round", type=int, choices=[1, 2], default=1, help="1: each encoding alone; 2: combinations")
    args = p.parse_args(argv)
    tok = None
    if args.tokenizer:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(args.tokenizer))
    runner = run if args.round == 1 else run_round2
    results = runner(args.db, args.out, args.repeat, tok, log=lambda m: print(m, file=sys.stderr, flush=True))
    if args.round == 2:
        results["decode_today"] = decode_today(args.db, args.repeat)
    (args.out / f"results-round{args.round}.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    for name, c in results["candidates"].items():
        extra = ""
        if "decode" in c:
            d = c["decode"]
            extra = (
                f" view {d['view_s'] * 1e3:.0f} ms ({d['view_GB_per_s']} GB/s) exact {d['exact']} encode "
                + ", ".join(f"{k} {v:.2f}s" for k, v in c["encode_s"].items())
            )
        tables = json.dumps({k: round(v / 1e6, 2) for k, v in c["tables"].items()})
        overheads = json.dumps({k: round(v / 1e6, 2) for k, v in c["overheads"].items()})
        print(f"{name:<24} {c['bytes'] / 1e6:8.2f} MB  {tables} overheads {overheads}{extra}")
    print("today's decode:", json.dumps(results["decode_today"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
