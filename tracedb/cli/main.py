"""The ``tracedb`` command: a thin shell over the library, one library call per command.

Each command imports the library it calls when it runs: the command line starts (and
``tracedb --help`` answers) without DuckDB, Arrow, Polars or numba, and an ingest imports
the ingest, not the views, credit or lake modules."""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from tracedb import credit as credit_lib
from tracedb.cec.cli import app as cec_app
from tracedb.cli import remote
from tracedb.cli import steps as step_cli
from tracedb.cli.common import (
    AfterOption,
    Commands,
    CompleteGroupsOption,
    DbOption,
    JsonOption,
    MaxGroupsOption,
    MaxStalenessOption,
    MemoryLimitOption,
    NewDbOption,
    PolicyOption,
    StaleOption,
    TagFilterOption,
    ThroughOption,
    UnknownOption,
    checked_name,
    checked_selection,
    emit,
    emit_sql_rows,
    err,
    fail,
    hide_pandas,
    input_paths,
    key_value,
    live_selection,
    memory_limit,
    open_db,
    out,
    output_format,
    policy_mapping,
    report_ingest,
    report_pack,
    report_storage,
    training_options,
    training_selection,
    warn,
    write_pack,
)
from tracedb.cli.lake import app as lake_app
from tracedb.errors import SqlRefused, TraceDBError

app = typer.Typer(
    cls=Commands,
    help="Trace storage for RL of LLM agents: verifiers v1 message graphs in DuckDB, branch-spread token views.",
    no_args_is_help=True,
    add_completion=False,
)


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            number = version("tracedb")
        except PackageNotFoundError:  # run from a source tree that was never installed
            number = "unknown (not installed)"
        sys.stdout.write(f"tracedb {number}\n")
        raise typer.Exit()


@app.callback()
def _tracedb(
    show_version: Annotated[
        bool, typer.Option("--version", is_eager=True, callback=_print_version, help="Print the version and exit.")
    ] = False,
) -> None:
    """Trace storage for RL of LLM agents: verifiers v1 message graphs in DuckDB, branch-spread token views."""


CreditOption = Annotated[
    str | None, typer.Option("--credit", help="Credit set whose advantages to use (default: the ingested set).")
]


RotatedOption = Annotated[
    list[str] | None,
    typer.Option(
        "--rotated",
        metavar="PATTERN",
        help="--follow: where a rotated copy of a followed file may be, a glob in its directory ({name}: the "
        "file's name, {stem}: without .jsonl), looked at besides NAME.1, NAME.<n>, NAME-<date>; a file cut "
        "back (logrotate copytruncate) is finished from the copy whose bytes match what was read (repeatable).",
    ),
]


