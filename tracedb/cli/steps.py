"""``tracedb pack``'s replay options (``--replay-zero-variance`` ...) and its rebuild of a
step from a manifest (``--from-manifest``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

import tracedb
from tracedb.cli.common import emit, fail, out, write_pack
from tracedb.errors import StepChanged, TraceDBError

ReplayOption = Annotated[
    bool,
    typer.Option(
        "--replay-zero-variance",
        help="Replace each zero-variance group by an earlier complete group with signal (needs --complete-groups).",
    ),
]
ReplayMaxStalenessOption = Annotated[
    int | None,
    typer.Option(
        "--replay-max-staleness",
        help="A replayed group is at most K policy versions behind --policy (default: --max-staleness).",
    ),
]
ReplayPriorityOption = Annotated[
    str | None,
    typer.Option(
        "--replay-priority", help="signal (mean |A| x reward std, highest first; the default) or uniform (random)."
    ),
]
ReplayMaxUsesOption = Annotated[
    int | None,
    typer.Option("--replay-max-uses", help="Replay a group at most M times over the steps under --steps-root."),
]
ReplaySeedOption = Annotated[
    int | None, typer.Option("--replay-seed", help="Seed of the tie-breaking (signal) or sampling (uniform); 0.")
]
StepsRootOption = Annotated[
    Path | None,
    typer.Option("--steps-root", help="Directory of the step directories whose manifests count replay uses."),
]
FromManifestOption = Annotated[
    Path | None,
    typer.Option(
        "--from-manifest",
        help="Rebuild the step this manifest.json (or step directory) records, byte-identical, into --out.",
    ),
]

WITH_MANIFEST = {"out", "db", "as_json", "from_manifest"}
"""The pack options that go with --from-manifest (the manifest gives every other one)."""


def replay_of(
    on: bool,
    max_staleness: int | None,
    priority: str | None,
    max_uses: int | None,
    seed: int | None,
    steps_root: Path | None,
) -> tracedb.Replay | None:
    """The ``Replay`` the replay options give (None without ``--replay-zero-variance``);
    exit 2 with one line on a bad value, or a replay option without the flag."""
    flags = {
        "--replay-max-staleness": max_staleness,
        "--replay-priority": priority,
        "--replay-max-uses": max_uses,
        "--replay-seed": seed,
        "--steps-root": steps_root,
    }
    if not on:
        given = [flag for flag, value in flags.items() if value is not None]
        if given:
            raise fail(f"{given[0]} goes with --replay-zero-variance", 2)
        return None
    try:
        return tracedb.Replay(
            max_staleness=max_staleness,
            priority=priority or "signal",
            max_uses=max_uses,
            seed=0 if seed is None else seed,
            steps_root=steps_root,
        )
    except ValueError as e:
        raise fail(e, 2) from None


def check_alone(ctx: typer.Context) -> None:
    """Exit 2 when an option other than --out, --db and --json comes with --from-manifest."""
    for param in ctx.command.params:
        name = param.name or ""
        if name in WITH_MANIFEST:
            continue
        # typer's click (vendored or not) names the source: DEFAULT unless it was typed
        source = getattr(ctx.get_parameter_source(name), "name", "DEFAULT")
        if source not in ("DEFAULT", "DEFAULT_MAP"):
            flag = max(param.opts, key=len) if param.opts else name
            raise fail(f"{flag} does not go with --from-manifest: the manifest gives every packing option", 2)


def rebuild_step(database: tracedb.Database, source: Path, out_dir: Path, as_json: bool) -> None:
    """Rebuild the step ``source`` records into ``out_dir`` and print what was written;
    exit 1 naming what changed when the step cannot be made again byte-identical."""
    from tracedb.batches import rebuild, steps

    try:
        manifest, step = steps.load(source)
    except TraceDBError as e:
        raise fail(f"--from-manifest: {e}", 2) from None
    if out_dir.resolve() == step.resolve():
        raise fail(f"--out {out_dir} is the step being rebuilt: give another directory", 2)
    try:
        plan = rebuild(database, manifest)
    except StepChanged as e:
        raise fail(f"{step} cannot be rebuilt byte-identical: {e}") from None
    except (ValueError, TraceDBError) as e:
        raise fail(f"{step}: {e}") from None
    try:
        written = write_pack(plan, out_dir, rebuilt_from=str(step / steps.MANIFEST), expect=manifest)
    except StepChanged as e:
        raise fail(f"{step} cannot be rebuilt byte-identical: {e}") from None
    if as_json:
        emit(written, True)
        return
    names = [f[kind] for f in written["files"] for kind in ("tokens", "samples")]
    out.print(
        f"rebuilt {step} in {out_dir}: {len(names)} files byte-identical to the step's "
        f"({plan.report.samples} samples, {plan.report.replay_replaced} groups replayed as recorded)",
        soft_wrap=True,
        highlight=False,
        markup=False,
    )
