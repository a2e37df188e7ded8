"""What the realistic workload's agent says and sees, drawn from the corpus.

:class:`Material` holds the corpus by package (its files' lines, the docstrings' paragraphs
as prose, the names each file defines), the tokenizer and the n-gram model of the
logprobs. :func:`action` makes one tool call and its observation from it: ``read_file``
(numbered lines of a file), ``grep`` (``path:line:text`` matches of a name across the
package), ``edit_file`` (a snippet replaced, and the edited lines shown numbered) and
``run_tests`` (a pytest report whose traceback quotes lines of the task's file).

The n-gram model is fitted on the text in every form the agent writes it: the files as
they are, JSON-escaped (code inside tool-call arguments), the prose paragraphs as one text
per package (the agent's reasoning is a contiguous stretch of it), and the tool calls'
rendering for every file. A policy has learnt its own tool format and writes what it
finds likely; so here most sampled tokens continue a context the model has seen, and the
logprobs have a policy's shape: most near zero, a tail where the text turns.
"""

from __future__ import annotations

import inspect
import json
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import corpus as corpus_mod
from benchmarks import ngram

TOOL_WEIGHTS = {"read_file": 0.45, "grep": 0.2, "edit_file": 0.15, "run_tests": 0.2}
TOOLS = [
    {
        "name": "read_file",
        "description": "Read lines of a file of the repository, numbered.",
        "parameters": {
            "type": "object",
            "properties": {
                "path": {"type": "string", "description": "Path from the repository root."},
                "start": {"type": "integer", "description": "First line (1-based)."},
                "end": {"type": "integer", "description": "Last line, inclusive."},
            },
            "required": ["path"],
        },
    },
    {
        "name": "grep",
        "description": "Search the repository for a pattern; prints path:line:text for each match.",
        "parameters": {
            "type": "object",
            "properties": {"pattern": {"type": "string"}, "path": {"type": "string"}},
            "required": ["pattern"],
        },
    },
    {
        "name": "edit_file",
        "description": "Replace an exact snippet of a file with new text.",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string"}, "old": {"type": "string"}, "new": {"type": "string"}},
            "required": ["path", "old", "new"],
        },
    },
    {
        "name": "run_tests",
        "description": "Run a shell command (tests) in the repository and print its output.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
    },
]
INSTRUCTIONS = (
    "You are an autonomous software engineer working in a Python repository checked out at /repo. "
    "Solve the task you are given by reading the code, running the tests and editing files with the tools "
    "below. Think before each action and explain briefly what you expect to find. Make the smallest change "
    "that fixes the problem, keep the repository's style, and run the tests again before you finish. "
    "When the tests pass, answer with a short account of the cause and the fix, without a tool call."
)
GUARD = "# guard against the case the task describes"
_DOCSTRING = re.compile(r'"""(.*?)"""', re.S)
_DEF = re.compile(r"^\s*(?:async\s+)?def\s+([A-Za-z_]\w*)|^\s*class\s+([A-Za-z_]\w*)", re.M)


def _docs(text: str) -> list[str]:
    out = []
    for m in _DOCSTRING.finditer(text):
        for para in inspect.cleandoc(m.group(1)).split("\n\n"):
            para = para.strip()
            if len(para) >= 40 and not para.startswith((">>>", "..", "Examples", "---")):
                out.append(para)
    return out


@dataclass
class Package:
    """One package of the corpus: the "repository" of the tasks drawn from it."""

    name: str
    files: list[corpus_mod.SourceFile]
    lines: list[list[str]]
    prose: str  # the docstrings' paragraphs, one after the other
    starts: np.ndarray  # where each paragraph of ``prose`` starts
    defs: list[list[str]]  # per file: the names it defines
    weight: float

    def path(self, i: int) -> str:
        return f"{self.name}/{self.files[i].path}"


