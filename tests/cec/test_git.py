"""Harness git plumbing on real repositories: snapshots into a private index, edit blocks
from those snapshots, and intervention patches checked by applying them to a fresh clone
of the baseline and comparing every file with the expected artifact, computed from the
files on disk (not from git): the final files with the block's paths put back."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

import tracedb
from tracedb import cec
from tracedb.cec.cli import app
from tracedb.cec.git import InterventionError, Recorder, intervene, resolve_tree, snapshot

from support import FIXTURES


@pytest.fixture(autouse=True)
def _hermetic_git(monkeypatch, tmp_path):
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(tmp_path / "gitconfig"))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    for key in ("GIT_AUTHOR", "GIT_COMMITTER"):
        monkeypatch.setenv(f"{key}_NAME", "Test")
        monkeypatch.setenv(f"{key}_EMAIL", "test@example.com")
    monkeypatch.delenv("GIT_INDEX_FILE", raising=False)
    monkeypatch.delenv("GIT_DIR", raising=False)


def run(cwd: Path, *args: str, input: bytes | None = None) -> bytes:
    return subprocess.run(["git", "-C", str(cwd), *args], check=True, capture_output=True, input=input).stdout


def files(root: Path) -> dict[str, tuple[bytes, bool]]:
    """Every file under root except .git: path -> (content, executable)."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if rel == ".git" or rel.startswith(".git/") or not p.is_file():
            continue
        out[rel] = (p.read_bytes(), bool(p.stat().st_mode & stat.S_IXUSR))
    return out


class Agent:
    """A repository with a committed baseline, edited turn by turn, snapshotted after each."""

    def __init__(self, root: Path, baseline: dict[str, str | bytes], force: tuple[str, ...] = ()) -> None:
        self.root = root
        root.mkdir()
        run(root, "init", "-q")
        for path, content in baseline.items():
            self.write(path, content)
        run(root, "add", "-A")
        for path in force:  # committed although ignored
            run(root, "add", "-f", path)
        run(root, "commit", "-q", "-m", "baseline")
        self.recorder = Recorder(root, index_path=root.parent / f"{root.name}.cec-index")
        self.baseline = self.recorder.baseline()
        self.states = [files(root)]  # files after each turn; [0] is the baseline
        self.turns: list[cec.Turn] = []

    def write(self, path: str, content: str | bytes) -> None:
        p = self.root / path
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(content.encode() if isinstance(content, str) else content)

    def delete(self, path: str) -> None:
        (self.root / path).unlink()

    def turn(self, action: Callable[[], None] | None = None, *, format_error: bool = False) -> cec.Turn:
        if action is not None:
            action()
        snap = self.recorder.turn(format_error=format_error)
        turn = cec.Turn(2 * len(self.turns) + 2, snap.tree, tuple(snap.changed_paths), format_error)
        self.turns.append(turn)
        self.states.append(files(self.root))
        return turn

    def blocks(self) -> list[cec.Block]:
        return cec.edit_blocks(self.turns, self.baseline)

    def state_before(self, block: cec.Block) -> dict[str, tuple[bytes, bool]]:
        first = [t.node for t in self.turns].index(block.nodes[0])
        return self.states[first]

    def expected(self, block: cec.Block) -> dict[str, tuple[bytes, bool]]:
        """The final files with every path the block touched as it was before the block."""
        final, before = dict(self.states[-1]), self.state_before(block)
        for path in block.paths:
            if path in before:
                final[path] = before[path]
            else:
                final.pop(path, None)
        return final

    def applied(self, block: cec.Block, tmp_path: Path) -> dict[str, tuple[bytes, bool]]:
        """Apply the intervention patch to a fresh clone of the baseline; its files."""
        patch = intervene(self.root, self.baseline, self.turns[-1].tree, block.pre_tree, block.paths)
        clone = tmp_path / f"clone-{block.index}"
        subprocess.run(["git", "clone", "-q", str(self.root), str(clone)], check=True, capture_output=True)
        if patch:
            run(clone, "apply", "--binary", "-", input=patch)
        return files(clone)


