"""What every tracedb command shares: the --db and --json options, opening the database,
and printing results (JSON for scripts, a table for people)."""

from __future__ import annotations

import importlib.abc
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from tracedb.errors import TraceDBError

if TYPE_CHECKING:  # the library is imported by the commands that use it: the CLI starts without it
    from tracedb.database import Database

out = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)

DbOption = Annotated[
    Path, typer.Option("--db", envvar="TRACEDB_DB", help="Database file (created if missing); env TRACEDB_DB.")
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON for scripts instead of a table.")]
MemoryLimitOption = Annotated[
    str | None,
    typer.Option(
        "--memory-limit",
        envvar="TRACEDB_MEMORY_LIMIT",
        help="Cap DuckDB's memory (e.g. 512MB, 4GiB; 'none': 80% of RAM). Default 1GiB; env TRACEDB_MEMORY_LIMIT.",
    ),
]


class _WithoutPandas(importlib.abc.MetaPathFinder):
    """An import of pandas fails: see :func:`hide_pandas`."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "pandas" or name.startswith("pandas."):
            raise ModuleNotFoundError(f"{name} is not imported by the tracedb command", name=name)
        return None


_WITHOUT_PANDAS = _WithoutPandas()


def hide_pandas() -> None:
    """Make pandas look not installed in this process (the ``tracedb`` command's own).

    Where pandas is installed, pyarrow imports it the first time it converts Python or
    numpy values (to ask whether they are pandas objects), and the import takes ~0.25 s:
    a third of a small ingest's process. No command but the lake's (Ray Data, see
    :func:`show_pandas`) uses pandas, so the command hides it; pyarrow then converts
    without asking. The library never does this: a user's process keeps its pandas."""
    if "pandas" not in sys.modules and _WITHOUT_PANDAS not in sys.meta_path:
        sys.meta_path.insert(0, _WITHOUT_PANDAS)


def show_pandas() -> None:
    """Undo :func:`hide_pandas` (a command that needs pandas)."""
    if _WITHOUT_PANDAS in sys.meta_path:
        sys.meta_path.remove(_WITHOUT_PANDAS)


def memory_limit(value: str | None) -> None:
    """Apply ``--memory-limit`` (exit 2 on a size DuckDB cannot read)."""
    if value is None:
        return
    from tracedb import runtime

    try:
        runtime.set_memory_limit(None if value.lower() == "none" else value)
    except ValueError as e:
        raise fail(f"--memory-limit: {e}", 2) from None


AfterOption = Annotated[
    int | None, typer.Option("--after", help="Only traces committed after this watermark (what a last call returned).")
]
CompleteGroupsOption = Annotated[
    int | None,
    typer.Option("--complete-groups", help="Only groups of at least N members whose N-th arrived after --after."),
]
ThroughOption = Annotated[int | None, typer.Option("--through", help="Read as of this watermark.")]
TagFilterOption = Annotated[
    list[str] | None,
    typer.Option("--tag", help="Only traces with this ingest tag: name=value or name=low..high (repeatable)."),
]


def live_selection(
    after: int | None, complete_groups: int | None, through: int | None, tag: list[str] | None
) -> dict[str, Any]:
    """The live-run keyword arguments of a view call, from the shared options (exit 2 on
    a bad --tag)."""
    from tracedb.selection import tag_filters

    try:
        tags = tag_filters(tag)
    except ValueError as e:
        raise fail(f"--tag: {e}", 2) from None
    return {"after": after, "complete_groups": complete_groups, "through": through, "tags": tags}


def open_db(db: Path, read_only: bool = False) -> Database:
    """Open the database or exit 2 with the reason."""
    from tracedb.database import connect

    if read_only and not db.exists():
        raise fail(f"no database at {db}", 2)
    try:
        return connect(db, read_only=read_only)
    except (TraceDBError, ValueError) as e:  # ValueError: a setting from the environment
        raise fail(e, 2) from None


def emit(data: Any, as_json: bool, title: str | None = None) -> None:
    """Print rows (or a dict) as JSON or as a table."""
    if as_json:
        sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
        return
    rows = data if isinstance(data, list) else [{"key": k, "value": v} for k, v in data.items()]
    table = Table(title=None if title is None else Text(title))
    if rows:  # cells are text, never markup: a value (a SQL result's) may hold "[/bold]"
        for column in rows[0]:
            table.add_column(Text(str(column)))
        for row in rows:
            table.add_row(*(Text("" if v is None else str(v)) for v in row.values()))
    print_table(table)


def print_table(table: Table) -> None:
    """A table on stdout: fitted to a terminal; whole, however wide, when stdout is not one
    (a pipe or a file gets every column and cell uncut, not 80 columns' worth)."""
    try:
        terminal = sys.stdout.isatty()  # the real stream (rich may be told to act as a terminal)
    except (AttributeError, ValueError):
        terminal = False
    if terminal:
        out.print(table)
        return
    width = Console(width=1_000_000).measure(table).maximum
    Console(file=sys.stdout, width=max(width, 20), soft_wrap=True).print(table)


def checked_name(name: str | None) -> None:
    """A credit command's ``--name``: exit 2 with the reason when no set may have it
    (empty, whitespace at an end, ...), before any work; None: the algorithm's name."""
    from tracedb.credit_sets import check_name

    if name is None:
        return
    try:
        check_name(name)
    except TraceDBError as e:
        raise fail(f"--name: {e}", 2) from None


def emit_sql_rows(table: Any, as_json: bool, limit: int) -> None:
    """A SQL result (a portable one: :func:`tracedb.sqlvalues.portable`) as JSON (every
    row; values as :func:`tracedb.sqlvalues.jsonable` gives them, as ``POST /sql`` does)
    or as a table of at most ``limit`` rows."""
    from tracedb.sqlvalues import jsonable

    try:
        rows = table.to_pylist()
    except (OverflowError, ValueError, NotImplementedError) as e:  # a type tracedb does not know yet
        raise fail(f"a value of this result cannot be shown: {type(e).__name__}: {e}") from None
    if as_json:
        emit([{k: jsonable(v) for k, v in row.items()} for row in rows], True)
        return
    emit(rows[:limit], False)
    if len(rows) > limit:
        err.print(f"{len(rows)} rows, {limit} shown (--limit)")


def key_value(text: str) -> tuple[str, Any]:
    """``key=value`` of a ``--param``: the value as JSON, else as the text."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise typer.BadParameter(f"expected key=value, got {text!r}")
    try:
        return key.strip(), json.loads(value)
    except ValueError:
        return key.strip(), value


def write_pack(plan: Any, out_dir: Path) -> dict[str, Any]:
    """Write a pack's step directory (:func:`tracedb.batches.write_step`); returns its
    manifest. A directory that cannot be made or written (a file in its place, no
    permission) exits 1 naming ``--out``."""
    from tracedb.batches import write_step

    try:
        return write_step(plan, out_dir)
    except OSError as e:
        raise fail(f"--out {out_dir}: {e.strerror or e} ({e.filename or out_dir})") from None


def report_pack(plan: Any, manifest: dict[str, Any], out_dir: Path, as_json: bool) -> None:
    """Print what a pack wrote: its manifest as JSON, or the report as a table."""
    if as_json:
        emit(manifest, True)
        return
    r = plan.report
    line = (
        f"packed {r.samples} samples into {r.micro_batches} micro-batches over {r.ranks} ranks "
        f"({r.physical_tokens} tokens stored for {r.logical_tokens}, {r.padding_tokens} padding) in {out_dir}"
    )
    emit({k: v for k, v in r.to_dict().items() if k != "rank_costs"}, False, title=line)


def fail(e: Exception | str, code: int = 1) -> typer.Exit:
    """Report an error on stderr and return the Exit to raise (``raise fail(e) from None``):
    every command's error exit. Codes: 1 for a failed operation, 2 for bad usage."""
    err.print(f"[red]{escape(str(e))}[/red]")  # a message is text, never markup (a path may hold [ ])
    return typer.Exit(code)


def report_storage(breakdown: dict[str, Any], db: Path) -> None:
    """Print ``db.storage()`` as a table: one row per column holding bytes, then indexes,
    metadata, free blocks and the header (the rows add up to the file's size)."""
    from tracedb.storage import flat_rows

    rows = [
        {
            "table": r["table"],
            "column": r["column"],
            "bytes": f"{r['bytes']:,}",
            "share": f"{r['share']:.1%}",
            "unused tail": f"{r['tail']:,}" if r["tail"] else "",
            "compression": r["compression"],
        }
        for r in flat_rows(breakdown)
    ]
    emit(rows, False, title=f"{db}: {breakdown['file_bytes']:,} bytes")
    blocks = breakdown["blocks"]
    out.print(
        f"{blocks['total']} blocks of {breakdown['block_size']:,} bytes: {blocks['data']} data, "
        f"{blocks['metadata']} metadata, {blocks['indexes']} ART indexes, {blocks['free']} free"
    )
    tails = sum(t["tail_bytes"] for t in breakdown["tables"])
    if tails:
        out.print(
            f"unused tail: the end of a shared block, charged to its last segment ({tails:,} bytes in all; "
            "see tracedb/storage.py)"
        )
    pending = {t["table"]: t["rows_not_checkpointed"] for t in breakdown["tables"] if t["rows_not_checkpointed"]}
    if pending or breakdown["wal_bytes"]:
        out.print(
            f"not checkpointed yet (in the WAL, {breakdown['wal_bytes']:,} bytes; no blocks of their own): "
            + ", ".join(f"{t} {n:,} rows" for t, n in pending.items())
        )


def report_ingest(report: Any, db: Path, as_json: bool) -> None:
    """Print an ingest report (its first rejects on stderr); exit 1 when anything was rejected."""
    if as_json:
        emit(report.to_dict(), True)
    else:
        out.print(str(report))
        for reject in report.rejected[:20]:
            err.print(f"[yellow]rejected[/yellow] {reject}")
        if len(report.rejected) > 20:
            err.print(f"... and {len(report.rejected) - 20} more: tracedb rejects --db {db}")
    if report.rejected:
        raise typer.Exit(1)