@dataclass
class Material:
    """What the generator draws from: the corpus by package, the tokenizer, the model."""

    corpus: corpus_mod.Corpus
    encoded: corpus_mod.Encoded
    model: ngram.NGram | None = field(default=None)

    @cached_property
    def packages(self) -> list[Package]:
        out = []
        for name, files in sorted(self.corpus.by_package().items()):
            files = [f for f in files if f.text.count("\n") >= 20]
            if not files:
                continue
            docs = [d for f in files for d in _docs(f.text)] or ["The module's behaviour is documented in its source."]
            prose = "\n\n".join(docs)
            starts = np.cumsum([0] + [len(d) + 2 for d in docs[:-1]])
            out.append(
                Package(
                    name=name,
                    files=files,
                    lines=[f.text.splitlines() for f in files],
                    prose=prose,
                    starts=starts,
                    defs=[[a or b for a, b in _DEF.findall(f.text)] for f in files],
                    weight=sum(len(f.text) for f in files),
                )
            )
        return out

    def model_texts(self) -> list[str]:
        """What the model is fitted on besides the files as they are (see the module doc)."""
        texts = [json.dumps(f.text, ensure_ascii=False)[1:-1] for f in self.corpus.files]
        texts += [p.prose for p in self.packages]
        for p in self.packages:
            calls = []
            for i in range(len(p.files)):
                path = p.path(i)
                for args in (
                    {"path": path, "start": 1, "end": 80},
                    {"pattern": (p.defs[i] or ["main"])[0], "path": p.name},
                    {"path": path, "old": p.lines[i][0], "new": f"{GUARD}\n{p.lines[i][0]}"},
                    {"command": f"python -m pytest -x -q tests/test_{Path(path).stem}.py"},
                ):
                    name = next(t["name"] for t in TOOLS if set(args) <= set(t["parameters"]["properties"]))
                    calls.append(render_call(name, json.dumps(args, ensure_ascii=False)))
            texts.append("\n".join(calls))
        return texts

    def fit(self, log: Any = print) -> None:
        enc = self.encoded
        path = enc.path.with_name(enc.path.stem + ".model.npz")
        extra = corpus_mod.encode_cached(enc.tokenizer, enc.sha256, self.model_texts(), path, log=log)
        self.model = ngram.NGram.fit(enc.ids + extra, enc.vocab_size)

    def ids(self, text: str) -> np.ndarray:
        return np.asarray(self.encoded.tokenizer.encode(text).ids, np.int64)

    def decode(self, ids: np.ndarray) -> str:
        return self.encoded.tokenizer.decode(ids.tolist(), skip_special_tokens=False)

    def cut(self, text: str, limit: int) -> tuple[np.ndarray, str]:
        """``text``'s tokens, at most ``limit`` of them, and their decode (the content)."""
        ids = self.ids(text)[: max(1, limit)]
        return ids, self.decode(ids)


def render_call(name: str, arguments: str) -> str:
    """A tool call as the chat template renders it after the assistant's text."""
    return (
        "\n<tool_call>\n"
        + json.dumps({"name": name, "arguments": json.loads(arguments)}, ensure_ascii=False)
        + ("\n</tool_call>")
    )


def prose(p: Package, rng: np.random.Generator, chars: int) -> str:
    """A stretch of the package's prose from the start of a paragraph, about ``chars`` long."""
    at = int(p.starts[int(rng.integers(len(p.starts)))])
    text = p.prose[at : at + chars]
    return text if len(text) >= chars // 2 else p.prose[:chars]


def frame(p: Package, i: int, func: str, rng: np.random.Generator) -> str:
    """A traceback frame quoting a line of file ``i``."""
    lines = p.lines[i]
    n = int(rng.integers(len(lines)))
    return f'  File "/repo/{p.path(i)}", line {n + 1}, in {func}\n    {lines[n].strip()}'


