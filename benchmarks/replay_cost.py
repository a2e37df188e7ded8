"""What replay costs a trainer's step: ``db.micro_batches`` of one step's complete groups,
plain and with ``replay=tracedb.Replay(...)``, on versioned rollouts
(:func:`tracedb.synthetic.versioned`: a quarter of the groups zero-variance, a fifth stale).

The store holds ``steps`` steps of ``groups_per_step`` groups each, ingested step by step
(the watermark after each is a step's ``through``) and credited with GRPO. A trainer's
loop is timed: every step's complete groups, plain and with replay (each step's
zero-variance groups replaced by earlier groups of the store, so a replay call reads the
earlier groups' rewards and credit besides the step's nodes), with and without a policy
bound (``policy`` the step, ``max_staleness`` 1; replayed groups at most 2 behind). The calls alternate step by step,
``repeat`` loops in one process; the figures are medians of the loops' totals.
Run ``python -m benchmarks.replay_cost [--steps N]``.
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
    steps: int = 8, groups_per_step: int = 8, group_size: int = 8, tokens: int = 4_000, repeat: int = 5, seed: int = 0
) -> dict[str, Any]:
    """Build the store in a temporary directory and time a trainer's loop over its steps
    (each step's complete groups, ``after`` the previous step's watermark) both ways: per
    repeat, each step packed by each call in turn, the step times summed per call."""
    with tempfile.TemporaryDirectory(prefix="tracedb-replay-") as tmp:
        root = Path(tmp)
        marks = build(root, steps, groups_per_step, group_size, tokens, seed)

        def calls(step: int) -> dict[str, dict[str, Any]]:
            bound = {"policy": step, "max_staleness": 1, "unknown": "keep"}
            return {
                "plain": {},
                "replay": {"replay": tracedb.Replay(seed=seed)},
                "plain, policy bound": bound,
                "replay, policy bound": {**bound, "replay": tracedb.Replay(max_staleness=2, seed=seed)},
            }

        def window(step: int) -> dict[str, Any]:
            return {"after": marks[step - 1], "through": marks[step], "complete_groups": group_size, "credit": "grpo"}

        names = list(calls(1))
        totals: dict[str, list[float]] = {name: [] for name in names}
        figures = {name: {"samples": 0, "replaced": 0, "unfilled": 0, "candidates": 0} for name in names}
        with tracedb.connect(root / "run.duckdb", read_only=True) as db:
            for step in range(1, steps + 1):  # warm (macros bound, pages cached), and the figures
                for name, extra in calls(step).items():
                    r = db.micro_batches(8192, ranks=2, **window(step), **extra).report
                    f = figures[name]
                    f["samples"] += r.samples
                    f["replaced"] += r.replay_replaced
                    f["unfilled"] += r.replay_unfilled
                    f["candidates"] += r.replay_candidates
            for _ in range(repeat):
                spent = dict.fromkeys(names, 0.0)
                for step in range(1, steps + 1):
                    for name, extra in calls(step).items():
                        start = time.perf_counter()
                        db.micro_batches(8192, ranks=2, **window(step), **extra)
                        spent[name] += time.perf_counter() - start
                for name in names:
                    totals[name].append(spent[name])
            traces = db.sql("SELECT count(*) AS n FROM traces").to_pylist()[0]["n"]
    medians = {name: statistics.median(values) for name, values in totals.items()}
    return {
        "store": {"steps": steps, "groups": steps * groups_per_step, "group_size": group_size, "traces": traces},
        "figures": figures,
        "seconds": medians,
        "all_seconds": totals,
        "ratio": medians["replay"] / medians["plain"],
        "ratio_bounded": medians["replay, policy bound"] / medians["plain, policy bound"],
        "load": os.getloadavg(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--groups-per-step", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=4_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    result = measure(args.steps, args.groups_per_step, args.group_size, args.tokens, args.repeat)
    print(f"store: {result['store']}; over its steps:")
    for name, value in result["seconds"].items():
        f = result["figures"][name]
        print(
            f"  {name:>22}: {value * 1000:8.1f} ms (median of {args.repeat} loops, "
            f"{min(result['all_seconds'][name]) * 1000:.0f}-{max(result['all_seconds'][name]) * 1000:.0f}; "
            f"{f['samples']} samples, "
            f"{f['replaced']} zero-variance groups replaced, {f['unfilled']} unfilled, {f['candidates']} candidates)"
        )
    print(
        f"replay / plain = {result['ratio']:.3f}, with a policy bound {result['ratio_bounded']:.3f} "
        f"(target <= {TARGET}); load average {', '.join(f'{x:.1f}' for x in result['load'])}"
    )


if __name__ == "__main__":
    main()
