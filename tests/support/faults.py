"""Helpers of the fault tests (``tests/faults/``): a child process that runs one tracedb
operation and can be killed at any moment (or stopped at a marker it prints), snapshots
of what a database file holds (to compare before, after and uninterrupted), and the
verdict on an input line (what ingest must do with it, decided without tracedb).

The child is ``python -c BOOT SPEC``: it imports :func:`child_main` from here, which
enters the settings of the spec (a child does not have the tests' ``scanner="always"``),
loads what the operation compiles on a throwaway database, wraps what tracedb opens so
that every ``ATTACH`` prints a marker before it and every ``COMMIT`` one before and one
after it (and ``os.replace``, for exports), prints ``READY``, waits for the parent's
``GO`` on stdin (so a child can start while the parent checks the previous one), runs
the operation (open, work, close) and prints ``DONE``. A spec's ``stall`` names one
marker (``before-commit:2``: the second COMMIT): there the child stops and waits to be
killed. No library code is edited for any of it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pydantic

from tracedb.ingest.rejects import storable_text
from tracedb.records import COMPACT_STREAMS, Episode, Trace

TESTS = Path(__file__).resolve().parents[1]
CLOCK_COLUMNS = frozenset({"ingested_at", "rejected_at", "created_at"})
"""Columns that hold the time of a write: never equal between two runs."""
BOOT = "import sys; sys.path.insert(0, sys.argv[1]); from support.faults import child_main; child_main(sys.argv[2])"
STALL_SECONDS = 60.0
"""How long a stalled child waits to be killed before it gives up (exit 3)."""


def base_seed() -> int:
    """The seed of the fault tests: ``TRACEDB_FAULT_SEED`` or a fixed default (every test
    prints the seed it derived from it, so a failure reproduces)."""
    return int(os.environ.get("TRACEDB_FAULT_SEED", "20251201"))


# --------------------------------------------------------------------------- the child side


class _Marks:
    """Prints ``MARK kind:n`` at each hooked point; stalls at the one the spec names."""

    def __init__(self, stall: str | None) -> None:
        self.stall = stall
        self.counts: dict[str, int] = {}

    def __call__(self, kind: str) -> None:
        n = self.counts[kind] = self.counts.get(kind, 0) + 1
        name = f"{kind}:{n}"
        _say(f"MARK {name}")
        if name == self.stall:
            _say("STALLED")
            time.sleep(STALL_SECONDS)
            os._exit(3)  # nobody killed it: the parent sees the exit code


class _Con:
    """A DuckDB connection that reports its COMMITs (everything else is passed through)."""

    def __init__(self, con: Any, marks: _Marks) -> None:
        object.__setattr__(self, "_con", con)
        object.__setattr__(self, "_marks", marks)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._con, name)

    def execute(self, query: Any, *args: Any, **kwargs: Any) -> Any:
        commit = isinstance(query, str) and query.strip().upper() == "COMMIT"
        if commit:
            self._marks("before-commit")
        result = self._con.execute(query, *args, **kwargs)
        if commit:
            self._marks("after-commit")
        return result


def _say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _install_marks(marks: _Marks) -> None:
    from tracedb import runtime

    attach = runtime.attach

    def marked_attach(path: str, *, read_only: bool, **options: Any) -> Any:
        marks("attach")
        con, catalog, fresh, shared, release = attach(path, read_only=read_only, **options)
        return _Con(con, marks), catalog, fresh, shared, release

    runtime.attach = marked_attach
    replace = os.replace

    def marked_replace(src: Any, dst: Any) -> None:
        marks("before-replace")
        replace(src, dst)
        marks("after-replace")

    os.replace = marked_replace  # the child runs one export; nothing else of it renames files


def node_rows(db: Any) -> list[dict[str, Any]]:
    """``(trace_id, node_index, values)`` for every node with sampled tokens, values a
    function of the key alone (the same rows in every run)."""
    rows = db.sql("SELECT trace_id, node_index, n_sampled FROM nodes WHERE n_sampled > 0 ORDER BY 1, 2").to_pylist()
    return [
        {
            "trace_id": r["trace_id"],
            "node_index": r["node_index"],
            "values": [((r["node_index"] + 1) * 37 + j * 11) % 1000 / 1000 for j in range(r["n_sampled"])],
        }
        for r in rows
    ]


def run_operation(db: Any, spec: dict[str, Any]) -> Any:
    """The operation of a spec on an open database (the child runs it; a test runs it
    again in-process to finish what a kill left)."""
    op = spec["op"]
    if op == "ingest":
        report = db.ingest(spec["paths"])
        return {"traces": report.traces, "skipped": report.skipped, "rejected": len(report.rejected)}
    if op == "credit":
        import tracedb.credit

        return tracedb.credit.run(db, spec["algorithm"], spec["name"], replace=True, **spec.get("params", {}))
    if op == "export":
        return db.export(spec["export"])
    if op == "write_nodes":
        return db.write_nodes(node_rows(db), stream=spec.get("stream", "advantages"), credit=spec.get("credit"))
    raise ValueError(f"unknown operation {op!r}")


def _warm(spec: dict[str, Any]) -> None:
    """Load what the operation loads on first use (the compiled scanner or the view
    kernels, the credit modules, Parquet) on a throwaway database, so that the window the
    parent kills in is the operation's own work, and no more than that is loaded."""
    import tracedb
    import tracedb.credit
    from tracedb import runtime

    op = spec["op"]
    with runtime.configure(scanner="always" if op == "ingest" else "never"), tracedb.connect(":memory:") as db:
        db.ingest(spec["warm"])
        if op == "credit":
            tracedb.credit.compute(db, spec["algorithm"])
        elif op == "export":
            import pyarrow.parquet  # noqa: F401

            db.branches()
        elif op == "write_nodes":
            run_operation(db, spec)


