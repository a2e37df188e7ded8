"""Random groups with both policies' logprobs, for the off-policy tests (mismatch, importance
weights, V-trace), and the plain-loop references they are checked against.

The groups are :func:`support.credit_groups.make_episodes`' (shared prefixes, forks, shared
nodes, non-canonical masks, a value field ``w``); on top, every node with sampled tokens
gets ``trainer_logprobs`` near its ``logprobs`` (so some ratios leave [1/2, 2]) and a value
``v``. With ``ragged`` some streams are cut short, run past the sampled tokens, are empty
or absent (ingest them with ``allow_ragged=True``); without, every sampled node holds both
streams in full, as a recompute pass leaves them.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import numpy as np

import tracedb

from support import FIXTURES
from support.credit_groups import make_episodes


def episode_with(nodes: list[dict[str, Any]], trace_id: str = "t0") -> dict[str, Any]:
    """A real verifiers 0.4.0 episode holding one trace with ``nodes``."""
    episode = json.loads((FIXTURES / "linear.traces.jsonl").read_text().splitlines()[0])
    trace = episode["traces"][0]
    episode["traces"] = [trace]
    episode["id"], trace["id"] = f"e-{trace_id}", trace_id
    trace["nodes"] = nodes
    return episode


def _f32(values: list[float]) -> np.ndarray:
    """Values as the store keeps them (FLOAT), widened to float64 for the arithmetic."""
    return np.asarray(values, np.float32).astype(np.float64)


def episodes(seed: int, *, n_groups: int = 6, ragged: bool = True, spread: float = 0.5) -> list[dict[str, Any]]:
    """Groups of traces whose sampled nodes carry ``trainer_logprobs`` (log ratios drawn
    from N(0, ``spread``)) and a value ``v``."""
    rng = random.Random(seed * 7919 + 1)
    out = make_episodes(seed, n_groups=n_groups, sizes=(2, 5), invalid=0.15)
    for episode in out:
        for node in episode["traces"][0]["nodes"]:
            k = sum(node["mask"])
            node["v"] = round(rng.uniform(-1.0, 1.0), 4)
            if k == 0:
                continue
            lp = [round(rng.uniform(-3.0, -0.01), 4) for _ in range(k)]
            tr = [round(min(x + rng.gauss(0.0, spread), 0.0), 4) for x in lp]
            if ragged:
                roll = rng.random()
                if roll < 0.06:
                    lp = []
                elif roll < 0.12:
                    lp = lp[: rng.randrange(k)]
                elif roll < 0.17:
                    lp = lp + [-0.5, -0.25]
                roll = rng.random()
                if roll < 0.1:
                    tr = None
                elif roll < 0.16:
                    tr = []
                elif roll < 0.24:
                    tr = tr[: rng.randrange(k)]
                elif roll < 0.3:
                    tr = tr + [-1.0]
            node["logprobs"] = lp
            if tr is not None:
                node["trainer_logprobs"] = tr
    return out


def ingest(tmp_path: Path, eps: list[dict[str, Any]]) -> tracedb.Database:
    path = tmp_path / f"{len(list(tmp_path.iterdir()))}.traces.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in eps))
    db = tracedb.connect(":memory:")
    report = db.ingest(path, allow_ragged=True)
    assert report.ok, report.rejected
    return db


def log_ratios(node: dict[str, Any]) -> np.ndarray:
    """``trainer - inference`` over the node's tokens holding both streams (its first
    min(sampled, len(logprobs), len(trainer_logprobs)) sampled tokens), float64."""
    k = sum(node["mask"])
    lp = node.get("logprobs") or []
    tr = node.get("trainer_logprobs") or []
    m = min(k, len(lp), len(tr))
    return _f32(tr[:m]) - _f32(lp[:m])


def figures(d: np.ndarray, c: float) -> dict[str, Any]:
    """The mismatch figures of log ratios ``d``, by numpy."""
    if not len(d):
        return {"tokens": 0, "k3_mean": None, "ratio_mean": None, "ratio_max": None, "outside_share": None}
    ratio = np.exp(d)
    return {
        "tokens": len(d),
        "k3_mean": float(np.mean((ratio - 1.0) - d)),
        "ratio_mean": float(np.mean(ratio)),
        "ratio_max": float(np.max(ratio)),
        "outside_share": float(np.mean((ratio < 1.0 / c) | (ratio > c))),
    }


def reference_mismatch(eps: list[dict[str, Any]], per: str, c: float = 2.0) -> dict[tuple, dict[str, Any]]:
    """(trace_id, node_index or None) -> figures, one trace and one node at a time."""
    out: dict[tuple, dict[str, Any]] = {}
    for episode in eps:
        for trace in episode["traces"]:
            nodes = trace["nodes"]
            if per == "trace":
                parts = [log_ratios(n) for n in nodes]
                out[(trace["id"], None)] = figures(np.concatenate(parts) if parts else np.zeros(0), c)
            else:
                for i, node in enumerate(nodes):
                    if sum(node["mask"]):
                        out[(trace["id"], i)] = figures(log_ratios(node), c)
    return out


def assert_figures(got: dict[str, Any], want: dict[str, Any], key: Any) -> None:
    assert got["tokens"] == want["tokens"], key
    for name in ("k3_mean", "ratio_mean", "ratio_max", "outside_share"):
        if want[name] is None:
            assert got[name] is None, (key, name)
        else:
            assert math.isclose(got[name], want[name], rel_tol=1e-9, abs_tol=1e-12), (key, name, got[name], want[name])