@app.command()
def ingest(
    paths: Annotated[
        list[Path],
        typer.Argument(help="traces.jsonl / .jsonl.zst / .json files or directories; a quoted glob is expanded."),
    ],
    db: NewDbOption = Path("tracedb.duckdb"),
    strict: Annotated[bool, typer.Option(help="Abort on the first bad record; the database stays unchanged.")] = False,
    allow_ragged: Annotated[
        bool, typer.Option(help="Accept compact streams longer/shorter than the sampled count.")
    ] = False,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
    tag: Annotated[
        list[str] | None,
        typer.Option("--tag", help="Store a tag on each trace added: name=value, or name=$.json.path (repeatable)."),
    ] = None,
    follow: Annotated[
        bool, typer.Option("--follow", help="Keep following the paths (new lines, new files) until Ctrl-C / SIGTERM.")
    ] = False,
    interval: Annotated[float, typer.Option(help="--follow: commit what was read at least this often (s).")] = 0.25,
    settle: Annotated[
        float, typer.Option(help="--follow: take a .jsonl.zst once it has not changed for this long (s).")
    ] = 2.0,
    rotated: RotatedOption = None,
    memory_limit_: MemoryLimitOption = None,
    as_json: JsonOption = False,
) -> None:
    """Ingest verifiers traces. Exits 1 when any record was rejected (they are kept in `rejects`).

    With --follow, tails the files and directories (a line is taken once its line break is
    there; positions are committed with the lines, so a restart continues where it ended)
    and exits 0 on Ctrl-C or SIGTERM after finishing the transaction under way. A file cut
    back or rewritten before its position is read again from its start; a file renamed away
    (rotated) is read to its end, found by its inode, before the new one; a copytruncate
    is finished from the copy. What no file holds any more is reported as LOST on stderr
    (and in --json), naming the file (docs/live.md)."""
    memory_limit(memory_limit_)
    tags = tag or []
    paths = input_paths(paths, follow=follow)
    if follow:
        from tracedb.cli.follow import follow as run_follower

        if output_format() == "csv":
            raise fail("--follow prints a JSON object a line as it commits: --format jsonl (or json), not csv", 2)
        if strict:
            raise fail("--strict and --follow do not go together: a follower keeps going past bad lines", 2)
        missing = [str(p) for p in paths if not p.exists()]
        if missing:
            err.print(f"not there yet (followed once they appear): {', '.join(missing)}", style="yellow")
        with open_db(db, create=True) as database:
            try:
                report = run_follower(
                    database,
                    paths,
                    interval=interval,
                    settle=settle,
                    tags=tags,
                    allow_ragged=allow_ragged,
                    as_json=as_json,
                    rotated=rotated,
                )
            except (TraceDBError, ValueError) as e:
                raise fail(e, 2 if isinstance(e, ValueError) else 1) from None
        if as_json:
            emit(report.to_dict(), True)
        else:
            out.print(str(report))
        return
    with open_db(db, create=True) as database:
        try:
            report = database.ingest(
                paths, strict=strict, allow_ragged=allow_ragged, progress=progress and not as_json, tags=tags
            )
        except ValueError as e:  # a bad --tag
            raise fail(e, 2) from None
        except (TraceDBError, FileNotFoundError) as e:
            raise fail(e) from None
    report_ingest(report, db, as_json)


@app.command()
def sql(
    query: Annotated[str, typer.Argument(help="SQL to run; '-' reads it from standard input.")],
    db: DbOption = Path("tracedb.duckdb"),
    as_json: JsonOption = False,
    limit: Annotated[int, typer.Option(help="Print at most this many rows (table output).")] = 50,
    write: Annotated[
        bool, typer.Option("--write", help="Open the file for writing (for statements that change it).")
    ] = False,
    url: remote.UrlOption = None,
) -> None:
    """Run SQL against the database; tracedb's macros (branch_tokens(), node_credit(), ...) are there.

    Without --write only reads run (SELECT, DESCRIBE/SHOW, EXPLAIN of a read, COPY (query)
    TO 'file'; every statement is checked before any runs) and the file is opened read-only
    (other readers may have it open too). With --url, one SELECT goes through the server
    (started with --allow-sql), within its row and byte limits."""
    text = sys.stdin.read() if query == "-" else query
    if url:
        if write:
            raise fail("--write opens the file; a server (--url) answers reads only", 2)
        rows = remote.sql_rows(url, text, None if as_json else limit + 1)
        if as_json:
            emit(rows, True)
            return
        emit(rows[:limit], False)
        if len(rows) > limit:
            err.print(f"more than {limit} rows, {limit} shown (--limit)")
        return
    with open_db(db, read_only=not write) as database:
        try:
            table = database.sql(text, read_only=not write, portable=True)
        except SqlRefused as e:
            raise fail(f"{e} (pass --write for statements that change the database)", 2) from None
        except Exception as e:  # DuckDB's own message says what is wrong with the query
            raise fail(f"{type(e).__name__}: {e}") from None
    emit_sql_rows(table, as_json, limit)