def child_main(text: str) -> None:
    """The child: settings, marks, ``READY``, open + operation + close, ``DONE``."""
    spec = json.loads(text)
    import tracedb
    from tracedb import runtime

    marks = _Marks(spec.get("stall"))
    with runtime.configure(**spec.get("settings", {})):
        _warm(spec)
        _install_marks(marks)
        _say("READY")
        sys.stdin.readline()  # the parent's GO: the operation's window starts here
        db = tracedb.connect(spec["db"], read_only=spec["op"] == "export")
        result = run_operation(db, spec)
        db.close()
        _say("DONE " + json.dumps(result, default=str))


# --------------------------------------------------------------------------- the parent side


class Child:
    """One child process running a spec; its stdout lines are read by a thread (so every
    wait has a timeout), its stderr goes to a file. Use as a context manager: it is
    killed and reaped on the way out whatever happened."""

    def __init__(self, spec: dict[str, Any], workdir: Path, argv: list[str] | None = None) -> None:
        """``argv`` (default: :func:`child_main` on ``spec``) run in ``workdir``."""
        self.spec = spec
        self.stderr_path = workdir / f"child-{time.monotonic_ns()}.stderr"
        self._stderr: IO[bytes] = open(self.stderr_path, "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            argv or [sys.executable, "-c", BOOT, str(TESTS), json.dumps(spec)],
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            stdin=subprocess.PIPE,
            text=True,
            cwd=workdir,
        )
        self.lines: queue.Queue[tuple[float, str | None]] = queue.Queue()
        self.seen: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put((time.monotonic(), line.rstrip("\n")))
        self.lines.put((time.monotonic(), None))

    def expect(self, prefix: str, timeout: float = 60.0) -> tuple[float, str]:
        """Wait for the first line starting with ``prefix``; (when it came, the line)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"the child did not print {prefix!r} within {timeout} s; {self.describe()}")
            try:
                at, line = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                self.proc.wait(timeout=30)
                raise AssertionError(f"the child ended before {prefix!r}; {self.describe()}")
            self.seen.append(line)
            if line.startswith(prefix):
                return at, line

    def send(self, text: str) -> None:
        """One line to the child's stdin."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def go(self) -> float:
        """Wait for READY (imports done), then let the operation start; when it started."""
        self.expect("READY")
        self.send("GO")
        return time.monotonic()

    def kill(self) -> int:
        """SIGKILL (if it still runs) and reap; the exit code (-9 when the kill landed)."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        return self.proc.wait(timeout=30)

    def describe(self) -> str:
        self._stderr.flush()
        err = self.stderr_path.read_text(errors="replace")[-3000:]
        return f"spec {self.spec}, exit {self.proc.poll()}, stdout {self.seen[-8:]}, stderr:\n{err}"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.kill()
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        self._reader.join(timeout=10)
        self._stderr.close()

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- what a file holds


def table_names(db: Any) -> list[str]:
    rows = db.sql(
        "SELECT table_name FROM duckdb_tables() WHERE database_name = current_database() "
        "AND schema_name = current_schema() ORDER BY 1"
    ).column("table_name")
    return rows.to_pylist()


def contents(db: Any) -> dict[str, list[str]]:
    """Every row of every table (a digest of its text per row, sorted: order-independent),
    the clock columns left out."""
    out = {}
    for name in table_names(db):
        columns = ", ".join(f'"{c}"' for c in db.handle.columns(name) if c not in CLOCK_COLUMNS)
        query = f'SELECT md5(CAST(ROW({columns}) AS VARCHAR)) AS h FROM "{name}" ORDER BY h'
        out[name] = db.sql(query).column("h").to_pylist()
    return out


def branch_digest(db: Any, credit: str | None = None) -> str:
    """A checksum of ``db.branches()`` (every column, by value)."""
    table = db.branches(credit=credit)
    h = hashlib.sha256()
    for name in table.column_names:
        h.update(name.encode())
        _digest_array(h, table.column(name).combine_chunks())
    return h.hexdigest()


def _digest_array(h: Any, arr: pa.Array) -> None:
    """Values, nulls and list lengths into ``h``; numbers by their bytes."""
    h.update(str(arr.type).encode())
    h.update(np.asarray(arr.is_null()).tobytes())
    if pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type):
        h.update(np.asarray(pc.fill_null(pc.list_value_length(arr), -1)).tobytes())
        _digest_array(h, pc.list_flatten(arr))
    elif pa.types.is_integer(arr.type) or pa.types.is_floating(arr.type) or pa.types.is_boolean(arr.type):
        h.update(np.asarray(pc.fill_null(arr, False if pa.types.is_boolean(arr.type) else 0)).tobytes())
    else:  # strings, maps: few values
        h.update(repr(arr.to_pylist()).encode())


def differing(a: dict[str, list[str]], b: dict[str, list[str]]) -> list[str]:
    """The tables whose rows differ between two :func:`contents`."""
    return sorted(t for t in set(a) | set(b) if a.get(t) != b.get(t))


# --------------------------------------------------------------------------- what a line must come to


@dataclass(frozen=True)
class Verdict:
    accepted: bool
    field: str | None = None
    node: int | None = None
    traces: tuple[str, ...] = ()
    """An accepted line's trace ids (each once, as ingest keeps them)."""