def _eligible(blocks: list[cec.Block]) -> dict[int, tuple[str, ...]]:
    return {b.index: b.reasons for b in blocks}


# --------------------------------------------------------------------------- snapshots


def test_snapshot_uses_a_private_index_and_sees_tracked_and_untracked_files(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    baseline = {"a.py": "a = 1\n", ".gitignore": "*.log\nbuild/\n", "keep.log": "tracked though ignored\n"}
    agent = Agent(repo, baseline, force=("keep.log",))
    assert "keep.log" in run(repo, "ls-tree", "-r", "--name-only", agent.baseline).decode().split()
    agent_index = repo / ".git" / "index"

    # The agent stages something of its own; snapshots must neither read nor change that.
    agent.write("a.py", "a = 2\n")
    run(repo, "add", "a.py")
    staged = agent_index.read_bytes()
    agent.write("a.py", "a = 3\n")  # and edits again without staging
    agent.write("new.py", "untracked\n")
    agent.write("debug.log", "ignored\n")
    agent.write("build/out.o", "ignored dir\n")
    agent.write("keep.log", "tracked, changed\n")
    before = (agent_index.read_bytes(), agent_index.stat().st_mtime_ns)
    turn = agent.turn()
    assert (agent_index.read_bytes(), agent_index.stat().st_mtime_ns) == before
    assert agent_index.read_bytes() == staged
    assert sorted(turn.changed_paths) == ["a.py", "keep.log", "new.py"]
    listed = run(repo, "ls-tree", "-r", "--name-only", turn.tree).decode().split()
    assert "debug.log" not in listed and "build/out.o" not in listed
    assert run(repo, "show", f"{turn.tree}:a.py") == b"a = 3\n"  # the working tree, not the agent's index

    # Nothing changed: the same tree, no paths; a format-error turn does not even look.
    again = agent.turn()
    assert again.tree == turn.tree and again.changed_paths == ()
    agent.write("a.py", "a = 4\n")
    skipped = agent.turn(format_error=True)
    assert skipped.tree == turn.tree and skipped.changed_paths == ()
    after = agent.turn()
    assert after.changed_paths == ("a.py",)


def test_snapshot_refuses_the_agents_own_index(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    Agent(repo, {"a.py": "x\n"})
    with pytest.raises(tracedb.TraceDBError, match="agent's own index"):
        snapshot(repo, None, repo / ".git" / "index")
    with pytest.raises(tracedb.TraceDBError, match="inside the working tree"):
        snapshot(repo, None, repo / "cec.index")
    assert snapshot(repo, None, repo / ".git" / "cec-private.index").changed_paths == ["a.py"]  # inside .git is fine


def test_snapshot_without_previous_lists_every_file_and_a_fresh_index_works(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    agent = Agent(repo, {"a.py": "x\n", "d/b.py": "y\n"})
    first = snapshot(repo)  # throwaway private index
    assert first.tree == agent.baseline == resolve_tree(repo, "HEAD")
    assert first.changed_paths == ["a.py", "d/b.py"]
    agent.write("d/b.py", "z\n")
    assert snapshot(repo, agent.baseline).changed_paths == ["d/b.py"]


# --------------------------------------------------------------------------- blocks + interventions


BASE = {
    "src/app.py": "def app():\n    return 1\n",
    "src/util.py": "def util():\n    return 2\n",
    "README.md": "readme\n",
    "tests/test_app.py": "def test_app():\n    assert True\n",
}


def test_block_that_creates_a_file(tmp_path: Path) -> None:
    agent = Agent(tmp_path / "repo", BASE)
    agent.turn(lambda: agent.write("src/new.py", "NEW = 1\n"))  # block 0 creates a file
    agent.turn()  # a read-only turn ends it
    agent.turn(lambda: agent.write("README.md", "better readme\n"))  # block 1, another surviving edit
    blocks = agent.blocks()
    assert _eligible(blocks) == {0: (), 1: ()}
    assert blocks[0].paths == ("src/new.py",) and blocks[0].nodes == (2,)
    result = agent.applied(blocks[0], tmp_path)
    assert result == agent.expected(blocks[0])
    assert "src/new.py" not in result and result["README.md"][0] == b"better readme\n"


def test_block_that_deletes_a_file(tmp_path: Path) -> None:
    agent = Agent(tmp_path / "repo", BASE)
    agent.turn(lambda: agent.write("src/app.py", "def app():\n    return 10\n"))
    agent.turn(lambda: agent.delete("src/util.py"))  # same block: consecutive edit turns
    agent.turn()
    blocks = agent.blocks()
    assert len(blocks) == 1 and blocks[0].nodes == (2, 4)
    assert blocks[0].paths == ("src/app.py", "src/util.py") and blocks[0].eligible
    result = agent.applied(blocks[0], tmp_path)
    assert result == agent.expected(blocks[0])
    assert result["src/util.py"][0] == BASE["src/util.py"].encode()  # the deleted file is back


def test_block_that_edits_and_restores(tmp_path: Path) -> None:
    agent = Agent(tmp_path / "repo", BASE)
    # Block 0: edits app.py and restores it within the block: no net effect, not eligible.
    agent.turn(lambda: agent.write("src/app.py", "broken\n"))
    agent.turn(lambda: agent.write("src/app.py", BASE["src/app.py"]))
    agent.turn()
    # Block 1: edits util.py and restores it, but also adds a file: eligible, and every
    # path it touched counts (restoring util.py to its pre-block content changes nothing).
    agent.turn(lambda: (agent.write("src/util.py", "temp\n"), agent.write("docs.txt", "doc\n")))
    agent.turn(lambda: agent.write("src/util.py", BASE["src/util.py"]))
    blocks = agent.blocks()
    assert _eligible(blocks) == {0: ("no_net_effect",), 1: ()}
    assert blocks[0].pre_tree == blocks[0].post_tree
    assert blocks[1].paths == ("docs.txt", "src/util.py")
    result = agent.applied(blocks[1], tmp_path)
    assert result == agent.expected(blocks[1]) == files_of(BASE)


def files_of(contents: dict[str, str]) -> dict[str, tuple[bytes, bool]]:
    return {k: (v.encode(), False) for k, v in sorted(contents.items())}


def test_block_that_touches_a_test_path(tmp_path: Path) -> None:
    agent = Agent(tmp_path / "repo", BASE)
    agent.turn(lambda: (agent.write("src/app.py", "x = 1\n"), agent.write("tests/test_app.py", "# weakened\n")))
    agent.turn()
    agent.turn(lambda: agent.write("src/conftest.py", "# fixture\n"))
    agent.turn()
    agent.turn(lambda: agent.write("src/util.py", "y = 2\n"))
    assert _eligible(agent.blocks()) == {0: ("test_path",), 1: ("test_path",), 2: ()}


def test_block_overwritten_later_is_not_eligible_even_if_undone(tmp_path: Path) -> None:
    agent = Agent(tmp_path / "repo", BASE)
    agent.turn(lambda: agent.write("src/app.py", "v1\n"))  # block 0
    agent.turn()
    agent.turn(lambda: agent.write("src/app.py", "v2\n"))  # block 1 overwrites block 0's path
    agent.turn()
    agent.turn(lambda: agent.write("src/util.py", "u1\n"))  # block 2
    agent.turn()
    agent.turn(lambda: agent.write("src/util.py", "tmp\n"))  # block 3 changes util.py ...
    agent.turn()
    agent.turn(lambda: agent.write("src/util.py", "u1\n"))  # ... block 4 undoes that: block 2 is still out
    blocks = agent.blocks()
    assert _eligible(blocks) == {0: ("modified_later",), 1: (), 2: ("modified_later",), 3: ("modified_later",), 4: ()}
    result = agent.applied(blocks[1], tmp_path)
    assert result == agent.expected(blocks[1])
    assert result["src/app.py"][0] == b"v1\n"  # back to the pre-block (block 0's) content


def test_block_that_repairs_earlier_damage(tmp_path: Path) -> None:
    agent = Agent(tmp_path / "repo", BASE)
    agent.turn(lambda: agent.write("src/util.py", "def util(:\n"))  # block 0 damages util.py
    agent.turn()
    agent.turn(lambda: agent.write("src/app.py", "def app():\n    return 3\n"))  # block 1, the fix
    agent.turn()
    agent.turn(lambda: agent.write("src/util.py", BASE["src/util.py"]))  # block 2 repairs the damage
    blocks = agent.blocks()
    assert _eligible(blocks) == {0: ("modified_later",), 1: (), 2: ()}
    # The final patch does not mention util.py, yet block 2 is a surviving edit of it.
    final_paths = run(agent.root, "diff-tree", "-r", "--name-only", agent.baseline, agent.turns[-1].tree).split()
    assert final_paths == [b"src/app.py"]
    result = agent.applied(blocks[2], tmp_path)
    assert result == agent.expected(blocks[2])
    assert result["src/util.py"][0] == b"def util(:\n"  # removing the repair reintroduces the damage
    assert result["src/app.py"][0] == b"def app():\n    return 3\n"  # other final files stay


def test_binary_files_and_modes_are_restored(tmp_path: Path) -> None:
    blob = bytes(range(256)) * 8
    agent = Agent(tmp_path / "repo", {**BASE, "data.bin": blob, "run.sh": "#!/bin/sh\necho hi\n"})
    script = agent.root / "run.sh"

    def edit() -> None:
        agent.write("data.bin", blob[::-1] + b"\0tail")
        script.chmod(script.stat().st_mode | stat.S_IXUSR)
        agent.write("img/new.bin", b"\x89PNG\0\0\1")

    agent.turn(edit)
    agent.turn()
    agent.turn(lambda: agent.write("src/app.py", "z = 0\n"))
    blocks = agent.blocks()
    assert blocks[0].paths == ("data.bin", "img/new.bin", "run.sh")
    result = agent.applied(blocks[0], tmp_path)
    assert result == agent.expected(blocks[0])
    assert result["data.bin"][0] == blob and not result["run.sh"][1] and "img/new.bin" not in result


def test_only_surviving_change_gives_an_empty_patch(tmp_path: Path) -> None:
    agent = Agent(tmp_path / "repo", BASE)
    agent.turn(lambda: agent.write("src/app.py", "fixed\n"))
    (block,) = agent.blocks()
    assert intervene(agent.root, agent.baseline, agent.turns[-1].tree, block.pre_tree, block.paths) == b""
    assert agent.applied(block, tmp_path) == files_of(BASE)


def test_directory_replaced_by_a_file_later_is_a_construction_error(tmp_path: Path) -> None:
    agent = Agent(tmp_path / "repo", {"pkg/mod.py": "m\n", "a.py": "a\n"})
    agent.turn(lambda: (agent.delete("pkg/mod.py"), (agent.root / "pkg").rmdir()))  # block 0 empties pkg/
    agent.turn()
    agent.turn(lambda: agent.write("pkg", "now a file\n"))  # a later turn makes pkg a file
    blocks = agent.blocks()
    assert blocks[0].eligible  # different paths: pkg/mod.py vs pkg
    with pytest.raises(InterventionError, match="pkg/mod.py"):
        intervene(agent.root, agent.baseline, agent.turns[-1].tree, blocks[0].pre_tree, blocks[0].paths)


def test_paths_with_spaces_and_glob_characters(tmp_path: Path) -> None:
    agent = Agent(tmp_path / "repo", {**BASE, "odd name [1].py": "x\n", "*.py": "star\n"})
    agent.turn(lambda: (agent.write("odd name [1].py", "y\n"), agent.write("ünï cödé.py", "u\n")))
    agent.turn()
    agent.turn(lambda: agent.write("*.py", "changed star\n"))
    blocks = agent.blocks()
    assert blocks[0].paths == ("odd name [1].py", "ünï cödé.py")
    result = agent.applied(blocks[0], tmp_path)
    assert result == agent.expected(blocks[0])
    assert result["*.py"][0] == b"changed star\n"


# --------------------------------------------------------------------------- harness to database


def test_harness_records_through_plan_to_the_intervention(tmp_path: Path) -> None:
    """A real repository drives one fixture trace: snapshots become turn records, the plan
    selects a block, and the planned query builds the patch that removes exactly it."""
    template = json.loads((FIXTURES / "groups.traces.jsonl").read_text().splitlines()[0])
    trace = template["traces"][0]
    trace_id = trace["id"]
    nodes = [i for i, n in enumerate(trace["nodes"]) if n["message"]["role"] == "assistant"]
    assert nodes == [2, 4, 6, 8, 10]
    agent = Agent(tmp_path / "repo", BASE)
    actions = [
        lambda: agent.write("src/app.py", "def app():\n    return 42\n"),
        None,
        lambda: agent.write("src/extra.py", "EXTRA = True\n"),
        lambda: agent.write("tests/test_new.py", "def test_new():\n    pass\n"),
        None,
    ]
    records = [
        {
            "kind": "trace",
            "trace_id": trace_id,
            "baseline_tree": agent.baseline,
            "instance_id": "repo__issue-1",
            "rep": 0,
            "cache_salt": "salt",
        }
    ]
    for node, action in zip(nodes, actions):
        snap = agent.turn(action)
        records.append(
            {
                "kind": "turn",
                "trace_id": trace_id,
                "node": node,
                "tree": snap.tree,
                "changed_paths": list(snap.changed_paths),
                "format_error": False,
            }
        )
    report = {"t1": "PASSED"}
    records.append(
        {"kind": "verification", "trace_id": trace_id, "role": "original", "resolved": True, "f2p": report, "p2p": {}}
    )
    path = tmp_path / "cec.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    with tracedb.connect(tmp_path / "db.duckdb") as db:
        assert db.ingest(FIXTURES / "groups.traces.jsonl").ok
        assert cec.ingest_records(db, path).ok
        cec.plan(db)
        (query,) = cec.queries(db)
    assert query["trace_id"] == trace_id
    # Block 0 (app.py) is eligible; block 1 (extra.py + a test file) is not.
    assert query["block"] == 0 and query["nodes"] == [2] and query["touched_paths"] == ["src/app.py"]
    patch = intervene(
        agent.root, query["baseline_tree"], query["final_tree"], query["pre_block_tree"], query["touched_paths"]
    )
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(agent.root), str(clone)], check=True, capture_output=True)
    run(clone, "apply", "--binary", "-", input=patch)
    block = agent.blocks()[0]
    assert files(clone) == agent.expected(block)
    assert files(clone)["src/app.py"][0] == BASE["src/app.py"].encode()
    assert "src/extra.py" in files(clone)
    assert os.path.exists(clone / "tests" / "test_new.py")

    # The same through the commands.
    runner = CliRunner()
    out = tmp_path / "cf.patch"
    result = runner.invoke(
        app, ["intervene", str(agent.root), trace_id, "--db", str(tmp_path / "db.duckdb"), "-o", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert out.read_bytes() == patch
    result = runner.invoke(app, ["intervene", str(agent.root), "no-such-trace", "--db", str(tmp_path / "db.duckdb")])
    assert result.exit_code == 1 and "no planned query" in result.output
    agent.write("src/app.py", "changed again\n")
    result = runner.invoke(app, ["snapshot", str(agent.root), "--previous", query["final_tree"]])
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    assert printed["changed_paths"] == ["src/app.py"]
    assert printed["tree"] == snapshot(agent.root, query["final_tree"]).tree
