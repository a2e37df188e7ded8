"""Rebuilding a step from its manifest (``tracedb pack --from-manifest``).

A step's manifest records everything that made it: the call's arguments (the packing
options, the selection as given, the replay settings), the watermark the selection was
resolved at (``selection.read_at``) and the traces it selected, the credit set and the
digest of the credit rows it read, the replay choices, and the SHA-256 of every rank file.
:func:`rebuild` resolves the same selection as of ``read_at``, makes the recorded replay
choices again (it never counts uses or ranks candidates again) and packs; before a byte
is written it checks the inputs, and a difference is a :class:`~tracedb.errors.StepChanged`
naming it (a trace selected now that was not then, or the reverse; a replayed group whose
traces differ; credit rows that hash differently). :func:`tracedb.batches.write_step`
with ``expect=`` the manifest then checks every file's SHA-256 against the recorded one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tracedb.batches.files import MANIFEST, read_manifest
from tracedb.batches.plan import Plan
from tracedb.batches.replay import Replayed
from tracedb.batches.run import micro_batches
from tracedb.errors import StepChanged, TraceDBError
from tracedb.handle import HandleOf, handle_of
from tracedb.selection import Selection, resolve_at

RECORDED = ("selection", "credit")
"""The manifest sections a rebuild needs (written since tracedb records its steps' inputs)."""


def load(path: str | Path) -> tuple[dict[str, Any], Path]:
    """A step's manifest from its ``manifest.json`` or its directory, and that directory;
    :class:`~tracedb.errors.TraceDBError` naming the path when it is no step, or a step
    whose manifest does not record its inputs."""
    path = Path(path)
    step = path.parent if path.name == MANIFEST or path.is_file() else path
    if path.is_file() and path.name != MANIFEST:
        raise TraceDBError(f"{path}: a step manifest is a {MANIFEST} (or give the step directory)")
    try:
        manifest = read_manifest(step)
    except ValueError as e:  # not JSON
        raise TraceDBError(f"{step / MANIFEST}: not a step manifest: {e}") from None
    missing = [k for k in RECORDED if not isinstance(manifest.get(k), dict)]
    if missing or not all(f.get("tokens_sha256") for f in manifest.get("files", [])):
        raise TraceDBError(
            f"{step / MANIFEST} does not record its inputs ({', '.join(missing) or 'file hashes'} missing: "
            "written by an older tracedb), so the step cannot be rebuilt from it"
        )
    return manifest, step


def selection_of(arguments: dict[str, Any]) -> Selection:
    """The selection a step's arguments record (:meth:`Selection.manifest` read back)."""
    fields = {name: arguments.get(name) for name in Selection.FIELDS}
    if fields["tags"] is not None:
        fields["tags"] = {k: tuple(v) if isinstance(v, list) else v for k, v in fields["tags"].items()}
    return Selection(**fields)


PACKING = (
    "ranks",
    "trainable",
    "branch_index",
    "credit",
    "train_once",
    "overflow",
    "cost",
    "pad_to_multiple_of",
    "pad_token_id",
    "share_prefixes",
    "drop_zero_advantages",
    "importance",
    "clip",
)
"""The packing options a step's arguments record, as ``micro_batches`` takes them."""


def rebuild(db: HandleOf, manifest: dict[str, Any]) -> Plan:
    """The plan of the step ``manifest`` records, made again from ``db`` (see the module
    docstring); :class:`~tracedb.errors.StepChanged` names what differs."""
    handle = handle_of(db)
    args, chosen, credit = manifest["arguments"], manifest["selection"], manifest["credit"]
    read_at = int(chosen["read_at"])
    now = handle.watermark()
    if now < read_at:
        raise StepChanged(
            f"the database is at watermark {now}, below the {read_at} the step was read at: "
            "it is not the database the step was packed from (or it lost traces)"
        )
    selection = selection_of(args).pinned(read_at)
    selected = resolve_at(handle.con, selection.for_training(), read_at)
    _same_traces(selected.trace_ids, chosen["trace_ids"], read_at)
    options = {name: args[name] for name in PACKING if name in args}
    options["cost"] = tuple(options.get("cost", (1.0, 0.0)))
    report = manifest.get("report") or {}
    replay = None
    if args.get("replay") is not None:
        replay = Replayed(tuple(report.get("replayed") or []), args["replay"], report.get("replay_candidates", 0))
    plan = micro_batches(handle, args["seq_len"], selection, **options, replay=replay)
    digest, then = plan.record["credit"]["rows_sha256"], credit["rows_sha256"]
    if digest != then:
        raise StepChanged(
            f"credit set {credit['set']!r} changed since the step: its rows over the step's "
            f"{credit['traces']} packed traces hash to {digest[:16]}... now, {then[:16]}... in the manifest"
        )
    plan.arguments = dict(args)  # the call as it was made (the rebuild pinned its watermark)
    plan.record = {**plan.record, "selection": {**plan.record["selection"], "read_at": read_at}}
    if plan.report.watermark != chosen.get("watermark", plan.report.watermark):
        raise StepChanged(f"the step's watermark was {chosen['watermark']}, the rebuilt one is {plan.report.watermark}")
    return plan


def _same_traces(now: list[str], then: list[str], read_at: int) -> None:
    """Refuse a selection that differs from the recorded one, naming a trace."""
    new, gone = sorted(set(now) - set(then)), sorted(set(then) - set(now))
    if not new and not gone:
        return
    what = (
        f"trace {new[0]} is selected now and was not in the step"
        if new
        else f"trace {gone[0]} was in the step and is not selected now"
    )
    raise StepChanged(
        f"the selection changed since the step (read at watermark {read_at}): {what} "
        f"({len(new)} new, {len(gone)} gone; a changed policy-version mapping, dropped flag or "
        "re-ingest changes what a selection takes)"
    )
