"""What every tracedb command shares: the --db and --json options, opening the database,
and printing results (a table for people; CSV, JSON or JSON lines for scripts).

Output formats: every command with ``--json`` also takes ``--format table|csv|json|jsonl``
(:class:`Commands` adds it, so a new command gets it by having ``as_json: JsonOption``).
``--json`` is ``--format json``. Inside a command ``as_json`` is then true for any format
meant for a program (csv, json, jsonl), and :func:`emit` prints the one chosen."""

from __future__ import annotations

import contextvars
import copy
import csv
import functools
import glob
import importlib.abc
import inspect
import io
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

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

DbOption = Annotated[Path, typer.Option("--db", envvar="TRACEDB_DB", help="Database file; env TRACEDB_DB.")]
NewDbOption = Annotated[
    Path, typer.Option("--db", envvar="TRACEDB_DB", help="Database file (created if missing); env TRACEDB_DB.")
]
"""--db of a command that makes the file when there is none (ingest, demo)."""
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON for scripts instead of a table (--format json).")]
FormatOption = Annotated[
    Literal["table", "csv", "json", "jsonl"] | None,
    typer.Option(
        "--format",
        help="Output: table (for people; whole, never cut, when piped), csv, json or jsonl (a JSON object a line).",
    ),
]
_FORMAT: contextvars.ContextVar[str] = contextvars.ContextVar("tracedb_output_format", default="json")


def _format_option() -> Any:
    """A ``--format`` parameter for one more command (a copy of :func:`_built_format_option`'s)."""
    return copy.copy(_built_format_option())


@functools.cache
def _built_format_option() -> Any:
    """The ``--format`` parameter as typer builds it (so that its help renders like the others)."""
    probe = typer.Typer()

    @probe.command()
    def _probe(output_format: FormatOption = None) -> None:  # pragma: no cover - never run
        pass

    return typer.main.get_command(probe).params[0]


def _chosen_format(callback: Callable[..., Any]) -> Callable[..., Any]:
    """A command's callback taking ``--format``: ``as_json`` becomes whether the output is for
    a program, and the format is kept for :func:`emit`."""

    @functools.wraps(callback)
    def run(*args: Any, output_format: str | None = None, **kwargs: Any) -> Any:
        as_json = bool(kwargs.get("as_json"))
        if output_format is not None and as_json and output_format != "json":
            raise fail(f"--json is --format json; it does not go with --format {output_format}: give one of them", 2)
        chosen = output_format or ("json" if as_json else "table")
        kwargs["as_json"] = chosen != "table"
        token = _FORMAT.set(chosen)
        try:
            return callback(*args, **kwargs)
        finally:
            _FORMAT.reset(token)

    return run


def add_format_options(group: typer.core.TyperGroup) -> None:
    """Give every command of ``group`` (and of its subgroups) that has ``--json`` a
    ``--format`` too, unless it has a ``--format`` of its own (export: the file's format)."""
    for command in group.commands.values():
        if isinstance(command, typer.core.TyperGroup):
            add_format_options(command)
            continue
        names = [p.name for p in command.params]
        if "as_json" not in names or "output_format" in names or any("--format" in p.opts for p in command.params):
            continue
        command.params.insert(names.index("as_json"), _format_option())
        command.callback = _chosen_format(command.callback)


class Commands(typer.core.TyperGroup):
    """The ``tracedb`` group: its commands' shared output options (:func:`add_format_options`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        add_format_options(self)


def output_format() -> str:
    """The running command's output format: table, csv, json or jsonl (json outside a command)."""
    return _FORMAT.get()


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


def input_paths(paths: list[Path], follow: bool = False) -> list[Path]:
    """The input files and directories of an ingest: a path with ``*``, ``?`` or ``[``
    that names nothing as written is a glob tracedb expands (quoted, a shell left it
    alone; ``**`` crosses directories), in sorted order. Exits 2, before anything is
    written, on a glob that matches nothing and (unless ``follow``: taken once it
    appears) on a path that is not there."""
    found: list[Path] = []
    for path in paths:
        text = str(path)
        if path.exists() or not any(c in text for c in "*?["):
            if not path.exists() and not follow:
                raise fail(f"{path}: no such file or directory (nothing was written)", 2)
            found.append(path)
            continue
        matches = sorted(glob.glob(text, recursive=True))
        if not matches:
            hint = " (--follow takes files as they appear in a directory: follow the directory)" if follow else ""
            raise fail(f"{text}: no file matches (nothing was written){hint}", 2)
        found.extend(Path(m) for m in matches)
    return found


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