def _fits_f32(x: float) -> bool:
    with np.errstate(over="ignore"):
        return bool(np.isfinite(np.float32(np.float64(x))))


def _lone(value: Any) -> bool:
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _layout(i: int, n: dict[str, Any]) -> str | None:
    """The field of the first layout rule node ``i`` breaks (``check_trace``'s order)."""
    size, mask = len(n.get("token_ids", [])), n.get("mask", [])
    k = sum(mask)
    if len(mask) != size:
        return "mask"
    if n.get("is_content") and len(n["is_content"]) != size:
        return "is_content"
    for name in COMPACT_STREAMS:
        if n.get(name) and len(n[name]) != k:
            return name
    for name, weights in (n.get("loss_weights") or {}).items():
        if len(weights) != size:
            return f"loss_weights.{name}"
    if n.get("parent") is not None and n["parent"] >= i:
        return "parent"
    if any(link["node"] >= i for link in n.get("semantic_parents", [])):
        return "semantic_parents"
    return None


def verdict(raw: bytes, limit: int) -> Verdict:
    """What ingest must do with one line (``max_line_bytes`` = ``limit``), decided without
    tracedb: Python's ``json`` and the verifiers model (:mod:`tracedb.records`), then the
    rules tracedb adds to the model (``tracedb/ingest/parse.py``), in the order it checks
    them: values the stored types cannot hold (int32 token ids, float32 stream values),
    lone surrogates anywhere, the layout rules of ``check_trace``. The field is named as
    ingest names it (the model's error location below the trace and node)."""
    if len(raw) > limit:
        return Verdict(False)
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return Verdict(False)
    if not isinstance(value, dict):
        return Verdict(False)
    bare = "nodes" in value and "traces" not in value
    try:
        (Trace if bare else Episode).model_validate(value)
    except pydantic.ValidationError as e:
        loc, node = list(e.errors()[0]["loc"]), None
        loc = ["traces", 0, *loc] if bare else loc
        if len(loc) >= 2 and loc[0] == "traces" and isinstance(loc[1], int):
            loc = loc[2:]
            if len(loc) >= 2 and loc[0] == "nodes" and isinstance(loc[1], int):
                node, loc = loc[1], loc[2:]
        return Verdict(False, ".".join(map(str, loc)) or None, node)
    traces = [value] if bare else value.get("traces", [])
    for t in traces:  # values the stored types cannot hold
        for i, n in enumerate(t.get("nodes", [])):
            if any(not -(2**31) <= x < 2**31 for x in n.get("token_ids", [])):
                return Verdict(False, "token_ids", i)
            streams = [(s, n.get(s)) for s in COMPACT_STREAMS]
            streams += [(f"loss_weights.{w}", v) for w, v in (n.get("loss_weights") or {}).items()]
            for name, values in streams:
                for k, x in enumerate(values or []):
                    if not _fits_f32(x):
                        return Verdict(False, f"{name}.{k}", i)
    scopes = [] if bare else [(None, {k: v for k, v in value.items() if k != "traces"})]
    for t in traces:
        scopes.append((None, {k: v for k, v in t.items() if k != "nodes"}))
        scopes += list(enumerate(t.get("nodes", [])))
    for node, obj in scopes:  # lone surrogates, in ingest's order
        for key, v in obj.items():
            if _lone(key) or _lone(v):
                return Verdict(False, storable_text(key), node)
    for t in traces:
        for i, n in enumerate(t.get("nodes", [])):
            if (field := _layout(i, n)) is not None:
                return Verdict(False, field, i)
    return Verdict(True, traces=tuple(dict.fromkeys(t["id"] for t in traces)))
