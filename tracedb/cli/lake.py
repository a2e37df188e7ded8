"""``tracedb lake ...``: the lake commands, thin shells over :mod:`tracedb.lake`.

The lake needs the ``lake`` extra; it is imported when a lake command runs, so the rest
of the CLI works without it."""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Annotated, Any

import typer

from tracedb.cli.common import (
    AfterOption,
    CompleteGroupsOption,
    DbOption,
    JsonOption,
    NewDbOption,
    TagFilterOption,
    ThroughOption,
    checked_name,
    checked_selection,
    emit,
    emit_sql_rows,
    err,
    fail,
    input_paths,
    key_value,
    live_selection,
    out,
    policy_mapping,
    report_pack,
    show_pandas,
    training_options,
    write_pack,
)
from tracedb.errors import SqlRefused, TraceDBError

app = typer.Typer(
    help="The same store as Apache Iceberg tables (needs the lake extra: pip install 'tracedb\\[lake]').",
    no_args_is_help=True,
)

QUIET_LOGGERS = ("ray", "pyiceberg")
"""Libraries whose log records below errors a lake command keeps off the terminal (Ray's
own go to its session's log files)."""

RayAddressOption = Annotated[
    str | None,
    typer.Option(
        "--ray-address",
        envvar="RAY_ADDRESS",
        help="A running Ray cluster (host:port of its head, 'auto': the one on this machine); default: start a "
        "local one (loopback only, stopped after).",
    ),
]

LakeOption = Annotated[
    Path,
    typer.Option(
        "--lake", envvar="TRACEDB_LAKE", help="A lake directory, or a .yaml/.json of pyiceberg catalog properties."
    ),
]


@app.callback()
def _lake_commands(ctx: typer.Context) -> None:
    """The same store as Apache Iceberg tables (needs the lake extra: pip install 'tracedb\\[lake]')."""
    show_pandas()  # Ray Data needs it
    ctx.with_resource(_quiet_libraries())


@contextlib.contextmanager
def _quiet_libraries() -> Iterator[None]:
    """While a lake command runs: the libraries' Python warnings (pyarrow's, DuckDB's,
    Ray's deprecations) and their log records below errors are not printed; tracedb's
    own output and errors are. ``python -W`` / ``PYTHONWARNINGS`` still choose."""
    loggers = [logging.getLogger(name) for name in QUIET_LOGGERS]
    levels = [logger.level for logger in loggers]
    with warnings.catch_warnings():
        if not sys.warnoptions:
            warnings.simplefilter("ignore")
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for logger, level in zip(loggers, levels, strict=True):
                logger.setLevel(level)


def _lakes() -> ModuleType:
    try:
        import tracedb.lake
    except ImportError as e:
        raise fail(f"{e} (the lake commands need the lake extra: pip install 'tracedb[lake]')", 2) from None
    return tracedb.lake


def _open(lake: Path) -> object:
    try:
        return _lakes().open(lake)
    except TraceDBError as e:
        raise fail(e, 2) from None


@app.command()
def init(
    warehouse: Annotated[
        Path,
        typer.Option("--warehouse", help="A local lake's directory (SQLite catalog + warehouse), or a .yaml/.json."),
    ],
    buckets: Annotated[
        int | None,
        typer.Option(
            "--buckets",
            min=1,
            help="Hash buckets of a new lake's tables (default 64, sized for about a million traces; "
            "an existing lake keeps its own).",
        ),
    ] = None,
    as_json: JsonOption = False,
) -> None:
    """Make a lake (idempotent: an existing one gets the tables it lacks, an older layout is upgraded)."""
    lakes = _lakes()
    try:
        lake = lakes.init(warehouse, buckets=buckets)
    except (TraceDBError, ValueError) as e:
        raise fail(e, 2) from None
    made = {
        "lake": str(warehouse),
        "lake_schema_version": lakes.LAKE_SCHEMA_VERSION,
        "buckets": lake.buckets,
        "watermark": lake.watermark(),
    }
    emit(made, as_json)