PolicyOption = Annotated[
    int | None,
    typer.Option(
        "--policy", help="The trainer's policy version V; with --max-staleness K, groups older than V-K are left out."
    ),
]
MaxStalenessOption = Annotated[
    int | None,
    typer.Option("--max-staleness", help="K: a group whose oldest member's policy version is below V-K is stale."),
]
StaleOption = Annotated[
    str | None,
    typer.Option(
        "--stale", help="What a stale group gets: drop (default: left out whole) or mask (old tokens out of the loss)."
    ),
]
UnknownOption = Annotated[
    str | None,
    typer.Option(
        "--unknown", help="A trace with tokens of unknown policy version under a bound: refuse (default), keep or drop."
    ),
]
IncludeDroppedOption = Annotated[
    bool, typer.Option("--include-dropped", help="Also dropped traces (verifiers' Trace.dropped), left out by default.")
]
IncludeEvalOption = Annotated[
    bool, typer.Option("--include-eval", help="Also traces of eval episodes, left out by default.")
]
MaxGroupsOption = Annotated[
    int | None,
    typer.Option("--max-groups", help="At most this many groups, oldest first (the watermark ends at the last one)."),
]


def training_selection(
    policy: int | None,
    max_staleness: int | None,
    stale: str | None,
    unknown: str | None,
    include_dropped: bool,
    include_eval: bool,
    max_groups: int | None,
) -> dict[str, Any]:
    """The staleness, dropped/eval and group-count keyword arguments of a training output,
    from the shared options (an unset flag is the library's default)."""
    return {
        "policy": policy,
        "max_staleness": max_staleness,
        "stale": stale,
        "unknown": unknown,
        "include_dropped": True if include_dropped else None,
        "include_eval": True if include_eval else None,
        "max_groups": max_groups,
    }


TRAINING_OPTIONS: tuple[tuple[str, Any, Any], ...] = (
    ("policy", PolicyOption, None),
    ("max_staleness", MaxStalenessOption, None),
    ("stale", StaleOption, None),
    ("unknown", UnknownOption, None),
    ("include_dropped", IncludeDroppedOption, False),
    ("include_eval", IncludeEvalOption, False),
    ("max_groups", MaxGroupsOption, None),
)
"""The staleness, dropped/eval and group-count options (parameter name, annotation,
default) of the commands that pack or export: :func:`training_options` adds them."""


def training_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """A typer command with :data:`TRAINING_OPTIONS` added to its parameters (before its
    ``as_json``, if any) and handed to it as one keyword argument, ``training``: the
    :func:`training_selection` of what was typed."""
    signature = inspect.signature(command, eval_str=True)
    params = [p for p in signature.parameters.values() if p.name != "training"]
    added = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation, default=default)
        for name, annotation, default in TRAINING_OPTIONS
    ]
    at = next((i for i, p in enumerate(params) if p.name == "as_json"), len(params))
    params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in params]

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        chosen = [kwargs.pop(name) for name, _, _ in TRAINING_OPTIONS]
        return command(*args, training=training_selection(*chosen), **kwargs)

    run.__signature__ = signature.replace(parameters=[*params[:at], *added, *params[at:]])  # type: ignore[attr-defined]
    return run


def policy_mapping(values: list[str]) -> dict[str, int]:
    """``--set LABEL=N`` options as a mapping of weight labels to policy versions (exit 2,
    naming the option, on one that is not LABEL=N with N a whole number)."""
    mapping: dict[str, int] = {}
    for text in values:
        label, sep, number = text.rpartition("=")
        if not sep or not label or not number.strip().isdigit():
            raise fail(f"--set: expected LABEL=N (N a whole number), got {text!r}", 2)
        mapping[label] = int(number)
    return mapping


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


def checked_selection(
    trace_id: list[str] | None, group: list[str] | None, episode: list[str] | None, *parts: dict[str, Any]
) -> dict[str, Any]:
    """The selection keyword arguments typed (the id options, then ``parts``: the
    :func:`live_selection` and :func:`training_selection` of the shared options), once every
    field holds a value of its kind (exit 2, one line, before anything is opened)."""
    from tracedb.selection import Selection

    fields = {"trace_ids": trace_id or None, "group": group or None, "episode": episode or None}
    for part in parts:
        fields.update(part)
    try:
        Selection(**fields).check()
    except ValueError as e:
        raise fail(e, 2) from None
    return fields


