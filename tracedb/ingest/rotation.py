"""How a follower knows a file, and finds it again after a rotation.

A followed file is known by its identity (device and inode) and by two hashes of the bytes
it was read from: its first bytes (``head``) and the bytes just before the position
(``tail``), up to :data:`HASH_BYTES` each. :func:`changed` says whether a file still holds
them; it reads at most ``2 * HASH_BYTES`` bytes. A file renamed away is found again by its
identity: through the descriptor the follower holds on it (:class:`OpenFiles`), or among
the entries of its directory (:func:`find_inode`). A copy made by logrotate's
``copytruncate`` has another inode: it is looked for by name (:func:`rotated_names`, the
patterns of :data:`ROTATED`) and taken when its bytes up to the position hash to what was
read (:func:`changed` again).
"""

from __future__ import annotations

import glob
import hashlib
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

HASH_BYTES = 4096
"""How many bytes each of a position's two hashes covers (at most)."""
ROTATED = ("{name}.1", "{name}.[0-9]*", "{name}-[0-9]*")
"""Where a rotated copy of a followed file ``NAME`` is looked for (globs in its
directory): ``NAME.1``, ``NAME.<n>`` (logrotate's numbered copies) and ``NAME-<date>``
(``dateext``). A follower's ``rotated`` patterns are looked at too."""
COMPRESSED = (".gz", ".bz2", ".xz", ".zst", ".lz4", ".Z", ".zip")
"""Rotated names ending so are compressed copies: never read as plain lines."""


def identity(st: os.stat_result) -> tuple[int, int]:
    """A file's (device, inode)."""
    return st.st_dev, st.st_ino


def digest(fd: int, start: int, stop: int) -> bytes | None:
    """BLAKE2b-128 of the file's bytes ``[start, stop)``; None for an empty range, and
    ``b""`` when the file no longer has them all (it is shorter)."""
    if stop <= start:
        return None
    data = os.pread(fd, stop - start, start)
    if len(data) < stop - start:
        return b""
    return hashlib.blake2b(data, digest_size=16).digest()


def head_of(fd: int, offset: int) -> bytes | None:
    """The hash of the first ``min(offset, HASH_BYTES)`` bytes."""
    return digest(fd, 0, min(offset, HASH_BYTES))


def tail_of(fd: int, offset: int) -> bytes | None:
    """The hash of the (up to) ``HASH_BYTES`` bytes just before ``offset``."""
    return digest(fd, max(0, offset - HASH_BYTES), offset)


def changed(fd: int, size: int, offset: int, head: bytes | None, tail: bytes | None) -> str | None:
    """Why the file open on ``fd`` (of ``size`` bytes) no longer holds what was read up to
    ``offset`` (a shrink, or other bytes where the hashes were taken); None when it does.
    A hash that is None was not taken, and is not checked."""
    if size < offset:
        return f"shrunk to {size} bytes (it was read up to byte {offset})"
    if head is not None and head_of(fd, offset) != head:
        return "rewritten (its first bytes changed)"
    if tail is not None and tail_of(fd, offset) != tail:
        return (
            f"rewritten (the bytes before byte {offset}, where it was read up to, changed: truncated and grown again?)"
        )
    return None


def check_patterns(patterns: Iterable[str]) -> tuple[str, ...]:
    """The rotated-name patterns, refused (ValueError) when one names a placeholder other
    than ``{name}`` and ``{stem}``."""
    out = []
    for pattern in patterns:
        try:
            pattern.format(name="x", stem="x")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(
                f"--rotated {pattern!r}: a glob in which {{name}} is the followed file's name and {{stem}} "
                f"that name without .jsonl ({type(e).__name__}: {e})"
            ) from None
        out.append(pattern)
    return tuple(out)