@app.command()
def push(
    db: DbOption = Path("tracedb.duckdb"),
    lake: LakeOption = Path("lake"),
    as_json: JsonOption = False,
) -> None:
    """Push a file store's traces into the lake; traces it shows already are skipped."""
    opened = _open(lake)
    try:
        report = opened.push(db)  # type: ignore[attr-defined]
    except TraceDBError as e:
        raise fail(e) from None
    mark = opened.watermark()  # type: ignore[attr-defined]
    emit({"traces": report.traces, "skipped": report.skipped, "rows": report.rows, "watermark": mark}, as_json)


@app.command()
def pull(
    lake: LakeOption = Path("lake"),
    db: NewDbOption = Path("tracedb.duckdb"),
    trace_ids: Annotated[str | None, typer.Option("--trace-ids", help="Comma-separated trace ids.")] = None,
    group: Annotated[list[str] | None, typer.Option("--group", help="A group id (repeatable).")] = None,
    episode: Annotated[list[str] | None, typer.Option("--episode", help="An episode id (repeatable).")] = None,
    after: AfterOption = None,
    complete_groups: CompleteGroupsOption = None,
    through: ThroughOption = None,
    tag: TagFilterOption = None,
    as_json: JsonOption = False,
) -> None:
    """Pull the selected traces (all by default) from the lake into a local file (the
    selection options of ``tracedb lake pack``)."""
    live = live_selection(after, complete_groups, through, tag)
    opened = _open(lake)
    ids = None if trace_ids is None else [t.strip() for t in trace_ids.split(",") if t.strip()]
    try:
        added = opened.pull(db, trace_ids=ids, group=group or None, episode=episode or None, **live)  # type: ignore[attr-defined]
    except ValueError as e:  # a bad selection (the file store's message)
        raise fail(e, 2) from None
    except TraceDBError as e:
        raise fail(e) from None
    emit({"db": str(db), "traces": added}, as_json)


@app.command()
def ingest(
    paths: Annotated[list[Path], typer.Argument(help="Run directories or traces.jsonl / .jsonl.zst files.")],
    lake: LakeOption = Path("lake"),
    ray_address: RayAddressOption = None,
    workers: Annotated[
        int | None, typer.Option("--workers", min=1, help="Ingest tasks at once (default: Ray's CPUs).")
    ] = None,
    files_per_task: Annotated[int, typer.Option("--files-per-task", min=1, help="Files each Ray task ingests.")] = 1,
    range_bytes: Annotated[
        int | None,
        typer.Option(
            "--range-bytes",
            min=1,
            help="Cut plain .jsonl files larger than this into byte ranges at line starts, a task each"
            " (default 134217728: 128 MiB; .jsonl.zst and .json files are not cut).",
        ),
    ] = None,
    allow_ragged: Annotated[
        bool, typer.Option(help="Accept compact streams longer/shorter than the sampled count.")
    ] = False,
    commit_traces: Annotated[
        int,
        typer.Option(
            "--commit-traces",
            min=1,
            help="Gather the tasks' output into commits of at least this many traces (one commit per table).",
        ),
    ] = 256,
    as_json: JsonOption = False,
) -> None:
    """Ingest files into the lake in Ray tasks (the file store's scanner and checks; rejects kept).

    Large plain .jsonl files are cut into byte ranges (--range-bytes), their rejects named
    by the file and its true line numbers. Idempotent by trace id, also against other
    ingests running at the same time. Exits 1 when anything was rejected."""
    paths = input_paths(paths)
    opened = _open(lake)
    started = _started_ray(ray_address, workers)
    try:
        report = opened.ingest(  # type: ignore[attr-defined]
            paths,
            workers=workers,
            files_per_task=files_per_task,
            allow_ragged=allow_ragged,
            range_bytes=range_bytes,
            commit_traces=commit_traces,
        )
    except (TraceDBError, FileNotFoundError) as e:
        raise fail(e) from None
    finally:
        if started:
            import ray

            ray.shutdown()
    if as_json:
        emit(report.to_dict(), True)
    else:
        out.print(str(report))
    if report.rejected:
        err.print(f"{report.rejected} line(s) rejected: tracedb lake sql 'SELECT * FROM rejects' --lake {lake}")
        raise typer.Exit(1)


