"""``tracedb cec``: counterfactual edit credit from the command line.

A typer sub-app (``app``) mounted under the main CLI (:mod:`tracedb.cli.main`); each
command is one call into :mod:`tracedb.cec` (or :mod:`tracedb.cec.git` for the harness side).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from tracedb import cec
from tracedb.cec import git as cec_git
from tracedb.cec.rules import DEFAULT_CAP, DEFAULT_LAM
from tracedb.cli.common import (
    DbOption,
    JsonOption,
    NewDbOption,
    emit,
    err,
    fail,
    input_paths,
    open_db,
    out,
    report_ingest,
)
from tracedb.errors import TraceDBError

app = typer.Typer(
    help="Counterfactual edit credit: edit blocks from per-turn snapshots, verifier-blind selection, "
    "one intervention per rollout, and the O/B/M/E arms stamped as credit sets cec-O, cec-B, cec-M, cec-E.",
    no_args_is_help=True,
    add_completion=False,
)

LamOption = Annotated[float, typer.Option("--lam", help="Coefficient scale lambda (> 0).")]
CapOption = Annotated[float, typer.Option("--cap", help="Per-token cap c (> 0).")]
RewardOption = Annotated[
    str | None, typer.Option(help="Reward name for the terminal advantage (default: weighted sum of scored rewards).")
]
GroupByOption = Annotated[
    str, typer.Option(help="Group for the terminal advantage: a traces column or a $.json.path into the trace.")
]
IncludeFailedOption = Annotated[bool, typer.Option(help="Keep failed / timed-out rollouts as valid group members.")]


@app.command()
def ingest(
    paths: Annotated[
        list[Path], typer.Argument(help="JSONL files (or directories) of cec records; a quoted glob is expanded.")
    ],
    db: NewDbOption = Path("tracedb.duckdb"),
    strict: Annotated[bool, typer.Option(help="Abort on the first bad record; the database stays unchanged.")] = False,
    as_json: JsonOption = False,
) -> None:
    """Ingest turn, trace and verification records (one JSON object per line, `kind` says which).

    Exits 1 when any record was rejected (they are kept in `rejects`, see `tracedb rejects`)."""
    paths = input_paths(paths)
    with open_db(db, create=True) as database:
        try:
            report = cec.ingest_records(database, paths, strict=strict)
        except (TraceDBError, FileNotFoundError) as e:
            raise fail(e) from None
    report_ingest(report, db, as_json)


def _summary_rows(summary: dict[str, Any]) -> list[dict[str, Any]]:
    rows = [{"what": "traces", "status": "", "count": summary["traces"]}]
    for what in ("selection", "query", "intervention"):
        rows += [{"what": what, "status": k, "count": v} for k, v in summary[what].items()]
    rows += [
        {"what": "credit set", "status": k, "count": f"{v} nodes"} for k, v in summary.get("credit_sets", {}).items()
    ]
    return rows


@app.command()
def plan(
    db: DbOption = Path("tracedb.duckdb"),
    lam: LamOption = DEFAULT_LAM,
    cap: CapOption = DEFAULT_CAP,
    reward: RewardOption = None,
    group_by: GroupByOption = "group_id",
    include_failed: IncludeFailedOption = False,
    as_json: JsonOption = False,
) -> None:
    """Compute blocks, selection, utilities, D and coefficients per trace (table cec_selection).

    Run it after ingesting snapshots and original verifications to learn which interventions
    to run (`tracedb cec queries`); `stamp` plans again itself."""
    with open_db(db) as database:
        try:
            summary = cec.plan(database, lam, cap, reward=reward, group_by=group_by, include_failed=include_failed)
        except (TraceDBError, ValueError) as e:
            raise fail(e) from None
    emit(summary if as_json else _summary_rows(summary), as_json, title=f"cec plan (lam={lam}, cap={cap})")


@app.command()
def queries(
    db: DbOption = Path("tracedb.duckdb"),
    pending: Annotated[bool, typer.Option(help="Only queries without an intervention record yet.")] = False,
    as_json: JsonOption = False,
) -> None:
    """The planned counterfactual queries: per trace, the trees and paths to build its intervention."""
    with open_db(db, read_only=True) as database:
        try:
            rows = cec.queries(database, pending_only=pending)
        except TraceDBError as e:
            raise fail(e) from None
    if not as_json:  # the trees are in --json
        rows = [
            {
                "trace_id": r["trace_id"],
                "block": r["block"],
                "nodes": r["nodes"],
                "touched_paths": ",".join(r["touched_paths"] or []),
                "intervention": r["intervention"],
            }
            for r in rows
        ]
    emit(rows, as_json, title="cec queries")


@app.command()
def stamp(
    db: DbOption = Path("tracedb.duckdb"),
    lam: LamOption = DEFAULT_LAM,
    cap: CapOption = DEFAULT_CAP,
    reward: RewardOption = None,
    group_by: GroupByOption = "group_id",
    include_failed: IncludeFailedOption = False,
    as_json: JsonOption = False,
) -> None:
    """Plan and write the arms as credit sets cec-O, cec-B, cec-M, cec-E (one transaction)."""
    with open_db(db) as database:
        try:
            summary = cec.stamp(database, lam, cap, reward=reward, group_by=group_by, include_failed=include_failed)
        except (TraceDBError, ValueError) as e:
            raise fail(e) from None
    emit(summary if as_json else _summary_rows(summary), as_json, title=f"cec stamp (lam={lam}, cap={cap})")


@app.command()
def check(
    db: DbOption = Path("tracedb.duckdb"),
    rel_tol: Annotated[float, typer.Option(help="Relative tolerance, on top of the float32 storage bound.")] = 1e-6,
    as_json: JsonOption = False,
) -> None:
    """Verify sum C^M = sum C^B = lam*D*s*L, sum |C^M| = sum |C^B| and sum (C^M)^2 / sum (C^B)^2 = L/m
    on the stored credit of every trace with available credit. Exits 1 when any fails."""
    with open_db(db, read_only=True) as database:
        try:
            result = cec.check(database, rel_tol=rel_tol)
        except TraceDBError as e:
            raise fail(e) from None
    if as_json:
        emit(result.to_dict(), True)
    else:
        out.print(str(result))
        if result.failures:
            emit(result.failures[:50], False, title="failed identities")
    if not result.ok:
        raise typer.Exit(1)


@app.command()
def report(db: DbOption = Path("tracedb.duckdb"), as_json: JsonOption = False) -> None:
    """The signal-availability table of the current plan (counts, D decomposition, quantiles)."""
    with open_db(db, read_only=True) as database:
        try:
            data = cec.report(database)
        except TraceDBError as e:
            raise fail(e) from None
    if as_json:
        emit(data, True)
    else:
        emit(cec.report_rows(data), False, title=f"cec signal availability (lam={data['lam']}, cap={data['cap']})")


@app.command()
def snapshot(
    worktree: Annotated[Path, typer.Argument(help="The agent's repository working tree.")],
    previous: Annotated[
        str | None, typer.Option(help="Previous snapshot's tree (first turn: the baseline tree).")
    ] = None,
    index: Annotated[
        Path | None, typer.Option(help="Private index file kept between turns (never the agent's .git/index).")
    ] = None,
) -> None:
    """Snapshot a working tree into a private index: prints {"tree", "changed_paths"} as JSON."""
    try:
        snap = cec_git.snapshot(worktree, previous, index)
    except TraceDBError as e:
        raise fail(e) from None
    sys.stdout.write(json.dumps({"tree": snap.tree, "changed_paths": snap.changed_paths}) + "\n")


@app.command()
def intervene(
    repo: Annotated[Path, typer.Argument(help="A repository holding the rollout's trees (its object store).")],
    trace_id: Annotated[str, typer.Argument(help="The trace whose planned intervention to build.")],
    db: DbOption = Path("tracedb.duckdb"),
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Write the patch here (default: standard output).")
    ] = None,
) -> None:
    """Build a planned trace's intervention patch: final tree with the selected block's paths
    restored to their pre-block contents, as a binary diff against the baseline tree."""
    with open_db(db, read_only=True) as database:
        try:
            planned = [q for q in cec.queries(database) if q["trace_id"] == trace_id]
        except TraceDBError as e:
            raise fail(e) from None
    if not planned:
        raise fail(ValueError(f"no planned query for trace {trace_id!r} (see `tracedb cec queries`)"))
    q = planned[0]
    try:
        patch = cec_git.intervene(repo, q["baseline_tree"], q["final_tree"], q["pre_block_tree"], q["touched_paths"])
    except TraceDBError as e:
        raise fail(e) from None
    if output is None:
        sys.stdout.buffer.write(patch)
        sys.stdout.flush()
    else:
        output.write_bytes(patch)
        err.print(f"wrote {len(patch)} bytes to {output}")