def _file_for(p: Package, target: int, rng: np.random.Generator) -> int:
    u = rng.random()
    if u < 0.5:
        return target
    if u < 0.8:
        folder = p.files[target].path.rpartition("/")[0]
        near = [i for i, f in enumerate(p.files) if f.path.rpartition("/")[0] == folder]
        return int(near[int(rng.integers(len(near)))])
    return int(rng.integers(len(p.files)))


def _window(lines: list[str], rng: np.random.Generator, chars: int) -> tuple[int, int]:
    start = int(rng.integers(max(1, len(lines) - 5)))
    end, size = start, 0
    while end < len(lines) and size < chars:
        size += len(lines[end]) + 8
        end += 1
    return start, max(end, start + 1)


def _numbered(lines: list[str], start: int, end: int) -> str:
    return "\n".join(f"{n + 1:>6}\t{lines[n]}" for n in range(start, min(end, len(lines))))


def _grep(p: Package, pattern: str, chars: int) -> str:
    hits, size = [], 0
    for j, lines in enumerate(p.lines):
        for n, line in enumerate(lines):
            if pattern in line:
                hits.append(f"{p.path(j)}:{n + 1}:{line}")
                size += len(hits[-1])
                if size >= chars:
                    return "\n".join(hits)
    return "\n".join(hits) or "(no matches)"


def action(
    p: Package, target: int, func: str, rng: np.random.Generator, budget: int, call_id: str
) -> tuple[dict[str, Any], str, str]:
    """A tool call, its observation (about ``budget`` tokens) and a note for a summary."""
    names = list(TOOL_WEIGHTS)
    name = names[int(rng.choice(len(names), p=np.array(list(TOOL_WEIGHTS.values()))))]
    chars = int(budget * 4.2)
    i = _file_for(p, target, rng)
    lines, path = p.lines[i], p.path(i)
    if name == "read_file":
        a, b = _window(lines, rng, chars)
        args: dict[str, Any] = {"path": path, "start": a + 1, "end": b}
        out, note = _numbered(lines, a, b), f"read {path} lines {a + 1}-{b}"
    elif name == "grep":
        names_here = p.defs[i] or [func]
        pattern = names_here[int(rng.integers(len(names_here)))]
        args = {"pattern": pattern, "path": p.name}
        out, note = _grep(p, pattern, chars), f"searched for {pattern}"
    elif name == "edit_file":
        a, b = _window(lines, rng, min(chars, 900))
        old = "\n".join(lines[a:b])
        indent = re.match(r"\s*", lines[a]).group(0) if lines[a:b] else ""
        new = f"{indent}{GUARD}\n{old}"
        args = {"path": path, "old": old, "new": new}
        edited = lines[:a] + new.split("\n") + lines[b:]
        shown = _numbered(edited, max(0, a - 4), min(len(edited), b + 5))
        out = f"The file {path} has been edited. Here is the result of `cat -n` on a snippet of it:\n{shown}"
        note = f"edited {path} around line {a + 1}"
    else:
        test = f"tests/test_{Path(p.files[target].path).stem}.py"
        args = {"command": f"python -m pytest -x -q {test}"}
        frames, size = [], 0
        while size < chars:
            frames.append(frame(p, target if rng.random() < 0.7 else i, func, rng))
            size += len(frames[-1])
        passed = int(rng.integers(3, 60))
        rule = "=" * 29
        out = (
            f"{rule} test session starts {rule}\ncollected {passed + 1} items\n\n{test} {'.' * passed}F\n\n"
            f"{rule}===== FAILURES ====={rule}\nTraceback (most recent call last):\n"
            + "\n".join(frames)
            + f"\nAssertionError: unexpected result from {func}\n{rule} 1 failed, {passed} passed {rule}"
        )
        note = f"ran {test}: 1 failed, {passed} passed"
    call = {"id": call_id, "name": name, "arguments": json.dumps(args, ensure_ascii=False)}
    return call, out, note