@app.command()
@training_options
def pack(
    out_dir: Annotated[Path, typer.Option("--out", help="Step directory to write (rank_R.arrow, manifest.json last).")],
    seq_len: Annotated[int, typer.Option("--seq-len", help="Tokens per micro-batch, at most.")],
    lake: LakeOption = Path("lake"),
    ranks: Annotated[int, typer.Option(help="Data-parallel ranks: one file each, as many micro-batches each.")] = 1,
    trace_id: Annotated[list[str] | None, typer.Option(help="Only these traces (repeatable).")] = None,
    group: Annotated[list[str] | None, typer.Option(help="Only traces of these groups (repeatable).")] = None,
    episode: Annotated[list[str] | None, typer.Option(help="Only traces of these episodes (repeatable).")] = None,
    all_branches: Annotated[bool, typer.Option(help="Also untrainable branches (compaction attempts).")] = False,
    credit: Annotated[str | None, typer.Option(help="Credit set of the advantages (default: the ingested).")] = None,
    train_once: Annotated[bool, typer.Option(help="A shared sampled token is in the loss once.")] = True,
    overflow: Annotated[str, typer.Option(help="A sample over --seq-len: truncate, drop or error.")] = "truncate",
    cost_linear: Annotated[float, typer.Option(help="Bin cost per token (rank balance).")] = 1.0,
    cost_quadratic: Annotated[float, typer.Option(help="Bin cost per squared sample length (attention).")] = 0.0,
    pad_to_multiple_of: Annotated[int, typer.Option(help="Pad each micro-batch to a multiple of this.")] = 1,
    pad_token_id: Annotated[int, typer.Option(help="Token id of the padding.")] = 0,
    share_prefixes: Annotated[bool, typer.Option(help="Store a prefix shared in a bin once (spans).")] = False,
    drop_zero_advantages: Annotated[bool, typer.Option(help="Leave out samples whose advantages are all 0.")] = False,
    importance: Annotated[
        str | None, typer.Option(help="tis: add importance_weight, as tracedb pack --importance does.")
    ] = None,
    clip: Annotated[float | None, typer.Option(help="The cap on the importance ratio (default 2.0).")] = None,
    after: AfterOption = None,
    complete_groups: CompleteGroupsOption = None,
    through: ThroughOption = None,
    tag: TagFilterOption = None,
    as_json: JsonOption = False,
    training: dict[str, Any] | None = None,
) -> None:
    """Pack micro-batches of the lake's visible traces into a step directory, as
    ``tracedb pack`` does for a file (the same files and selection options, staleness and
    dropped/eval ones included; the report's watermark is the lake's: the --after of the
    next step)."""
    live = live_selection(after, complete_groups, through, tag)
    live.update(training or {})
    opened = _open(lake)
    try:
        plan = opened.micro_batches(  # type: ignore[attr-defined]
            seq_len,
            ranks=ranks,
            trace_ids=trace_id or None,
            group=group or None,
            episode=episode or None,
            **live,
            trainable=None if all_branches else True,
            credit=credit,
            train_once=train_once,
            overflow=overflow,
            cost=(cost_linear, cost_quadratic),
            pad_to_multiple_of=pad_to_multiple_of,
            pad_token_id=pad_token_id,
            share_prefixes=share_prefixes,
            drop_zero_advantages=drop_zero_advantages,
            importance=importance,
            clip=clip,
        )
    except ValueError as e:
        raise fail(e, 2) from None
    except TraceDBError as e:
        raise fail(e) from None
    report_pack(plan, write_pack(plan, out_dir), out_dir, as_json)