@app.command()
def branches(
    trace_id: Annotated[str, typer.Argument(help="The trace to show.")],
    db: DbOption = Path("tracedb.duckdb"),
    train_once: Annotated[bool, typer.Option(help="Keep a shared node trainable only in its first branch.")] = False,
    tokens: Annotated[bool, typer.Option(help="With --json: include the full per-token arrays.")] = False,
    branch: Annotated[
        list[int] | None, typer.Option("--branch", "-b", help="Only this branch index (repeatable).")
    ] = None,
    credit: CreditOption = None,
    as_json: JsonOption = False,
    url: remote.UrlOption = None,
) -> None:
    """Show one trace's branches: size, sampled tokens, credit; --json --tokens for the arrays.
    With --url, through the server (within its branch token limit)."""
    if url:
        table, known = remote.trace_branches(url, trace_id, train_once=train_once, credit=credit, branch=branch)
    else:
        with open_db(db, read_only=True) as database:
            try:
                table = database.branches(
                    trace_ids=[trace_id], train_once=train_once, credit=credit, branch_index=branch or None
                )
                known = table.num_rows or database.branches(trace_ids=[trace_id], columns=[]).num_rows
            except TraceDBError as e:
                raise fail(e) from None
    if not known:
        raise fail(
            f"trace {trace_id!r} is not in {url or db} "
            f'(`tracedb sql "SELECT trace_id FROM traces LIMIT 10" --db {db}` shows some that are)'
        )
    if table.num_rows == 0:
        raise fail(f"trace {trace_id!r} has no branch {', '.join(map(str, branch or []))}")
    rows = []
    for row in table.to_pylist():
        summary = {
            "branch_index": row["branch_index"],
            "trainable": row["trainable"],
            "tokens": len(row["token_ids"]),
            "sampled": sum(row["sampled_mask"]),
            "advantages": None if row["advantages"] is None else "assigned",
            "loss_weights": ",".join(k for k, _ in row["loss_weights"]) or None,
        }
        if as_json and tokens:
            row["loss_weights"] = dict(row["loss_weights"])
            summary = row
        rows.append(summary)
    emit(rows, as_json, title=f"trace {trace_id}")


@app.command()
def trace(
    trace_id: Annotated[str, typer.Argument(help="The trace to print.")],
    db: DbOption = Path("tracedb.duckdb"),
    credit: CreditOption = None,
) -> None:
    """Print a trace record exactly as it was ingested (JSON), with later write-backs."""
    with open_db(db, read_only=True) as database:
        try:
            record = database.trace(trace_id, credit=credit)
        except TraceDBError as e:
            raise fail(e) from None
    sys.stdout.write(json.dumps(record) + "\n")


