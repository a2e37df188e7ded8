"""The realistic workload: agent-shaped rollouts of real text, written by verifiers itself.

The text is the pinned corpus (:mod:`benchmarks.corpus`: Python sources of installed
packages), tokenized by a byte-level BPE trained on it. Each group of 8 traces is one task
in one package (a "repository"): the run shares one system prompt (instructions and the
four tools' schemas), the group one task prompt (a function of a file of that package and
a failing test). A trace has 20-60 turns: the assistant's text (docstrings of the package,
as its reasoning) and a tool call (``read_file``, ``grep``, ``edit_file`` with code from the
corpus, ``run_tests``), each answered by an observation (numbered file lines, grep
matches, the edited snippet, a pytest report quoting the file). Past 40% of the trace's
tokens on one branch the agent compacts, as :mod:`tracedb.synthetic` does: the summary is a
dangling leaf (``compaction_attempt``) and a new branch resumes from the system prompt
with the task and the summary (``compaction``).

Tokens: every node is the chat template's rendering (``<|im_start|>role\\n`` ...
``<|im_end|>``), its ``message.content`` exactly the decode of its content tokens (a tool
call's JSON follows the content in the assistant's tokens, as a template renders it). The
assistant's scaffold (``\\n<|im_start|>assistant\\n``) is unsampled, the rest sampled, with
logprobs from an n-gram model (:mod:`benchmarks.ngram`, order 5, fitted on the corpus in
the forms the agent writes it: :mod:`benchmarks.agent`), which verifiers'
``write_episode`` rounds to its 4 decimals (``RECORD_FLOAT_DECIMALS``). Rewards are 0/1 with a
difficulty per task; advantages are GRPO's ``r - mean(r)`` over the group.

Deterministic: the run's parts come from ``seed`` and each group's from ``(seed, group)``
alone, so the same seed writes the same bytes, and a run of more traces starts with the
traces of a smaller one.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from functools import cached_property
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import agent, ngram
from benchmarks import corpus as corpus_mod
from benchmarks.agent import TOOLS, Material, render_call
from benchmarks.workload import TRACES_FILE

T0 = 1_795_949_995.0


class _Trace:
    """One trace's nodes as verifiers records them, built turn by turn."""

    def __init__(self, m: Material, rng: np.random.Generator, t0: float) -> None:
        self.m = m
        self.rng = rng
        self.t = t0
        self.nodes: list[dict[str, Any]] = []
        self.start = m.encoded.special("<|im_start|>")
        self.end = m.encoded.special("<|im_end|>")
        self.newline = m.ids("\n")
        self.input_tokens = 0
        self.output_tokens = 0

    def _head(self, role: str, first: bool) -> np.ndarray:
        lead = np.zeros(0, np.int64) if first else self.newline
        return np.concatenate([lead, [self.start], self.m.ids(f"{role}\n")]).astype(np.int64)

    def _node(self, parent: int | None, message: dict[str, Any], ids: np.ndarray, **extra: Any) -> int:
        node: dict[str, Any] = {}
        if parent is not None:
            node["parent"] = parent
        if "tools" in extra:
            node["tools"] = extra.pop("tools")
        node["semantic_parents"] = extra.pop("semantic_parents", [])
        node["message"] = message
        node["sampled"] = False
        node["timestamp"] = self.t
        node["token_ids"] = ids.tolist()
        node["mask"] = [False] * len(ids)
        node["logprobs"] = []
        node["is_content"] = []
        self.nodes.append(node)
        return len(self.nodes) - 1

    def prompt(self, parent: int | None, role: str, ids: np.ndarray, content: str, **extra: Any) -> int:
        """An unsampled message: system, user or tool."""
        self.t += float(self.rng.exponential(0.4))
        body = np.concatenate([self._head(role, parent is None), ids, [self.end]]).astype(np.int64)
        message: dict[str, Any] = {"role": role, "content": content}
        if role == "tool":
            message = {"role": "tool", "tool_call_id": extra.pop("tool_call_id"), "content": content}
        return self._node(parent, message, body, **extra)

    def assistant(
        self, parent: int, context: int, text_ids: np.ndarray, content: str, call: dict[str, Any] | None, **extra: Any
    ) -> int:
        """A sampled assistant turn: scaffold unsampled, content (+ tool call) sampled."""
        self.t += float(self.rng.gamma(2.0, 2.5))
        scaffold = self._head("assistant", False)
        parts = [text_ids]
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if call is not None:
            parts.append(self.m.ids(render_call(call["name"], call["arguments"])))
            message["tool_calls"] = [
                {"id": call["id"], "type": "function", "name": call["name"], "arguments": call["arguments"]}
            ]
        sampled = np.concatenate([*parts, [self.end]]).astype(np.int64)
        i = self._node(parent, message, np.concatenate([scaffold, sampled]), **extra)
        node = self.nodes[i]
        node["sampled"] = True
        node["mask"] = [False] * len(scaffold) + [True] * len(sampled)
        assert self.m.model is not None
        node["logprobs"] = self.m.model.logprobs(scaffold, sampled).tolist()
        self.input_tokens += context + len(scaffold)
        self.output_tokens += len(sampled)
        return i