@app.command()
@training_options
def export(
    path: Annotated[Path, typer.Argument(help="Output file: .parquet, .arrow (IPC file) or .arrows (IPC stream).")],
    lake: LakeOption = Path("lake"),
    trace_id: Annotated[list[str] | None, typer.Option(help="Only these traces (repeatable).")] = None,
    group: Annotated[list[str] | None, typer.Option(help="Only traces of these groups (repeatable).")] = None,
    episode: Annotated[list[str] | None, typer.Option(help="Only traces of these episodes (repeatable).")] = None,
    trainable_only: Annotated[bool, typer.Option(help="Only trainable branches.")] = False,
    columns: Annotated[str | None, typer.Option(help="Comma-separated token columns to keep.")] = None,
    train_once: Annotated[bool, typer.Option(help="Keep a shared node trainable only in its first branch.")] = False,
    format: Annotated[str | None, typer.Option(help="parquet, arrow or arrows (default: from the suffix).")] = None,
    credit: Annotated[str | None, typer.Option(help="Credit set of the advantages (default: the ingested).")] = None,
    after: AfterOption = None,
    complete_groups: CompleteGroupsOption = None,
    through: ThroughOption = None,
    tag: TagFilterOption = None,
    as_json: JsonOption = False,
    training: dict[str, Any] | None = None,
) -> None:
    """Export the lake's branch views to a file, as ``tracedb export`` does for a file (the
    same options; --trainable-only leaves dropped and eval traces out unless included).
    The printed watermark (also in the file's schema) is the lake's: the --after of the
    next export."""
    live = live_selection(after, complete_groups, through, tag)
    live.update(training or {})
    opened = _open(lake)
    try:
        result = opened.export(  # type: ignore[attr-defined]
            path,
            format=format,
            trace_ids=trace_id or None,
            group=group or None,
            episode=episode or None,
            **live,
            trainable=True if trainable_only else None,
            columns=[c.strip() for c in columns.split(",")] if columns else None,
            train_once=train_once,
            credit=credit,
        )
    except ValueError as e:
        raise fail(e, 2) from None
    except TraceDBError as e:
        raise fail(e) from None
    emit(result, as_json)


@app.command("policy-versions")
def policy_versions(
    lake: LakeOption = Path("lake"),
    set_: Annotated[
        list[str] | None,
        typer.Option(
            "--set", help="Map a weight label with no number of its own to a policy version: LABEL=N (repeatable)."
        ),
    ] = None,
    as_json: JsonOption = False,
) -> None:
    """The lake's weight labels and policy versions, as ``tracedb policy-versions`` for a
    file: --set LABEL=N maps a label (the traces using it get their bounds again, traces
    rewritten keeping every seq); without --set, list the mapped labels."""
    opened = _open(lake)
    if not set_:
        held = opened.policy_versions()  # type: ignore[attr-defined]
        emit([{"label": k, "version": v} for k, v in sorted(held.items())], as_json, title="mapped weight labels")
        return
    mapping = policy_mapping(set_)
    try:
        updated = opened.set_policy_versions(mapping)  # type: ignore[attr-defined]
    except TraceDBError as e:
        raise fail(e, 2) from None
    emit({"labels": len(mapping), "traces": updated}, as_json)


def _started_ray(ray_address: str | None, workers: int | None) -> bool:
    """Ray for a command (:func:`tracedb.lake.workers.start`: the cluster at
    ``ray_address``, else a local one of ``workers`` CPUs) unless it runs already; True
    when this call started it."""
    try:
        from tracedb.lake import workers as lake_workers
    except ImportError as e:
        raise fail(f"{e} (this lake command needs the lake extra: pip install 'tracedb[lake]')", 2) from None
    try:
        return lake_workers.start(ray_address, num_cpus=workers)
    except TraceDBError as e:
        raise fail(e, 2) from None


