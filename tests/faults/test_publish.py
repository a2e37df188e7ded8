"""Files tracedb publishes survive a crash of the machine and are readable by others.

A SIGKILL never leaves half a file (``test_crash.py``); a power loss could, where the data
or the rename was still in the page cache. Every published file (an export, a step's rank
and samples files, its manifest, a new database file) is fsynced before the rename that
publishes it and its directory after (checked here by recording ``os.fsync`` and
``os.replace``), and gets the process umask's mode (``tempfile.mkstemp`` gave 0600, which
a trainer running as another user cannot read).
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import tracedb
from tracedb import publish
from tracedb.batches import write_step
from tracedb.cli.main import app

from support import FIXTURES

FILES = [FIXTURES / "linear.traces.jsonl", FIXTURES / "groups.traces.jsonl", FIXTURES / "forest.traces.jsonl"]


@pytest.fixture(scope="module")
def db_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("publish") / "runs.duckdb"
    with tracedb.connect(path) as db:
        db.ingest(FILES)
    return path


class Recorder:
    """``os.fsync`` and ``os.replace`` as they are called: ("fsync", path) with the path
    the descriptor has open, ("replace", source, target)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[tuple[str, ...]] = []
        fsync, replace = os.fsync, os.replace

        def recorded_fsync(fd: int) -> None:
            self.events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
            fsync(fd)

        def recorded_replace(src: Any, dst: Any) -> None:
            self.events.append(("replace", os.path.realpath(src), os.path.realpath(dst)))
            replace(src, dst)

        monkeypatch.setattr(os, "fsync", recorded_fsync)
        monkeypatch.setattr(os, "replace", recorded_replace)

    def published(self) -> dict[str, str]:
        """Target -> the temporary file renamed onto it, for every rename recorded."""
        return {e[2]: e[1] for e in self.events if e[0] == "replace"}

    def check_durable(self, target: Path) -> None:
        """``target`` was published by a rename of a file fsynced before it, and its
        directory was fsynced after it."""
        target = Path(os.path.realpath(target))
        renames = [i for i, e in enumerate(self.events) if e[0] == "replace" and e[2] == str(target)]
        assert renames, f"{target} was not published by a rename: {self.events}"
        at = renames[-1]
        source = self.events[at][1]
        assert Path(source).parent == target.parent and Path(source).name.startswith(f".{target.name}.")
        assert ("fsync", source) in self.events[:at], f"{source} was not fsynced before its rename: {self.events}"
        assert ("fsync", str(target.parent)) in self.events[at + 1 :], f"{target.parent} not fsynced after the rename"


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc to name a descriptor's file")
def test_an_export_in_each_format_is_fsynced_then_renamed_then_its_directory(db_path, tmp_path, monkeypatch):
    recorder = Recorder(monkeypatch)
    with tracedb.connect(db_path, read_only=True) as db:
        for name in ("out.parquet", "out.arrow", "out.arrows"):
            db.export(tmp_path / name, columns=["token_ids"])
            recorder.check_durable(tmp_path / name)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.arrow", "out.arrows", "out.parquet"]  # no leftovers


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc to name a descriptor's file")
def test_a_step_publishes_every_file_durably_and_the_manifest_last(db_path, tmp_path, monkeypatch):
    with tracedb.connect(db_path, read_only=True) as db:
        plan = db.micro_batches(256, ranks=2)
    recorder = Recorder(monkeypatch)
    step = tmp_path / "runs" / "step_0"  # its parent is made too
    manifest = write_step(plan, step)
    names = [n for f in manifest["files"] for n in (f["tokens"], f["samples"])] + ["manifest.json"]
    for name in names:
        recorder.check_durable(step / name)
    order = list(recorder.published())
    assert order[-1] == str(step / "manifest.json")  # after every file it names
    assert ("fsync", str(step.parent)) in recorder.events  # the new step directory's own name
    assert sorted(p.name for p in step.iterdir()) == sorted(names)
    # Rewriting a step: the old manifest goes first, durably, before any rank file changes.
    recorder.events.clear()
    write_step(plan, step)
    first_rename = next(i for i, e in enumerate(recorder.events) if e[0] == "replace")
    assert ("fsync", str(step)) in recorder.events[:first_rename]


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc to name a descriptor's file")
def test_a_new_database_file_is_fsynced_and_so_is_its_directory(tmp_path, monkeypatch):
    recorder = Recorder(monkeypatch)
    path = tmp_path / "new.duckdb"
    tracedb.connect(path).close()
    synced = [e[1] for e in recorder.events if e[0] == "fsync"]
    assert any(Path(p).name.startswith(".new.duckdb.") for p in synced), synced  # the file, before its link
    assert str(tmp_path) in synced


def test_a_failed_publication_leaves_the_old_file_and_no_leftover(tmp_path):
    target = tmp_path / "kept.json"
    target.write_text("old")
    with pytest.raises(RuntimeError), publish.publishing(target) as tmp:
        tmp.write_text("half of the new")
        raise RuntimeError("the writer failed")
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["kept.json"]


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    before = os.umask(mask)
    try:
        yield
    finally:
        os.umask(before)


@pytest.mark.parametrize(("mask", "mode"), [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_published_files_get_the_umask_mode(db_path, tmp_path, mask, mode):
    """Exports (each format, also through the CLI), step files (rank, samples, manifest,
    through the library and ``tracedb pack``) and a new database file: ``0o666`` less the
    umask, as any file the process opens."""
    with umask(mask):
        with tracedb.connect(db_path, read_only=True) as db:
            for name in ("e.parquet", "e.arrow", "e.arrows"):
                db.export(tmp_path / name)
            write_step(db.micro_batches(256, ranks=2), tmp_path / "step")
        runner = CliRunner()
        done = runner.invoke(app, ["export", str(tmp_path / "cli.parquet"), "--db", str(db_path)])
        assert done.exit_code == 0, done.output
        done = runner.invoke(
            app, ["pack", "--out", str(tmp_path / "cli-step"), "--seq-len", "256", "--db", str(db_path)]
        )
        assert done.exit_code == 0, done.output
        tracedb.connect(tmp_path / "fresh.duckdb").close()
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(files) >= 12
    modes = {str(p.relative_to(tmp_path)): stat.S_IMODE(p.stat().st_mode) for p in files}
    assert modes == dict.fromkeys(modes, mode), modes
