"""The benchmark workload: a ``traces.jsonl`` written by verifiers itself.

Episode dicts come from :func:`tracedb.synthetic.generate_episodes` (a system prompt
shared by every trace, a task prompt per group of 8, compaction forks, advantages
stamped); each one is validated into verifiers' ``WireEpisode`` (traces as
``WireTrace``, as ``read_episodes`` does) and appended with verifiers'
``write_episode``, so the file is byte for byte what verifiers writes.

The file is cached under the work directory, keyed by the parameters, the source of
``tracedb/synthetic.py`` and the verifiers version; a stale or partial cache is rebuilt.
:func:`build` builds any workload that has ``key()``, ``dirname()`` and ``write()``: this
core one, or the realistic one (``benchmarks/realistic.py``); :func:`make` picks by name.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

TRACES_FILE = "traces.jsonl"
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class Workload:
    """Sizes of the generated run. ``traces`` is rounded up to whole groups."""

    traces: int = 256
    tokens: int = 30_000
    group_size: int = 8
    seed: int = 0

    @property
    def groups(self) -> int:
        return max(1, math.ceil(self.traces / self.group_size))

    def sample_kwargs(self) -> dict[str, Any]:
        """Arguments of ``generate_episodes``; at 30k tokens these are its defaults
        (1500-token system prompt, 300-token task prompt, turns of 120-600 tokens,
        compaction past 12k tokens), and they scale down for small runs."""
        t = self.tokens
        return {
            "groups": self.groups,
            "group_size": self.group_size,
            "tokens_per_trace": t,
            "system_tokens": min(1_500, max(16, t // 20)),
            "task_tokens": min(300, max(8, t // 100)),
            "turn_tokens": (min(120, max(8, t // 250)), min(600, max(16, t // 50))),
            "compaction_every": max(64, int(t * 0.4)),
            "advantages": True,
            "seed": self.seed,
        }

    kind = "core"

    def dirname(self) -> str:
        return f"workload-{self.groups * self.group_size}x{self.tokens}-{self.key()}"

    def write(self, out: Path, cache: Path, log: Any = print) -> dict[str, Any]:
        """Write ``traces.jsonl`` into ``out``; returns the manifest (``cache`` is unused)."""
        return _write(self, out)

    def key(self) -> str:
        """Cache key: parameters, generator source, verifiers version."""
        from tracedb import synthetic

        h = hashlib.sha256()
        h.update(json.dumps(self.sample_kwargs(), sort_keys=True).encode())
        h.update(inspect.getsource(synthetic).encode())
        h.update(version("verifiers").encode())
        return h.hexdigest()[:16]


@dataclass
class WorkloadFiles:
    """A built workload: its directory (verifiers' ``results_dir``) and facts."""

    dir: Path
    manifest: dict[str, Any]

    @property
    def jsonl(self) -> Path:
        return self.dir / TRACES_FILE


def _write(workload: Workload, out: Path) -> dict[str, Any]:
    from verifiers.v1 import WireEpisode, WireTrace
    from verifiers.v1.utils.trace_store import write_episode

    from tracedb.synthetic import generate_episodes

    started = time.perf_counter()
    episodes = traces = nodes = tokens = sampled = 0
    for record in generate_episodes(**workload.sample_kwargs()):
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
    return {
        "workload": workload.kind,
        "key": workload.key(),
        "params": asdict(workload),
        "sample_kwargs": workload.sample_kwargs(),
        "verifiers": version("verifiers"),
        "episodes": episodes,
        "traces": traces,
        "nodes": nodes,
        "tokens": tokens,
        "sampled_tokens": sampled,
        "bytes": (out / TRACES_FILE).stat().st_size,
        "build_seconds": round(time.perf_counter() - started, 3),
    }


WORKLOADS = ("core", "realistic")


def make(kind: str, *, traces: int, tokens: int, seed: int = 0) -> Any:
    """The workload called ``kind`` (:data:`WORKLOADS`) at these sizes."""
    if kind == "core":
        return Workload(traces=traces, tokens=tokens, seed=seed)
    if kind == "realistic":
        from benchmarks.realistic import RealisticWorkload

        return RealisticWorkload(traces=traces, tokens=tokens, seed=seed)
    raise ValueError(f"unknown workload {kind!r}: one of {', '.join(WORKLOADS)}")


def kind_of(files: WorkloadFiles) -> str:
    """The name of the workload ``files`` were built from (core for caches older than the name)."""
    return str(files.manifest.get("workload", "core"))


def build(workload: Any, workdir: Path, *, log: Any = print) -> WorkloadFiles:
    """The workload's files under ``workdir``, generated unless a valid cache exists."""
    workdir.mkdir(parents=True, exist_ok=True)
    target = workdir / workload.dirname()
    manifest_path = target / MANIFEST
    if manifest_path.exists() and (target / TRACES_FILE).exists():
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("key") == workload.key() and manifest.get("bytes") == (target / TRACES_FILE).stat().st_size:
            log(f"workload: cached {target}")
            return WorkloadFiles(target, manifest)
    log(
        f"workload: writing {workload.groups * workload.group_size} {workload.kind} traces x ~{workload.tokens} "
        "tokens with verifiers"
    )
    partial = workdir / f".{target.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    try:
        manifest = workload.write(partial, workdir, log=log)
        (partial / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        shutil.rmtree(target, ignore_errors=True)
        partial.rename(target)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    log(f"workload: {manifest['bytes'] / 1e6:.1f} MB in {manifest['build_seconds']:.1f}s -> {target}")
    return WorkloadFiles(target, manifest)
