"""What replay costs a trainer's step: ``db.micro_batches`` of one step's complete groups,
plain and with ``replay=tracedb.Replay(...)``, on versioned rollouts
(:func:`tracedb.synthetic.versioned`: a quarter of the groups zero-variance, a fifth stale).

The store holds ``steps`` steps of ``groups_per_step`` groups each, ingested step by step
(the watermark after each is a step's ``through``) and credited with GRPO. The timed step
is the last one: its zero-variance groups are replaced by earlier groups of the whole
store, so the replay call reads every earlier group's rewards and credit besides the
step's nodes. The plain and the replay calls alternate, ``repeat`` times each, in one
process; the figures are medians. Run ``python -m benchmarks.replay_cost [--steps N]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import tracedb
import tracedb.credit
from tracedb.synthetic import generate_episodes, versioned

TARGET = 1.15
"""The issue's bound: a step with replay costs at most this times the plain step."""


def build(root: Path, steps: int, groups_per_step: int, group_size: int, tokens: int, seed: int) -> list[int]:
    """Ingest the run into ``root/run.duckdb`` step by step; the watermarks (0 first)."""
    episodes = list(
        versioned(
            generate_episodes(
                groups=steps * groups_per_step,
                group_size=group_size,
                tokens_per_trace=tokens,
                system_tokens=min(1_500, tokens // 20),
                task_tokens=min(300, tokens // 100),
                turn_tokens=(min(120, tokens // 250), min(600, tokens // 50)),
                compaction_every=int(tokens * 0.4),
                advantages=True,
                seed=seed,
            ),
            step=steps,
            groups_per_step=groups_per_step,
            seed=seed,
        )
    )
    marks = [0]
    with tracedb.connect(root / "run.duckdb") as db:
        for step in range(1, steps + 1):
            path = root / f"step{step}.jsonl"
            todo = [e for e in episodes if e["run"]["work"]["step"] == step]
            path.write_text("".join(json.dumps(e) + "\n" for e in todo))
            assert db.ingest(path).ok
            marks.append(db.watermark())
        tracedb.credit.run(db, "grpo", "grpo")
    return marks


def measure(
    steps: int = 12, groups_per_step: int = 4, group_size: int = 8, tokens: int = 6_000, repeat: int = 7, seed: int = 0
) -> dict[str, Any]:
    """Build the store in a temporary directory and time the last step both ways."""
    with tempfile.TemporaryDirectory(prefix="tracedb-replay-") as tmp:
        root = Path(tmp)
        marks = build(root, steps, groups_per_step, group_size, tokens, seed)
        step = {"after": marks[-2], "through": marks[-1], "complete_groups": group_size, "credit": "grpo"}
        calls = {
            "plain": {},
            "replay": {"replay": tracedb.Replay(seed=seed)},
            "plain, policy bound": {"policy": steps, "max_staleness": 2, "unknown": "keep"},
            "replay, policy bound": {
                "policy": steps,
                "max_staleness": 2,
                "unknown": "keep",
                "replay": tracedb.Replay(seed=seed),
            },
        }
        times: dict[str, list[float]] = {name: [] for name in calls}
        reports: dict[str, Any] = {}
        with tracedb.connect(root / "run.duckdb", read_only=True) as db:
            for name, extra in calls.items():  # warm: macros bound, pages cached
                reports[name] = db.micro_batches(8192, ranks=2, **step, **extra).report
            for _ in range(repeat):
                for name, extra in calls.items():
                    start = time.perf_counter()
                    db.micro_batches(8192, ranks=2, **step, **extra)
                    times[name].append(time.perf_counter() - start)
            traces = db.sql("SELECT count(*) AS n FROM traces").to_pylist()[0]["n"]
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {
        "store": {"steps": steps, "groups": steps * groups_per_step, "group_size": group_size, "traces": traces},
        "step_samples": reports["plain"].samples,
        "replaced": reports["replay"].replay_replaced,
        "unfilled": reports["replay"].replay_unfilled,
        "candidates": reports["replay"].replay_candidates,
        "seconds": medians,
        "all_seconds": times,
        "ratio": medians["replay"] / medians["plain"],
        "ratio_bounded": medians["replay, policy bound"] / medians["plain, policy bound"],
        "load": os.getloadavg(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--groups-per-step", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=6_000)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    result = measure(args.steps, args.groups_per_step, args.group_size, args.tokens, args.repeat)
    s = result["seconds"]
    print(
        f"store: {result['store']}; the last step: {result['step_samples']} samples, "
        f"{result['replaced']} zero-variance groups replaced ({result['unfilled']} unfilled, "
        f"{result['candidates']} candidates)"
    )
    for name, value in s.items():
        print(f"  {name:>22}: {value * 1000:8.1f} ms (median of {args.repeat})")
    print(
        f"replay / plain = {result['ratio']:.3f}, with a policy bound {result['ratio_bounded']:.3f} "
        f"(target <= {TARGET}); load average {', '.join(f'{x:.1f}' for x in result['load'])}"
    )


if __name__ == "__main__":
    main()
