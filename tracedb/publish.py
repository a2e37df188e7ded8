"""Publishing a file: whole or not at all, durable once published, readable as any file.

Every file tracedb hands to someone else (an export, a step's rank files and its
manifest) goes through :func:`publishing`: it is written under a name of its own beside
its target, flushed to the disk (``fsync``), renamed onto the target (atomic: a reader
sees the old file, or none, or the new one whole) and the directory flushed after the
rename, so that the new name survives a crash of the machine too, not only of the
process. The file is created with mode ``0o666`` less the process umask (``0644`` under
the usual ``022``), as ``open()`` gives: a trainer running as another user reads it
(``tempfile.mkstemp`` would give ``0600``).

What a crash of the machine (power loss, kernel panic) can lose: a file whose
:func:`publishing` block had not returned (its target is left as it was: the old file,
or none), and the temporary ``.NAME.*.partial`` file it leaves beside it, which nothing
reads. What it cannot lose: a file whose block returned, nor the order of two
publications (a step's manifest is published after its rank files, so a manifest that
survived a crash names files that did). A filesystem that ignores ``fsync`` (some
network and FUSE mounts, disks with unsafe write caches) keeps none of these promises.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

PARTIAL = ".partial"
"""The suffix of a file being written (``.NAME.<random>.partial`` beside ``NAME``)."""


def create_beside(path: Path) -> Path:
    """A new empty file beside ``path`` under a name no other writer has, created with
    the process umask's mode (``O_CREAT | O_EXCL``, mode ``0o666``: the kernel applies
    the umask). Nothing is ever read from it but by its writer."""
    for _ in range(100):
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}{PARTIAL}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
        except FileExistsError:
            continue
        os.close(fd)
        return tmp
    raise FileExistsError(f"no free temporary name beside {path} after 100 tries")


def sync_file(path: Path) -> None:
    """Flush ``path``'s data and metadata to the disk."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_dir(path: Path) -> None:
    """Flush directory ``path`` (the names in it) to the disk; a no-op where a
    directory cannot be opened (Windows, which makes a rename durable by itself)."""
    if not hasattr(os, "O_DIRECTORY"):
        return
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def publishing(path: str | Path) -> Iterator[Path]:
    """Yield the temporary path to write ``path``'s content to (it exists, empty); when
    the block returns: fsync it, rename it onto ``path``, fsync the directory. When the
    block raises, the temporary file is removed and ``path`` is left as it was::

        with publishing(out / "manifest.json") as tmp:
            tmp.write_text(text)
    """
    path = Path(path)
    tmp = create_beside(path)
    try:
        yield tmp
        sync_file(tmp)
        os.replace(tmp, path)
        sync_dir(path.parent)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)
