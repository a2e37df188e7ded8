"""Harness side of counterfactual edit credit: repository snapshots and the intervention.

Plain ``git`` plumbing, run as a subprocess; nothing here reads or writes tracedb.

**Snapshot** (after every assistant turn's actions finished): stage the working tree
into a *private* index file (``GIT_INDEX_FILE``; the agent's own ``.git/index`` is never
read or written) with ``git add -A`` -- tracked changes and non-ignored untracked files
--, ``git write-tree``, and list the changed paths with a no-rename
``git diff-tree -r`` against the previous snapshot's tree. A fresh private index is
seeded from the previous tree (or ``HEAD``), so "tracked" means "in the previous
snapshot": a committed file that matches ``.gitignore`` stays tracked.

**Intervention** (for the selected block of one trace): start a private index from the
final tree, put every path the block touched back to its entry in the pre-block tree --
or remove it when the pre-block tree has no file there (the block created it) -- and
write the tree. Every other path keeps its final content. The patch is the binary diff
of that tree against the task baseline tree; ``git apply`` of it on a checkout of the
baseline gives exactly the intervention artifact. No reverse patching, fuzzy or not:
contents come from the object database by tree entry.

Tree ids are returned as git prints them; to tracedb they are opaque strings compared
for equality (git trees are content addressed, so equal content is an equal id).
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tracedb.errors import TraceDBError


class GitError(TraceDBError):
    """A git command failed; the message has the command and git's own error."""


class InterventionError(GitError):
    """The intervention tree cannot be built (a construction error: the selection is
    unavailable for this trace; record its intervention verification as ``missing``)."""


@dataclass(frozen=True)
class Snapshot:
    """The repository after one turn: its tree id and the paths changed since the previous tree."""

    tree: str
    changed_paths: list[str] = field(default_factory=list)


def git(
    repo: str | Path,
    *args: str,
    index: Path | None = None,
    input: bytes | None = None,
) -> bytes:
    """Run ``git -C repo ARGS`` and return its standard output.

    ``index`` points ``GIT_INDEX_FILE`` at a private index; without it any inherited
    ``GIT_INDEX_FILE`` is removed, so a command can never reach an index by accident.
    Pathspecs are literal (``GIT_LITERAL_PATHSPECS``): a path named ``*.py`` is that path.
    """
    env = dict(os.environ)
    env.pop("GIT_INDEX_FILE", None)
    env["GIT_LITERAL_PATHSPECS"] = "1"
    env["GIT_OPTIONAL_LOCKS"] = "0"
    if index is not None:
        env["GIT_INDEX_FILE"] = str(Path(index).resolve())
    command = ["git", "-C", str(repo), *args]
    result = subprocess.run(command, input=input, capture_output=True, env=env)
    if result.returncode != 0:
        stderr = result.stderr.decode("utf-8", errors="replace").strip()
        raise GitError(f"{' '.join(command)} failed ({result.returncode}): {stderr}")
    return result.stdout


@contextmanager
def _index_file(index_path: str | Path | None) -> Iterator[Path]:
    """The given private index path, or a throwaway one in a temporary directory."""
    if index_path is not None:
        yield Path(index_path).resolve()
        return
    with tempfile.TemporaryDirectory(prefix="tracedb-cec-") as tmp:
        yield Path(tmp) / "index"


def resolve_tree(repo: str | Path, rev: str) -> str:
    """The tree id of a tree, commit or ref (``HEAD``); raises :class:`GitError` if none."""
    return git(repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{tree}}").decode().strip()


def empty_tree(repo: str | Path) -> str:
    """The id of the empty tree in this repository's hash (written to its object store)."""
    return git(repo, "hash-object", "-t", "tree", "-w", "--stdin", input=b"").decode().strip()


def _head_tree(repo: str | Path) -> str | None:
    try:
        return resolve_tree(repo, "HEAD")
    except GitError:
        return None  # an unborn branch


def changed_paths(repo: str | Path, old_tree: str, new_tree: str) -> list[str]:
    """Paths whose entry differs between two trees (content, mode or presence), no rename detection."""
    out = git(repo, "diff-tree", "-r", "-z", "--no-renames", "--name-only", old_tree, new_tree)
    return [p.decode("utf-8", errors="surrogateescape") for p in out.split(b"\0") if p]


def snapshot(
    worktree: str | Path,
    previous_tree: str | None = None,
    index_path: str | Path | None = None,
) -> Snapshot:
    """Snapshot a working tree: ``(tree_id, changed_paths)``.

    ``previous_tree`` is the previous snapshot's tree (for the first turn: the task
    baseline tree); ``None`` diffs against the empty tree, i.e. every file is listed,
    which is what the baseline snapshot itself returns. ``index_path`` is the private
    index to keep between the turns of one rollout (a fresh one makes ``git add`` hash
    every file once); it must not be the agent's ``.git/index``. When it does not exist
    yet it is seeded from ``previous_tree`` (else ``HEAD``).
    """
    worktree = Path(worktree).resolve()
    git_dir, agent_index = (
        Path(line)
        for line in git(worktree, "rev-parse", "--absolute-git-dir", "--git-path", "index").decode().split("\n")[:2]
    )
    if not agent_index.is_absolute():
        agent_index = worktree / agent_index
    with _index_file(index_path) as index:
        if index.resolve() == agent_index.resolve():
            raise GitError(f"{index} is the agent's own index; snapshots use a private index file")
        if index.is_relative_to(worktree) and not index.is_relative_to(git_dir.resolve()):
            raise GitError(f"{index} is inside the working tree, where `git add -A` would stage it; put it elsewhere")
        if not index.exists():
            seed = previous_tree or _head_tree(worktree)
            if seed is not None:
                git(worktree, "read-tree", seed, index=index)
        git(worktree, "add", "-A", index=index)
        tree = git(worktree, "write-tree", index=index).decode().strip()
    base = previous_tree if previous_tree is not None else empty_tree(worktree)
    return Snapshot(tree, changed_paths(worktree, base, tree))


