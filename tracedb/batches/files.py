"""A step directory for trainers: one rank's micro-batches per Arrow IPC file.

``write_step(plan, out)`` writes, per rank ``r``, ``rank_{r}.arrow`` (an Arrow IPC file
whose record batches are that rank's micro-batches, in order) and ``rank_{r}.samples.arrow``
(one samples table, with a ``micro_batch`` column), and ``manifest.json`` last (the
arguments, the report, what the step read: ``selection`` and ``credit``, see
:mod:`tracedb.batches.provenance`; the files with their SHA-256), each published by :func:`tracedb.publish.publishing`
(written under a temporary name, fsynced, renamed into place, the directory fsynced; the
process umask's mode): a trainer that waits for the manifest never reads half a step, also
after a crash of the machine. :func:`read_micro_batches` reads one
rank back as the same :class:`~tracedb.batches.plan.MicroBatch` objects.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc

from tracedb.batches.plan import SAMPLES_SCHEMA, MicroBatch, Plan
from tracedb.errors import StepChanged, TraceDBError
from tracedb.publish import publishing, sync_dir

MANIFEST = "manifest.json"
FORMAT = "tracedb-micro-batches/1"


def _rank_files(rank: int) -> tuple[str, str]:
    return f"rank_{rank}.arrow", f"rank_{rank}.samples.arrow"


def _replace_into(path: Path, write: Any) -> str:
    """``write(tmp_path)``, then publish it as ``path`` (a reader sees the whole file or
    none); returns the SHA-256 of what was written."""
    with publishing(path) as tmp:
        write(tmp)
        with tmp.open("rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()


def version() -> str:
    """The tracedb version writing a step (the manifest's ``tracedb``)."""
    try:
        return metadata.version("tracedb")
    except metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
        return "unknown"


def write_step(
    plan: Plan, out: str | Path, *, rebuilt_from: str | None = None, expect: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Write ``plan`` into the directory ``out`` (created); returns the manifest.

    ``rebuilt_from``: the manifest the plan was rebuilt from (recorded; such a step's
    replays are not uses). ``expect``: that manifest; a rank file whose SHA-256 differs from
    the one it lists raises :class:`~tracedb.errors.StepChanged` naming it, and no manifest
    is written (the directory is no step; one this call made is removed)."""
    out = Path(out)
    made = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    if made:
        sync_dir(out.parent)  # the step directory's own name survives a crash with its files
    manifest_path = out / MANIFEST
    if manifest_path.exists():  # a step being rewritten is not a step until its manifest is back
        manifest_path.unlink()
        sync_dir(out)
    files = []
    for rank, batches in enumerate(plan):
        tokens_name, samples_name = _rank_files(rank)
        schema = batches[0].tokens.schema if batches else pa.schema([])

        def tokens_file(tmp: Path, batches: list[MicroBatch] = batches, schema: pa.Schema = schema) -> None:
            with ipc.new_file(tmp, schema) as writer:
                for mb in batches:
                    writer.write_batch(mb.tokens)

        def samples_file(tmp: Path, batches: list[MicroBatch] = batches) -> None:
            parts = [
                mb.samples.append_column("micro_batch", pa.array([i] * mb.samples.num_rows, pa.int32()))
                for i, mb in enumerate(batches)
            ]
            schema = SAMPLES_SCHEMA.append(pa.field("micro_batch", pa.int32(), nullable=False))
            table = pa.concat_tables(parts) if parts else schema.empty_table()
            with ipc.new_file(tmp, table.schema) as writer:
                writer.write_table(table)

        tokens_sha = _replace_into(out / tokens_name, tokens_file)
        samples_sha = _replace_into(out / samples_name, samples_file)
        files.append(
            {
                "rank": rank,
                "tokens": tokens_name,
                "samples": samples_name,
                "micro_batches": len(batches),
                "tokens_sha256": tokens_sha,
                "samples_sha256": samples_sha,
            }
        )
    if expect is not None:
        try:
            _compare_files(files, expect)
        except StepChanged:
            if made:  # a directory this call made holds nothing else: leave none behind
                shutil.rmtree(out, ignore_errors=True)
            raise
    manifest: dict[str, Any] = {"format": FORMAT, "tracedb": version(), "arguments": plan.arguments}
    manifest.update(plan.record)
    manifest.update({"report": plan.report.to_dict(), "files": files})
    if rebuilt_from is not None:
        manifest["rebuilt_from"] = rebuilt_from
    _replace_into(out / MANIFEST, lambda tmp: tmp.write_text(json.dumps(manifest, indent=2, default=str) + "\n"))
    return manifest


def _compare_files(files: list[dict[str, Any]], expect: dict[str, Any]) -> None:
    """Refuse rank files that differ from the ones ``expect`` (a step's manifest) lists."""
    then = {f[kind]: f.get(f"{kind}_sha256") for f in expect.get("files", []) for kind in ("tokens", "samples")}
    now = {f[kind]: f[f"{kind}_sha256"] for f in files for kind in ("tokens", "samples")}
    if sorted(then) != sorted(now):
        raise StepChanged(f"the rebuilt step has files {sorted(now)}, the step {sorted(then)}")
    differ = [name for name in now if now[name] != then[name]]
    if differ:
        raise StepChanged(
            f"{differ[0]} differs from the step's (sha256 {now[differ[0]][:16]}..., the step's "
            f"{str(then[differ[0]])[:16]}...; {len(differ)} of {len(now)} files differ) although its selection "
            f"and credit are the same: the traces' tokens or streams changed, or the packer did (the step was "
            f"written by tracedb {expect.get('tracedb')}, this is {version()})"
        )


def read_manifest(step: str | Path, *, wait: float = 0.0) -> dict[str, Any]:
    """A step directory's manifest, waiting up to ``wait`` seconds for it to appear."""
    path = Path(step) / MANIFEST
    deadline = time.monotonic() + wait
    while not path.exists():
        if time.monotonic() >= deadline:
            raise TraceDBError(f"{step} is not a finished step: no {MANIFEST} (its writer may still be at it)")
        time.sleep(min(0.05, max(deadline - time.monotonic(), 0)))
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise TraceDBError(f"{path}: not a tracedb micro-batch step (format {manifest.get('format')!r})")
    return manifest


def read_micro_batches(step: str | Path, rank: int, *, wait: float = 0.0) -> list[MicroBatch]:
    """One rank's micro-batches from a step directory ``tracedb pack`` (or
    :func:`write_step`) wrote: the objects ``db.micro_batches`` gave, in order."""
    manifest = read_manifest(step, wait=wait)
    entry = next((f for f in manifest["files"] if f["rank"] == rank), None)
    if entry is None:
        raise TraceDBError(f"{step} has ranks 0-{len(manifest['files']) - 1}, not {rank}")
    with ipc.open_file(Path(step) / entry["tokens"]) as reader:
        tokens = [reader.get_batch(i) for i in range(reader.num_record_batches)]
    with ipc.open_file(Path(step) / entry["samples"]) as reader:
        samples = reader.read_all()
    index = samples.column("micro_batch")
    out = []
    for i, batch in enumerate(tokens):
        rows = samples.filter(pc.equal(index, i)).drop_columns(["micro_batch"])
        out.append(MicroBatch(batch, rows.cast(SAMPLES_SCHEMA)))
    return out