@app.command()
@training_options
def export(
    path: Annotated[Path, typer.Argument(help="Output file: .parquet, .arrow (IPC file) or .arrows (IPC stream).")],
    db: DbOption = Path("tracedb.duckdb"),
    trace_id: Annotated[list[str] | None, typer.Option(help="Only these traces (repeatable).")] = None,
    group: Annotated[list[str] | None, typer.Option(help="Only traces of these groups (repeatable).")] = None,
    trainable_only: Annotated[bool, typer.Option(help="Only trainable branches.")] = False,
    columns: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated columns to keep: the view's token columns, trace fields (group_id, reward, "
            "episode_id, env_id, any column of traces) and tags (tag:NAME or a stored tag's name)."
        ),
    ] = None,
    train_once: Annotated[bool, typer.Option(help="Keep a shared node trainable only in its first branch.")] = False,
    format: Annotated[str | None, typer.Option(help="parquet, arrow or arrows (default: from the suffix).")] = None,
    credit: CreditOption = None,
    after: AfterOption = None,
    complete_groups: CompleteGroupsOption = None,
    through: ThroughOption = None,
    tag: TagFilterOption = None,
    as_json: JsonOption = False,
    training: dict[str, Any] | None = None,
) -> None:
    """Export branch views, streaming in bounded memory. The result's watermark (printed,
    and in the file's schema) is the --after of the next export of a live run."""
    live = live_selection(after, complete_groups, through, tag)
    live.update(training or {})
    with open_db(db, read_only=True) as database:
        try:
            result = database.export(
                path,
                format=format,
                trace_ids=trace_id or None,
                group=group or None,
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


@app.command()
@training_options
def pack(
    ctx: typer.Context,
    out: Annotated[Path, typer.Option("--out", help="Step directory to write (rank_R.arrow, manifest.json last).")],
    seq_len: Annotated[int | None, typer.Option("--seq-len", help="Tokens per micro-batch, at most.")] = None,
    db: DbOption = Path("tracedb.duckdb"),
    ranks: Annotated[int, typer.Option(help="Data-parallel ranks: one file each, as many micro-batches each.")] = 1,
    trace_id: Annotated[list[str] | None, typer.Option(help="Only these traces (repeatable).")] = None,
    group: Annotated[list[str] | None, typer.Option(help="Only traces of these groups (repeatable).")] = None,
    episode: Annotated[list[str] | None, typer.Option(help="Only traces of these episodes (repeatable).")] = None,
    all_branches: Annotated[bool, typer.Option(help="Also untrainable branches (compaction attempts).")] = False,
    credit: CreditOption = None,
    train_once: Annotated[bool, typer.Option(help="A shared sampled token is in the loss once.")] = True,
    overflow: Annotated[str, typer.Option(help="A sample over --seq-len: truncate, drop or error.")] = "truncate",
    cost_linear: Annotated[float, typer.Option(help="Bin cost per token (rank balance).")] = 1.0,
    cost_quadratic: Annotated[float, typer.Option(help="Bin cost per squared sample length (attention).")] = 0.0,
    pad_to_multiple_of: Annotated[int, typer.Option(help="Pad each micro-batch to a multiple of this.")] = 1,
    pad_token_id: Annotated[int, typer.Option(help="Token id of the padding.")] = 0,
    share_prefixes: Annotated[bool, typer.Option(help="Store a prefix shared in a bin once (spans).")] = False,
    drop_zero_advantages: Annotated[bool, typer.Option(help="Leave out samples whose advantages are all 0.")] = False,
    importance: Annotated[
        str | None,
        typer.Option(
            help="tis: add importance_weight = min(exp(trainer_logprobs - logprobs), --clip) on each loss token "
            "holding both (1.0 elsewhere, counted in the report)."
        ),
    ] = None,
    clip: Annotated[
        float | None, typer.Option(help="The cap on the importance ratio (with --importance; default 2.0).")
    ] = None,
    after: AfterOption = None,
    complete_groups: CompleteGroupsOption = None,
    through: ThroughOption = None,
    tag: TagFilterOption = None,
    replay_zero_variance: step_cli.ReplayOption = False,
    replay_max_staleness: step_cli.ReplayMaxStalenessOption = None,
    replay_priority: step_cli.ReplayPriorityOption = None,
    replay_max_uses: step_cli.ReplayMaxUsesOption = None,
    replay_seed: step_cli.ReplaySeedOption = None,
    steps_root: step_cli.StepsRootOption = None,
    from_manifest: step_cli.FromManifestOption = None,
    as_json: JsonOption = False,
    training: dict[str, Any] | None = None,
) -> None:
    """Pack micro-batches for a trainer into a step directory: per rank an Arrow IPC file of
    micro-batches and their samples, then manifest.json (a trainer waits for it). On a live
    run, --after with the last step's watermark (in the report) packs what arrived since.
    --replay-zero-variance replaces each zero-variance group by an earlier complete group
    with signal (within --replay-max-staleness of --policy, replayed at most
    --replay-max-uses times over the steps under --steps-root). --from-manifest rebuilds a
    step byte-identical from its manifest (or names what changed in the database, exit 1)."""
    if from_manifest is not None:
        step_cli.check_alone(ctx)
        with open_db(db, read_only=True) as database:
            step_cli.rebuild_step(database, from_manifest, out, as_json)
        return
    if seq_len is None:
        raise fail("--seq-len is required (or --from-manifest to rebuild a step)", 2)
    replay = step_cli.replay_of(
        replay_zero_variance, replay_max_staleness, replay_priority, replay_max_uses, replay_seed, steps_root
    )
    live = live_selection(after, complete_groups, through, tag)
    live.update(training or {})
    with open_db(db, read_only=True) as database:
        try:
            plan = database.micro_batches(
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
                replay=replay,
            )
        except ValueError as e:
            raise fail(e, 2) from None
        except TraceDBError as e:
            raise fail(e) from None
        manifest = write_pack(plan, out)
    report_pack(plan, manifest, out, as_json)


@app.command()
def stats(
    db: DbOption = Path("tracedb.duckdb"),
    as_json: JsonOption = False,
    url: remote.UrlOption = None,
    by_bytes: Annotated[
        bool,
        typer.Option("--bytes", help="Where the file's bytes are: per table and column, indexes, metadata, free."),
    ] = False,
) -> None:
    """Episodes, traces, nodes, branches, tokens, bytes, the dedup ratio and the watermark
    (with --url, of the database the server serves); with --bytes, the file's bytes by
    table and column."""
    if url:
        if by_bytes:
            raise fail("--bytes reads the database file: it does not go with --url", 2)
        emit(remote.stats(url), as_json, title=url)
        return
    with open_db(db, read_only=True) as database:
        if not by_bytes:
            emit(database.stats(), as_json, title=str(db))
            return
        try:
            breakdown = database.storage()
        except ValueError as e:
            raise fail(e, 2) from None
    if as_json:
        emit(breakdown, True)
        return
    report_storage(breakdown, db)


@app.command()
def rejects(db: DbOption = Path("tracedb.duckdb"), as_json: JsonOption = False) -> None:
    """Records that ingest rejected, with where and why."""
    with open_db(db, read_only=True) as database:
        rows = database.sql(
            "SELECT source, line, trace_id, node, field, reason FROM rejects ORDER BY rejected_at, source, line"
        ).to_pylist()
    emit(rows, as_json, title="rejects")


@app.command()
def credit(
    algorithm: Annotated[str | None, typer.Argument(help=f"Algorithm: {', '.join(credit_lib.ALGORITHMS)}.")] = None,
    name: Annotated[str | None, typer.Option(help="Credit set to write (default: the algorithm's name).")] = None,
    param: Annotated[
        list[str] | None, typer.Option("--param", "-p", help="Algorithm parameter key=value (JSON values), repeatable.")
    ] = None,
    replace: Annotated[
        bool,
        typer.Option(help="Recompute an existing set of that name (with a selection: the selected traces it holds)."),
    ] = False,
    list_algorithms: Annotated[bool, typer.Option("--list", help="List the algorithms and their parameters.")] = False,
    trace_id: Annotated[
        list[str] | None, typer.Option("--trace-id", "--trace-ids", help="Only these traces (repeatable).")
    ] = None,
    group: Annotated[list[str] | None, typer.Option(help="Only traces of these groups (repeatable).")] = None,
    episode: Annotated[list[str] | None, typer.Option(help="Only traces of these episodes (repeatable).")] = None,
    after: AfterOption = None,
    complete_groups: CompleteGroupsOption = None,
    through: ThroughOption = None,
    tag: TagFilterOption = None,
    policy: PolicyOption = None,
    max_staleness: MaxStalenessOption = None,
    stale: StaleOption = None,
    unknown: UnknownOption = None,
    max_groups: MaxGroupsOption = None,
    db: DbOption = Path("tracedb.duckdb"),
    as_json: JsonOption = False,
) -> None:
    """Stamp advantages with a credit algorithm as a named credit set (one transaction).

    With a selection (--after W --complete-groups N, --trace-id, --group, --policy V
    --max-staleness K, --max-groups B, ...) only the selected traces are stamped, into the
    set, created on first use: a trainer credits each step's new groups. Group means are
    taken over each selected trace's whole group as stored; a trace the set already holds
    is refused unless --replace (which computes it again). The result's watermark is the
    next step's --after. Dropped traces and eval episodes are left out as in every credit
    run (-p include_dropped=true / include_eval=true credits them)."""
    if list_algorithms or algorithm is None:
        rows = [
            {"algorithm": a.name, "layout": a.layout, "params": a.params(), "summary": a.summary}
            for a in credit_lib.algorithms().values()
        ]
        emit(rows, as_json, title="credit algorithms")
        return
    params = dict(key_value(p) for p in param or [])
    checked_name(name)
    fields = checked_selection(
        trace_id,
        group,
        episode,
        live_selection(after, complete_groups, through, tag),
        training_selection(policy, max_staleness, stale, unknown, False, False, max_groups),
    )
    selection = None
    if any(v is not None for v in fields.values()):
        from tracedb.selection import Selection

        selection = Selection(**fields)
    with open_db(db) as database:
        try:
            result = credit_lib.run(database, algorithm, name, replace=replace, selection=selection, **params)
        except (TraceDBError, ValueError, TypeError) as e:
            raise fail(e) from None
    warn(result.get("warnings", []))
    emit(result, as_json)


@app.command("credit-compare")
def credit_compare(
    sets: Annotated[
        list[str], typer.Argument(help="Credit sets to compare, one or more ('default': the ingested credit).")
    ],
    per_trace: Annotated[bool, typer.Option("--per-trace", help="One row per set (pair) and trace.")] = False,
    db: DbOption = Path("tracedb.duckdb"),
    as_json: JsonOption = False,
) -> None:
    """Dose-matched comparison of credit sets: per set, tokens assigned and credited, coverage,
    sum A, sum |A|, sum A^2 and concentration; per pair, the tokens both assign, their sign
    agreement and correlation."""
    from tracedb.credit import dose as dose_lib

    with open_db(db, read_only=True) as database:
        try:
            result = dose_lib.compare(database, sets, per_trace=per_trace)
        except (TraceDBError, ValueError) as e:
            raise fail(e) from None
    tables = {name: table.to_pylist() for name, table in result.items()}
    if as_json:  # JSON: the tables by name; CSV and JSON lines: their rows, each naming its table
        flat = [{"table": name, **row} for name, rows in tables.items() for row in rows]
        emit(tables if output_format() == "json" else flat, True)
        return
    shown = {
        k: [{c: f"{v:.4g}" if isinstance(v, float) else v for c, v in r.items()} for r in rows]
        for k, rows in tables.items()
    }
    if per_trace:
        emit(shown["dose"], False, title="credit dose per trace")
    else:  # one column per set: the figures read down
        figures = [c for c in shown["dose"][0] if c != "credit_set"]
        emit([{"": f, **{r["credit_set"]: r[f] for r in shown["dose"]}} for f in figures], False, title="credit dose")
    if "agreement" in shown:
        emit(shown["agreement"], False, title="agreement" + (" per trace" if per_trace else ""))


@app.command("credit-sets")
def credit_sets(db: DbOption = Path("tracedb.duckdb"), as_json: JsonOption = False) -> None:
    """The credit sets side by side: algorithm, parameters, creation time, assigned nodes."""
    with open_db(db, read_only=True) as database:
        emit(database.credit_sets().to_pylist(), as_json, title="credit sets")


@app.command("policy-versions")
def policy_versions(
    db: DbOption = Path("tracedb.duckdb"),
    set_: Annotated[
        list[str] | None,
        typer.Option(
            "--set", help="Map a weight label with no number of its own to a policy version: LABEL=N (repeatable)."
        ),
    ] = None,
    as_json: JsonOption = False,
) -> None:
    """Weight labels and policy versions: a label such as step_12, v3 or 12 names its own
    version; map any other (a checkpoint name, a hash) with --set LABEL=N, which stores the
    bounds of the traces using it again. Without --set, list the mapped labels."""
    if not set_:
        with open_db(db, read_only=True) as database:
            emit(database.policy_versions().to_pylist(), as_json, title="mapped weight labels")
        return
    mapping = policy_mapping(set_)
    with open_db(db) as database:
        try:
            updated = database.set_policy_versions(mapping)
        except TraceDBError as e:
            raise fail(e, 2) from None
    emit({"labels": len(mapping), "traces": updated}, as_json)


@app.command()
def migrate(db: DbOption = Path("tracedb.duckdb"), as_json: JsonOption = False) -> None:
    """Upgrade a database file written by an older tracedb to this one's schema, in place
    (one transaction: a failure leaves the file as it was)."""
    if not db.exists():
        raise fail(f"no database at {db}", 2)
    from tracedb.database import migrate as upgrade

    try:
        done = upgrade(db)
    except (TraceDBError, ValueError) as e:
        raise fail(e, 2) from None
    emit(done, as_json)


@app.command()
def serve(
    dbs: Annotated[
        list[str] | None,
        typer.Option(
            "--db",
            envvar="TRACEDB_DB",
            help="Database file the server serves (a read-only server needs it; with --token or --follow it is "
            "created); env TRACEDB_DB. Repeat it for runs to compare at /runs/compare: PATH or NAME=PATH "
            "(a run is named by its file's stem unless named); the first is the one every other page serves.",
        ),
    ] = None,
    host: Annotated[str, typer.Option(help="Address to bind (loopback by default).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    token: Annotated[
        str | None,
        typer.Option(
            envvar="TRACEDB_TOKEN", help="Bearer token that enables writes; env TRACEDB_TOKEN. None: read-only."
        ),
    ] = None,
    allow_sql: Annotated[bool, typer.Option("--allow-sql", help="Enable POST /sql (one read-only SELECT).")] = False,
    sql_needs_token: Annotated[
        bool, typer.Option("--sql-needs-token", help="POST /sql needs the bearer token too.")
    ] = False,
    tokenizer: Annotated[
        Path | None, typer.Option(help="Local Hugging Face tokenizer.json: the viewer shows decoded tokens.")
    ] = None,
    max_body_mb: Annotated[int, typer.Option(help="Refuse request bodies larger than this many MiB (413).")] = 256,
    sql_row_limit: Annotated[int, typer.Option(help="Rows POST /sql returns at most.")] = 1000,
    sql_max_mb: Annotated[float, typer.Option(help="MiB of JSON rows POST /sql returns at most.")] = 4.0,
    sql_timeout: Annotated[float, typer.Option(help="Seconds a POST /sql query (and its answer) may take.")] = 5.0,
    allowed_host: Annotated[
        list[str] | None,
        typer.Option(
            "--allowed-host", help="Another Host name to answer to (repeatable; '*' any); loopback and --host always."
        ),
    ] = None,
    follow: Annotated[
        list[Path] | None,
        typer.Option(
            "--follow",
            help="Follow this run file or directory while it is written, as ingest --follow does (repeatable).",
        ),
    ] = None,
    interval: Annotated[float, typer.Option(help="--follow: commit what was read at least this often (s).")] = 0.25,
    settle: Annotated[
        float, typer.Option(help="--follow: take a .jsonl.zst once it has not changed for this long (s).")
    ] = 2.0,
    tag: Annotated[
        list[str] | None,
        typer.Option("--tag", help="--follow: a tag on each trace added: name=value or name=$.json.path (repeatable)."),
    ] = None,
    allow_ragged: Annotated[
        bool, typer.Option(help="--follow: accept compact streams longer/shorter than the sampled count.")
    ] = False,
    rotated: RotatedOption = None,
    branch_token_limit: Annotated[
        int, typer.Option(help="View tokens GET /branches answers at most (whole traces; said when reached).")
    ] = 4_000_000,
    branch_row_limit: Annotated[
        int,
        typer.Option(
            help="Branches GET /branches answers at most (whole traces; said when reached), and a page of a "
            "trace's branch list holds."
        ),
    ] = 10_000,
    memory_limit_: MemoryLimitOption = None,
) -> None:
    """Serve the REST API (branch lookup as JSON or Arrow, listings, writes) and the web trace viewer.

    Without a token the file is opened read-only, so other processes can read it meanwhile.
    With --follow the server owns the file: it ingests the run as it is written (shown in
    /health), and readers in other processes go through it (GET /traces?after=&wait=,
    /branches, /micro-batches; the CLI's --url)."""
    import uvicorn

    from tracedb.api import create_app
    from tracedb.api.runsets import parse_run
    from tracedb.api.security import LOOPBACK_HOSTS

    memory_limit(memory_limit_)
    follow = input_paths(follow, follow=True) if follow else follow
    try:
        named = [parse_run(spec) for spec in dbs or ["tracedb.duckdb"]]
    except ValueError as e:
        raise fail(e, 2) from None
    (name, db), others = named[0], dict(named[1:])
    if len(others) != len(named) - 1 or name in others:
        raise fail(f"two runs are named alike among {', '.join(n for n, _ in named)}: name them (--db NAME=PATH)", 2)
    if rotated and not follow:
        raise fail("--rotated names where a followed file's rotated copies are: it needs --follow", 2)
    if token is None and not follow and not db.exists():
        raise fail(f"no database at {db} (a read-only server needs one; with --token or --follow it is created)", 2)
    if host not in ("127.0.0.1", "localhost", "::1") and token is None:
        err.print(
            f"[yellow]warning: serving on {host}, beyond this machine, with no token: anyone who reaches it "
            "reads every trace (clients using another name for this machine need --allowed-host NAME)[/yellow]"
        )
    try:
        application = create_app(
            db,
            token=token,
            allow_sql=allow_sql,
            sql_needs_token=sql_needs_token,
            tokenizer=tokenizer,
            max_body_bytes=max_body_mb * 1024 * 1024,
            sql_row_limit=sql_row_limit,
            sql_max_bytes=int(sql_max_mb * 1024 * 1024),
            sql_timeout_s=sql_timeout,
            allowed_hosts=[*LOOPBACK_HOSTS, host, *(allowed_host or [])],
            branch_token_limit=branch_token_limit,
            branch_row_limit=branch_row_limit,
            follow=follow or None,
            follow_interval=interval,
            follow_settle=settle,
            follow_tags=tag or [],
            follow_allow_ragged=allow_ragged,
            follow_rotated=rotated or (),
            name=name,
            runs=others,
        )
    except (TraceDBError, FileNotFoundError, ValueError) as e:
        raise fail(e, 2) from None
    mode = "writes on" if token else "read-only" if not follow else "following, REST writes off"
    if follow:
        missing = [str(p) for p in follow if not p.exists()]
        note = f"; not there yet (followed once they appear): {', '.join(missing)}" if missing else ""
        err.print(f"following {', '.join(map(str, follow))}{note}", style="dim")
    err.print(f"tracedb serving {db} on http://{host}:{port} ({mode})")
    if others:
        err.print(
            f"runs to compare: {', '.join(n for n, _ in named)} at http://{host}:{port}/runs/compare", style="dim"
        )
    try:
        uvicorn.run(application, host=host, port=port, log_level="info")
    finally:
        application.state.backend.close()


@app.command()
def demo(
    db: NewDbOption = Path("tracedb-demo.duckdb"),
    data: Annotated[Path, typer.Option(help="Where the generated sample traces.jsonl goes.")] = Path(
        "data/sample/traces.jsonl"
    ),
    groups: Annotated[int, typer.Option(help="Rollout groups to generate.")] = 8,
    group_size: Annotated[int, typer.Option(help="Traces per group.")] = 8,
    tokens: Annotated[int, typer.Option(help="Tokens per trace.")] = 30_000,
) -> None:
    """The main job end to end on generated sample data: ingest, views, SQL, export."""
    import pyarrow.compute as pc

    from tracedb.synthetic import write_sample

    if not data.exists():
        write_sample(data, groups=groups, group_size=group_size, tokens_per_trace=tokens, advantages=True)
        out.print(f"wrote sample rollouts to {data}")
    with open_db(db, create=True) as database:
        report = database.ingest(data, progress=True)
        out.print(str(report))
        emit(database.stats(), False, title="stats")
        view = database.branches(trainable=True)
        out.print(
            f"branch views: {view.num_rows} trainable branches, "
            f"{pc.sum(pc.list_value_length(view.column('token_ids'))).as_py() or 0} tokens (aligned token_ids, "
            "sampled_mask, logprobs, advantages, ...)"
        )
        per_group = database.sql(
            "SELECT t.group_id, count(*) AS branches, sum(b.n_tokens) AS tokens, "
            "round(avg(s.sampled_share), 3) AS sampled_share, sum(s.credited_nodes) AS credited_nodes "
            "FROM branch_stats() s JOIN traces t USING (trace_id) "
            "JOIN branches b USING (trace_id, branch_index) GROUP BY 1 ORDER BY 1"
        )
        emit(per_group.to_pylist(), False, title="SQL: per group, from branch_stats()")
        exported = database.export(db.with_suffix(".parquet"), trainable=True)
        out.print(f"exported {exported['rows']} branches to {exported['path']} ({exported['bytes']} bytes)")


app.add_typer(cec_app, name="cec")
app.add_typer(lake_app, name="lake")


def main() -> None:
    """The ``tracedb`` console script and ``python -m tracedb``: the command in a process
    of its own (pandas hidden: :func:`tracedb.cli.common.hide_pandas`). When the command
    is done, the objects that exist are frozen out of the garbage collector: the
    interpreter's last collection would walk every one the libraries made (~0.25 s of CPU
    after a large ingest, measured), and nothing needs it (the files are written and closed)."""
    hide_pandas()
    try:
        app(prog_name="tracedb")
    finally:
        gc.freeze()