def stem_of(name: str) -> str:
    """A file's name without ``.jsonl`` / ``.jsonl.zst`` / ``.json``."""
    for suffix in (".jsonl.zst", ".jsonl", ".json"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _named(path: Path, patterns: Sequence[str]) -> Iterator[str]:
    base = glob.escape(str(path.parent))
    for pattern in (*patterns, *ROTATED):
        text = pattern.format(name=glob.escape(path.name), stem=glob.escape(stem_of(path.name)))
        yield from glob.glob(text if os.path.isabs(text) else os.path.join(base, text))


def rotated_names(path: Path, patterns: Sequence[str]) -> list[Path]:
    """The plain files the rotated-name patterns (``patterns`` and :data:`ROTATED`) name for
    ``path``, the most recently modified first; compressed ones (:data:`COMPRESSED`) left out."""
    found: dict[str, tuple[int, Path]] = {}
    for hit in _named(path, patterns):
        candidate = Path(hit).absolute()
        if candidate == path or hit.endswith(COMPRESSED) or str(candidate) in found:
            continue
        try:
            st = candidate.stat()
        except OSError:
            continue
        if os.path.isfile(candidate):
            found[str(candidate)] = (st.st_mtime_ns, candidate)
    return [p for _, p in sorted(found.values(), key=lambda t: -t[0])]


def compressed_copies(path: Path, patterns: Sequence[str]) -> list[Path]:
    """The compressed files the rotated-name patterns name for ``path`` (never read)."""
    return sorted({Path(hit) for hit in _named(path, patterns) if hit.endswith(COMPRESSED)})


def find_inode(directory: Path, device: int, inode: int) -> Path | None:
    """The entry of ``directory`` that is the file (device, inode), if any (one scan of the
    directory; an entry's inode is read without a stat, only a match is stat'ed)."""
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                if entry.inode() != inode:
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if st.st_dev == device and entry.is_file(follow_symlinks=False):
                    return Path(entry.path).absolute()
    except OSError:
        return None
    return None


@dataclass
class Watch:
    """What a follower knows of one file (by identity) between polls; not stored."""

    fd: int | None
    size: int = 0
    """Its size at the last poll."""
    behind: bool = False
    """The last read of it stopped at the byte budget."""
    checked: tuple[int, int, int, int] | None = None
    """(offset, size, mtime_ns, ctime_ns) when its position was last found to hold."""
    checked_at: int = 0
    """``time.time_ns()`` of that check."""
    cut_first: bool = False
    """Its first line may be the end of a line cut by a truncation (after copytruncate)."""
    used: float = 0.0
    """``time.monotonic()`` of its last growth (the least used descriptor is closed first)."""


class OpenFiles:
    """The descriptors a follower holds on its plain files (at most ``limit``; past it, the
    files that grew least recently are closed, and found again by name if they move), and
    what it knows of each (:class:`Watch`), by identity."""

    TRUST_S = 1.0
    """A file whose size, mtime and ctime are those of a check made this long after its
    ctime is taken as unchanged without hashing it again (a change after the check would
    have moved its ctime)."""

    def __init__(self, limit: int) -> None:
        self.limit = max(limit, 1)
        self.watches: dict[tuple[int, int], Watch] = {}

    def open(self, path: Path, expected: tuple[int, int] | None = None) -> tuple[int, os.stat_result] | None:
        """A descriptor on ``path`` and its stat (held for later polls), or None when it is
        gone, unreadable, or not the file ``expected`` (it changed since it was listed)."""
        if expected is not None:
            watch = self.watches.get(expected)
            if watch is not None and watch.fd is not None:
                return watch.fd, os.fstat(watch.fd)
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return None
        st = os.fstat(fd)
        key = identity(st)
        if expected is not None and key != expected:
            os.close(fd)
            return None
        watch = self.watches.setdefault(key, Watch(None, used=time.monotonic()))
        if watch.fd is not None:  # held already (opened under another name)
            os.close(fd)
            return watch.fd, os.fstat(watch.fd)
        watch.fd = fd
        self._trim(keep=key)
        return fd, st

    def held(self, key: tuple[int, int]) -> int | None:
        watch = self.watches.get(key)
        return None if watch is None else watch.fd

    def watch(self, key: tuple[int, int]) -> Watch:
        return self.watches.setdefault(key, Watch(None, used=time.monotonic()))

    def trusted(self, key: tuple[int, int], offset: int, st: os.stat_result) -> bool:
        """Whether the file's position was found to hold at exactly this stat, long enough
        after its last change that hashing it again would find nothing new."""
        watch = self.watches.get(key)
        if watch is None or watch.checked != (offset, st.st_size, st.st_mtime_ns, st.st_ctime_ns):
            return False
        return watch.checked_at - st.st_ctime_ns > self.TRUST_S * 1e9

    def checked(self, key: tuple[int, int], offset: int, st: os.stat_result) -> None:
        watch = self.watch(key)
        watch.checked = (offset, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        watch.checked_at = time.time_ns()

    def forget(self, key: tuple[int, int]) -> None:
        """Close the file's descriptor and drop what is known of it."""
        watch = self.watches.pop(key, None)
        if watch is not None and watch.fd is not None:
            os.close(watch.fd)

    def _trim(self, keep: tuple[int, int]) -> None:
        open_ = [(w.used, k) for k, w in self.watches.items() if w.fd is not None and k != keep]
        for _, key in sorted(open_)[: max(0, len(open_) + 1 - self.limit)]:
            watch = self.watches[key]
            assert watch.fd is not None
            os.close(watch.fd)
            watch.fd = None

    def close(self) -> None:
        for watch in self.watches.values():
            if watch.fd is not None:
                os.close(watch.fd)
                watch.fd = None
        self.watches.clear()