class Recorder:
    """Snapshots of one rollout, turn after turn, with one private index.

    ``baseline()`` before generation, then ``turn()`` after each assistant turn's
    actions finished (``format_error=True`` for a turn that executed nothing: it records
    the previous tree unchanged, without looking at the disk, and so ends a block).
    """

    def __init__(self, worktree: str | Path, index_path: str | Path | None = None) -> None:
        self.worktree = Path(worktree).resolve()
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if index_path is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="tracedb-cec-")
            index_path = Path(self._tmp.name) / "index"
        self.index_path = Path(index_path)
        self.baseline_tree: str | None = None
        self.tree: str | None = None

    def baseline(self) -> str:
        """Snapshot the task baseline (before generation); returns its tree id."""
        self.baseline_tree = self.tree = snapshot(self.worktree, None, self.index_path).tree
        return self.baseline_tree

    def turn(self, *, format_error: bool = False) -> Snapshot:
        """Snapshot after one assistant turn."""
        if self.tree is None:
            raise GitError("Recorder.turn() before Recorder.baseline()")
        if format_error:
            return Snapshot(self.tree, [])
        snap = snapshot(self.worktree, self.tree, self.index_path)
        self.tree = snap.tree
        return snap

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _ls_tree(repo: str | Path, tree: str) -> dict[str, tuple[str, str, str]]:
    """Every non-tree entry of a tree, recursively: path -> (mode, type, object id)."""
    out = git(repo, "ls-tree", "-r", "-z", "--full-tree", tree)
    entries = {}
    for record in out.split(b"\0"):
        if not record:
            continue
        meta, _, path = record.partition(b"\t")
        mode, kind, oid = meta.decode().split(" ")
        entries[path.decode("utf-8", errors="surrogateescape")] = (mode, kind, oid)
    return entries


def intervention_tree(
    repo: str | Path,
    final_tree: str,
    pre_block_tree: str,
    touched_paths: Iterable[str],
) -> str:
    """The final tree with every touched path restored to its pre-block entry (or
    removed where the pre-block tree has no file), every other path as in the final tree.

    Raises :class:`InterventionError` when that is not a valid tree (a restored file
    where a later turn put a directory, or the reverse).
    """
    final_tree = resolve_tree(repo, final_tree)
    pre_block_tree = resolve_tree(repo, pre_block_tree)
    touched = sorted(set(touched_paths))
    before = _ls_tree(repo, pre_block_tree)
    expected = _ls_tree(repo, final_tree)
    for path in touched:
        expected.pop(path, None)
    restored = {path: before[path] for path in touched if path in before}
    # A restored file must not collide with a kept final path (a file where it needs a
    # directory, or a directory where it is a file); git would silently drop the other.
    directories = {"/".join(p.split("/")[:k]) for p in expected for k in range(1, p.count("/") + 1)}
    for path in restored:
        parts = path.split("/")
        ancestors = ["/".join(parts[:k]) for k in range(1, len(parts))]
        clash = next((a for a in ancestors if a in expected), None)
        if clash is not None or path in directories:
            other = clash if clash is not None else f"{path}/..."
            raise InterventionError(
                f"cannot restore {path!r}: the final tree keeps {other!r} there (a later turn replaced a "
                "directory by a file or the reverse)"
            )
    expected.update(restored)
    null = "0" * len(final_tree)
    lines = [f"0 {null}\t{path}" for path in touched if path not in restored]  # removals first
    lines += [f"{mode} {oid}\t{path}" for path, (mode, _, oid) in restored.items()]
    with _index_file(None) as index:
        git(repo, "read-tree", final_tree, index=index)
        if lines:
            payload = "".join(line + "\0" for line in lines).encode("utf-8", errors="surrogateescape")
            try:
                git(repo, "update-index", "-z", "--index-info", index=index, input=payload)
            except GitError as e:
                raise InterventionError(f"cannot restore the block's paths in the final tree: {e}") from None
        try:
            tree = git(repo, "write-tree", index=index).decode().strip()
        except GitError as e:
            raise InterventionError(f"the intervention index does not form a tree: {e}") from None
    if _ls_tree(repo, tree) != expected:  # belt and braces: exactly final minus the block
        raise InterventionError("the intervention tree differs from the final tree with the block's paths restored")
    return tree


def diff_binary(repo: str | Path, old_tree: str, new_tree: str) -> bytes:
    """A binary patch from one tree to another that ``git apply`` takes (no renames,
    full object ids, ``a/``/``b/`` prefixes whatever the user's diff configuration)."""
    return git(
        repo,
        "diff-tree",
        "-p",
        "--binary",
        "--full-index",
        "--no-renames",
        "--no-ext-diff",
        "--no-textconv",
        "--src-prefix=a/",
        "--dst-prefix=b/",
        old_tree,
        new_tree,
    )


def intervene(
    repo: str | Path,
    baseline_tree: str,
    final_tree: str,
    pre_block_tree: str,
    touched_paths: Sequence[str],
) -> bytes:
    """The intervention patch: a binary diff of the intervention tree (see
    :func:`intervention_tree`) against the task baseline tree. Empty when the
    intervention artifact is the baseline itself."""
    tree = intervention_tree(repo, final_tree, pre_block_tree, touched_paths)
    return diff_binary(repo, resolve_tree(repo, baseline_tree), tree)