def open_db(db: Path, read_only: bool = False, create: bool = False) -> Database:
    """Open the database or exit 2 with the reason; a file that is not there is made only
    with ``create`` (ingest), else refused before anything is written."""
    from tracedb.database import connect

    if not create and not db.exists():
        raise fail(f"no database at {db}: make one with `tracedb ingest RUN_DIR --db {db}` (or pass --db)", 2)
    try:
        return connect(db, read_only=read_only)
    except (TraceDBError, ValueError) as e:  # ValueError: a setting from the environment
        raise fail(e, 2) from None


def emit(data: Any, as_json: bool, title: str | None = None) -> None:
    """Print rows (or a dict) as a table, or, for a program (``as_json``), in the format the
    command was given: JSON, JSON lines (a row a line; a dict is one line) or CSV (a header
    of every key, in order of appearance; a dict is one row; nested values as JSON)."""
    if as_json:
        chosen = output_format()
        if chosen == "jsonl":
            for row in data if isinstance(data, list) else [data]:
                sys.stdout.write(json.dumps(row, default=str) + "\n")
        elif chosen == "csv":
            sys.stdout.write(csv_text(data if isinstance(data, list) else [data]))
        else:
            sys.stdout.write(json_text(data) + "\n")
        return
    rows = data if isinstance(data, list) else [{"key": k, "value": v} for k, v in data.items()]
    table = Table(title=None if title is None else Text(title))
    if rows:  # cells are text, never markup: a value (a SQL result's) may hold "[/bold]"
        for column in rows[0]:
            table.add_column(Text(str(column)))
        for row in rows:
            table.add_row(*(Text("" if v is None else str(v)) for v in row.values()))
    print_table(table)


def json_text(value: Any, indent: str = "") -> str:
    """``value`` as indented JSON, except that a list of plain values (a branch's token ids,
    a mask) stays on one line: a 30k-token array is one line, not 30k."""
    inner = indent + "  "
    if isinstance(value, dict) and value:
        items = (f"{inner}{json.dumps(str(k))}: {json_text(v, inner)}" for k, v in value.items())
        return "{\n" + ",\n".join(items) + "\n" + indent + "}"
    if isinstance(value, list | tuple) and any(isinstance(v, dict | list | tuple) for v in value):
        return "[\n" + ",\n".join(inner + json_text(v, inner) for v in value) + "\n" + indent + "]"
    return json.dumps(value, default=str)


def csv_text(rows: list[dict[str, Any]]) -> str:
    """Rows as CSV: a header of every key (in order of appearance), a line per row; a
    missing key or None is empty, a list or dict is its JSON."""
    header: dict[str, None] = {}
    for row in rows:
        header.update(dict.fromkeys(row))
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(header)
    for row in rows:
        writer.writerow(_csv_cell(row.get(k)) for k in header)
    return buffer.getvalue()


def _csv_cell(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, dict | list | tuple):
        return json.dumps(value, default=str)
    return value


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


def write_pack(plan: Any, out_dir: Path, **options: Any) -> dict[str, Any]:
    """Write a pack's step directory (:func:`tracedb.batches.write_step`, with its
    ``options``); returns its manifest. A directory that cannot be made or written (a file
    in its place, no permission) exits 1 naming ``--out``."""
    from tracedb.batches import write_step

    try:
        return write_step(plan, out_dir, **options)
    except OSError as e:
        raise fail(f"--out {out_dir}: {e.strerror or e} ({e.filename or out_dir})") from None


def report_pack(plan: Any, manifest: dict[str, Any], out_dir: Path, as_json: bool) -> None:
    """Print what a pack wrote: its manifest as JSON, or the report as a table; its warnings
    (:meth:`tracedb.batches.PackReport.warnings`, in the manifest's report too) on stderr."""
    warn(plan.report.warnings())
    if as_json:
        emit(manifest, True)
        return
    r = plan.report
    line = (
        f"packed {r.samples} samples into {r.micro_batches} micro-batches over {r.ranks} ranks "
        f"({r.physical_tokens} tokens stored for {r.logical_tokens}, {r.padding_tokens} padding) in {out_dir}"
    )
    emit({k: v for k, v in r.to_dict().items() if k not in ("rank_costs", "replayed", "warnings")}, False, title=line)
    for choice in r.replayed:
        priority = "" if choice["priority"] is None else f", priority {choice['priority']:.4g}"
        out.print(
            f"replayed group {choice['group']} ({len(choice['traces'])} traces{priority}, replayed "
            f"{choice['uses']} times before) for zero-variance group {choice['replaced']}",
            soft_wrap=True,
            highlight=False,
            markup=False,
        )


def warn(lines: list[str]) -> None:
    """Warnings on stderr, a line each (whatever the output format: stdout stays data)."""
    for line in lines:
        err.print(f"[yellow]warning: {escape(line)}[/yellow]")


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