@dataclass(frozen=True)
class Shape:
    """Sizes of one trace, scaled from ``tokens`` (30k: the issue's figures)."""

    tokens: int
    system: int
    task: int
    turns: tuple[int, int]
    compaction_every: int

    @classmethod
    def of(cls, tokens: int) -> Shape:
        lo = max(2, min(20, tokens // 1_500))
        hi = max(lo + 1, min(60, tokens // 500))
        return cls(
            tokens=tokens,
            system=min(1_500, max(24, tokens // 20)),
            task=min(300, max(16, tokens // 100)),
            turns=(lo, hi),
            compaction_every=max(256, int(tokens * 0.4)),
        )


class _Group:
    """One task (a function of a file of a package) and its members' traces."""

    def __init__(self, m: Material, shape: Shape, system: tuple[np.ndarray, str], seed: int, g: int) -> None:
        self.m, self.shape, self.system, self.g = m, shape, system, g
        self.rng = np.random.default_rng([seed, 1, g])
        weights = np.array([p.weight for p in m.packages])
        self.pkg = m.packages[int(self.rng.choice(len(weights), p=weights / weights.sum()))]
        with_defs = [i for i, d in enumerate(self.pkg.defs) if d] or list(range(len(self.pkg.files)))
        self.target = int(with_defs[int(self.rng.integers(len(with_defs)))])
        names = self.pkg.defs[self.target] or ["main"]
        self.func = names[int(self.rng.integers(len(names)))]
        self.difficulty = float(self.rng.uniform(0.15, 0.85))
        self.task_ids, self.task_text = m.cut(self._task_text(), shape.task)

    def _task_text(self) -> str:
        doc = agent.prose(self.pkg, self.rng, 400).split("\n\n")[0]
        frames = "\n".join(agent.frame(self.pkg, self.target, self.func, self.rng) for _ in range(8))
        return (
            f"The repository is `{self.pkg.name}`. `{self.func}` in `{self.pkg.path(self.target)}` does not behave "
            f"as documented:\n\n> {doc}\n\nReproduce the failure with the tests, find the cause and fix it. "
            f"The failing test prints:\n\n```\nTraceback (most recent call last):\n{frames}\n"
            f"AssertionError: unexpected result from {self.func}\n```"
        )

    def task(self) -> dict[str, Any]:
        return {
            "type": "SWETask",
            "data": {"idx": self.g, "prompt": self.task_text, "repo": self.pkg.name, "skills": ["python", "debugging"]},
        }


def _trace_nodes(g: _Group, member: int, seed: int) -> tuple[_Trace, int]:
    shape, m = g.shape, g.m
    rng = np.random.default_rng([seed, 2, g.g, member])
    tr = _Trace(m, rng, T0 + 3_600.0 * g.g + float(rng.uniform(0, 60)))
    root = tr.prompt(None, "system", *g.system, tools=TOOLS)
    last = tr.prompt(root, "user", g.task_ids, g.task_text)
    branch = total = len(tr.nodes[root]["token_ids"]) + len(tr.nodes[last]["token_ids"])
    turns = int(rng.integers(shape.turns[0], shape.turns[1] + 1))
    notes: list[str] = []
    for turn in range(turns):
        per_turn = max(24, (shape.tokens - total) // max(1, turns - turn))
        if branch > shape.compaction_every:
            summary = "Summary of the work so far: " + "; ".join(notes) + ". The cause is not fixed yet."
            ids, text = m.cut(summary, max(16, per_turn // 3))
            attempt = tr.assistant(
                last, branch, ids, text, None, semantic_parents=[{"node": last, "type": "compaction_attempt"}]
            )
            resume_ids, resume = m.cut(f"{g.task_text}\n\n{text}", shape.task + len(ids))
            last = tr.prompt(
                root, "user", resume_ids, resume, semantic_parents=[{"node": attempt, "type": "compaction"}]
            )
            total += len(tr.nodes[attempt]["token_ids"]) + len(tr.nodes[last]["token_ids"])
            branch = len(tr.nodes[root]["token_ids"]) + len(tr.nodes[last]["token_ids"])
            notes = []
        think = int(min(per_turn // 3, rng.integers(24, 160)))
        ids, text = m.cut(agent.prose(g.pkg, rng, 5 * think), max(8, think))
        if turn == turns - 1:
            done = f"{text}\n\nThe tests pass now: the fix is in `{g.pkg.path(g.target)}` ({g.func})."
            ids, text = m.cut(done, len(ids) + 40)
            last = tr.assistant(last, branch, ids, text, None)
            total += len(tr.nodes[last]["token_ids"])
            break
        call_id = "call_" + rng.bytes(12).hex()
        call, out, note = agent.action(g.pkg, g.target, g.func, rng, max(16, per_turn - think - 40), call_id)
        notes.append(note)
        last = tr.assistant(last, branch, ids, text, call)
        branch += len(tr.nodes[last]["token_ids"])
        out_ids, out_text = m.cut(out, max(16, per_turn - len(tr.nodes[last]["token_ids"])))
        last = tr.prompt(last, "tool", out_ids, out_text, tool_call_id=call_id)
        step = len(tr.nodes[last - 1]["token_ids"]) + len(tr.nodes[last]["token_ids"])
        branch += len(tr.nodes[last]["token_ids"])
        total += step
    return tr, turns


def _timing(start: float, end: float) -> dict[str, Any]:
    def span(a: float, b: float) -> dict[str, float]:
        return {"start": a, "end": b}

    return {
        "start": start,
        "boot": span(start, start + 2.0),
        "setup": span(start + 2.0, start + 5.0),
        "agent": {
            **span(start + 5.0, end),
            "model": {"duration": 0.6 * (end - start)},
            "harness": {"duration": 0.3 * (end - start)},
        },
        "finalize": span(end, end + 0.5),
        "scoring": span(end + 0.5, end + 3.0),
    }


AGENT = {
    "config": {
        "runtime": {
            "allow": ["*"],
            "block": [],
            "type": "prime",
            "image": "python:3.11-slim",
            "labels": [],
            "cpu": 2.0,
            "memory": 4.0,
            "disk": 10.0,
            "idle_timeout": 3600.0,
        },
        "timeout": {},
        "retries": {"max_retries": 0, "rules": []},
        "network_notice": True,
    },
    "name": "swe-agent",
    "trainable": True,
}


def _uid(rng: np.random.Generator) -> str:
    return rng.bytes(16).hex()


def system_prompt(m: Material, shape: Shape, seed: int) -> tuple[np.ndarray, str]:
    """The run's system prompt: instructions, the tools' schemas, conventions from the corpus."""
    rng = np.random.default_rng([seed, 0])
    text = agent.INSTRUCTIONS + "\n\n# Tools\n\n" + "\n".join(json.dumps(t) for t in TOOLS) + "\n\n# Conventions\n"
    while len(text) < shape.system * 5:
        p = m.packages[int(rng.integers(len(m.packages)))]
        text += "\n- " + agent.prose(p, rng, 600).split("\n\n")[0]
    return m.cut(text, shape.system)


def generate_episodes(m: Material, groups: int, group_size: int, tokens: int, seed: int) -> Iterator[dict[str, Any]]:
    """Episode records (dicts, before verifiers validates and writes them)."""
    shape = Shape.of(tokens)
    system = system_prompt(m, shape, seed)
    for g in range(groups):
        group = _Group(m, shape, system, seed, g)
        rewards = (group.rng.random(group_size) < group.difficulty).astype(float)
        mean = float(rewards.mean())
        for member in range(group_size):
            tr, turns = _trace_nodes(group, member, seed)
            reward = float(rewards[member])
            for node in tr.nodes:
                if node["sampled"]:
                    node["advantages"] = [reward - mean] * sum(node["mask"])
            rng = tr.rng
            calls = sum(1 for n in tr.nodes if n["message"].get("tool_calls"))
            trace = {
                "version": 1,
                "id": _uid(rng),
                "verifiers": {"version": "0.4.0"},
                "task": group.task(),
                "agent": AGENT,
                "tools": TOOLS,
                "nodes": tr.nodes,
                "calls": [],
                "mm_token_type_id_map": {},
                "request_rewrites": [],
                "response_rewrites": [],
                "rewards": {"resolved": {"score": reward, "weight": 1.0}},
                "metrics": {"turns": float(turns), "tool_calls": float(calls)},
                "info": {"repo": group.pkg.name, "target": group.pkg.path(group.target)},
                "extra_usage": [],
                "is_completed": True,
                "ok": True,
                "stop_condition": "agent_completed",
                "is_timeout": False,
                "errors": [],
                "timing": _timing(tr.nodes[0]["timestamp"], tr.t),
                "num_input_tokens": tr.input_tokens,
                "num_output_tokens": tr.output_tokens,
                "num_total_tokens": tr.input_tokens + tr.output_tokens,
            }
            yield {
                "id": _uid(rng),
                "env": {"id": "realistic-swe"},
                "task": group.task(),
                "group": {"id": f"group-{g}"},
                "ok": True,
                "is_timeout": False,
                "errors": [],
                "traces": [trace],
                "num_input_tokens": tr.input_tokens,
                "num_output_tokens": tr.output_tokens,
                "num_total_tokens": tr.input_tokens + tr.output_tokens,
            }


# --------------------------------------------------------------------------- the workload


def _shape_of(lp: np.ndarray) -> dict[str, Any]:
    """The logprobs' distribution as written (4 decimals), for the manifest."""
    if not len(lp):
        return {"values": 0}
    pct = np.percentile(lp, [1, 10, 50, 90])
    return {
        "values": len(lp),
        "mean": round(float(lp.mean()), 4),
        "p1_p10_p50_p90": [round(float(v), 4) for v in pct],
        "share_zero": round(float((lp == 0).mean()), 4),
        "share_above_-0.01": round(float((lp > -0.01).mean()), 4),
        "distinct": int(len(np.unique(lp))),
    }


def _sources() -> bytes:
    """The generator's source: this module, the agent's material, the corpus, the n-gram model."""
    return b"".join(Path(f).read_bytes() for f in (__file__, agent.__file__, corpus_mod.__file__, ngram.__file__))


@dataclass(frozen=True)
class RealisticWorkload:
    """The realistic run's sizes. ``traces`` is rounded up to whole groups."""

    traces: int = 256
    tokens: int = 30_000
    group_size: int = 8
    seed: int = 0
    vocab: int = corpus_mod.VOCAB
    packages: tuple[str, ...] | None = None  # a subset of the pinned packages (small test runs)
    kind = "realistic"

    @property
    def groups(self) -> int:
        return max(1, math.ceil(self.traces / self.group_size))

    @cached_property
    def corpus(self) -> corpus_mod.Corpus:
        return corpus_mod.load(packages=self.packages)

    def key(self) -> str:
        """Cache key: sizes, the generator's source, the corpus hash, library versions."""
        h = hashlib.sha256()
        h.update(json.dumps({**asdict(self), "shape": asdict(Shape.of(self.tokens))}, sort_keys=True).encode())
        h.update(_sources())
        h.update(self.corpus.hash.encode())
        h.update(f"verifiers {version('verifiers')} tokenizers {version('tokenizers')}".encode())
        return h.hexdigest()[:16]

    def dirname(self) -> str:
        return f"realistic-{self.groups * self.group_size}x{self.tokens}-{self.key()}"

    def material(self, cache: Path, log: Any = print) -> Material:
        corpus = self.corpus
        for line in corpus.differences:
            log(f"corpus: {line}")
        if not corpus.matches_pins:
            log(f"corpus: {len(corpus.differences)} differences from the pins: this workload is not the pinned one")
        enc = corpus_mod.encoded(corpus, cache / "realistic-cache", self.vocab, log=log)
        m = Material(corpus, enc)
        m.fit(log)
        return m

    def write(self, out: Path, cache: Path, log: Any = print) -> dict[str, Any]:
        from verifiers.v1 import WireEpisode, WireTrace
        from verifiers.v1.utils.trace_store import write_episode

        started = time.perf_counter()
        m = self.material(cache, log)
        episodes = traces = nodes = tokens = sampled = 0
        logprobs: list[float] = []
        for record in generate_episodes(m, self.groups, self.group_size, self.tokens, self.seed):
            raw_traces = record["traces"]
            episode = WireEpisode.model_validate({**record, "traces": []})
            episode.traces = [WireTrace.model_validate(t) for t in raw_traces]
            write_episode(out, episode)
            episodes += 1
            for t in episode.traces:
                traces += 1
                nodes += len(t.nodes)
                tokens += sum(len(n.token_ids) for n in t.nodes)
                sampled += sum(sum(n.mask) for n in t.nodes)
                logprobs += [v for n in t.nodes for v in n.logprobs]
        return {
            "workload": self.kind,
            "key": self.key(),
            "params": asdict(self),
            "shape": asdict(Shape.of(self.tokens)),
            "corpus": self.corpus.describe(),
            "tokenizer": m.encoded.describe(),
            "verifiers": version("verifiers"),
            "episodes": episodes,
            "traces": traces,
            "nodes": nodes,
            "tokens": tokens,
            "sampled_tokens": sampled,
            "bytes": (out / TRACES_FILE).stat().st_size,
            "logprobs": _shape_of(np.round(np.asarray(logprobs, np.float64), 4)),
            "build_seconds": round(time.perf_counter() - started, 3),
        }