@app.command()
@training_options
def credit(
    algorithm: Annotated[str, typer.Argument(help="grpo or rloo.")],
    name: Annotated[str | None, typer.Option(help="Credit set to append (default: the algorithm's name).")] = None,
    param: Annotated[
        list[str] | None, typer.Option("--param", "-p", help="Algorithm parameter key=value (JSON values), repeatable.")
    ] = None,
    lake: LakeOption = Path("lake"),
    ray_address: RayAddressOption = None,
    workers: Annotated[int | None, typer.Option("--workers", min=1, help="CPUs of the Ray this starts.")] = None,
    trace_id: Annotated[
        list[str] | None, typer.Option("--trace-id", "--trace-ids", help="Only these traces (repeatable).")
    ] = None,
    group: Annotated[list[str] | None, typer.Option(help="Only traces of these groups (repeatable).")] = None,
    episode: Annotated[list[str] | None, typer.Option(help="Only traces of these episodes (repeatable).")] = None,
    after: AfterOption = None,
    complete_groups: CompleteGroupsOption = None,
    through: ThroughOption = None,
    tag: TagFilterOption = None,
    as_json: JsonOption = False,
    training: dict[str, Any] | None = None,
) -> None:
    """Compute group credit (grpo, rloo) over the lake in a Ray groupby and append it as a set.

    With a selection (--after W --complete-groups N, --group, --policy V --max-staleness K,
    --max-groups B, ...) only the selected traces are stamped, into the set, created on
    first use, as `tracedb credit` does for a file: a trainer credits each step's new groups
    (the printed watermark is the next step's --after). A trace the set holds is refused."""
    checked_name(name)
    fields = checked_selection(
        trace_id, group, episode, live_selection(after, complete_groups, through, tag), training or {}
    )
    opened = _open(lake)
    params = dict(key_value(p) for p in param or [])
    started = _started_ray(ray_address, workers)
    try:
        chosen = {k: v for k, v in fields.items() if v is not None}  # -p include_dropped=true stays
        result = opened.credit(algorithm, name, **{**params, **chosen})  # type: ignore[attr-defined]
    except (TraceDBError, ValueError, TypeError) as e:
        raise fail(e) from None
    finally:
        if started:
            import ray

            ray.shutdown()
    emit(result, as_json)


@app.command()
def compact(
    lake: LakeOption = Path("lake"),
    grace: Annotated[
        float, typer.Option("--grace", min=0, help="Keep uncommitted rows in files younger than this (seconds).")
    ] = 3600.0,
    expire_older_than: Annotated[
        float | None,
        typer.Option(
            "--expire-older-than",
            min=0,
            help="Also expire snapshots replaced longer ago than this (seconds) and delete the files only they held.",
        ),
    ] = None,
    full: Annotated[
        bool, typer.Option("--full", help="Rewrite every file, not only those added since the last compaction.")
    ] = False,
    as_json: JsonOption = False,
) -> None:
    """Remove what readers never see (a killed writer's rows, duplicate segments) and
    merge the files added since the last compaction, table by table; readers' answers
    are unchanged (traces keep their seq). --expire-older-than also drops old snapshots
    and their files."""
    opened = _open(lake)
    try:
        report = opened.compact(grace=grace, expire_older_than=expire_older_than, full=full)  # type: ignore[attr-defined]
    except (TraceDBError, ValueError) as e:
        raise fail(e) from None
    rows = [{"table": name, **entry, **report.expired.get(name, {})} for name, entry in report.tables.items()]
    emit(rows if not as_json else report.to_dict(), as_json, title="compacted")


@app.command()
def sql(
    query: Annotated[str, typer.Argument(help="SQL to run; '-' reads it from standard input.")],
    lake: LakeOption = Path("lake"),
    as_json: JsonOption = False,
    limit: Annotated[int, typer.Option(help="Print at most this many rows (table output).")] = 50,
) -> None:
    """Run SQL over the lake's visible rows; tracedb's macros (branch_stats(), ...) are there.
    Only reads run (SELECT, DESCRIBE/SHOW, EXPLAIN of a read, COPY (query) TO 'file' outside
    the lake; every statement is checked before any runs)."""
    opened = _open(lake)
    text = sys.stdin.read() if query == "-" else query
    try:
        table = opened.sql(text, portable=True)  # type: ignore[attr-defined]
    except SqlRefused as e:
        raise fail(e, 2) from None
    except TraceDBError as e:
        raise fail(e) from None
    except Exception as e:  # DuckDB's own message says what is wrong with the query
        raise fail(f"{type(e).__name__}: {e}") from None
    emit_sql_rows(table, as_json, limit)


__all__ = ["app", "out"]
