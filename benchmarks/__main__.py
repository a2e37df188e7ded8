"""``python -m benchmarks``: tracedb against verifiers v1, side by side in one run.

Prints the table and writes ``benchmarks/results.json``. ``--suite credit`` (or
``python -m benchmarks credit``) runs the credit-stamping suite instead (``benchmarks/credit.py``,
writing ``results-credit.json``); ``--suite batches`` (or ``python -m benchmarks batches``) the
trainer-feed suite (``benchmarks/batches.py``, ``db.micro_batches``, writing
``results-batches.json``); ``--suite live`` (or ``python -m benchmarks live``) a run followed
by ``tracedb serve --follow`` while a writer appends it and REST readers poll it
(``benchmarks/live.py``, writing ``results-live.json``); ``--suite lake`` the lake beside the
file store on Ray, and the 1M-rollout projection (``benchmarks/lake.py``, ``results-lake.json``).
``--workload realistic`` runs any suite on the realistic workload (``benchmarks/realistic.py``:
real text, a trained BPE, agent-shaped episodes) instead of the core one (the default); its
results go to ``results-realistic.json`` (``results-batches-realistic.json``, ...).
Exits 0 whether or not the targets are met (the table
reports PASS/MISS); 2 when tracedb's answers differ from verifiers' (the figures would mean
nothing); 1 on any other error.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from benchmarks.workload import WORKLOADS, make

RESULTS = Path(__file__).resolve().parent / "results.json"
QUICK = {"traces": 16, "tokens": 3_000, "repeat": 1}
FULL = {"traces": 256, "tokens": 30_000, "repeat": 5}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["core"], ["credit"], ["batches"], ["live"], ["lake"]):  # `... credit` = `--suite credit`
        argv = ["--suite", *argv]
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--suite",
        choices=["core", "credit", "batches", "live", "lake"],
        default="core",
        help="which suite to run (default core)",
    )
    p.add_argument("--workdir", type=Path, default=Path("out/bench"), help="workload cache and scratch databases")
    p.add_argument("--traces", type=int, help=f"traces, in groups of 8 (default {FULL['traces']})")
    p.add_argument("--tokens", type=int, help=f"tokens per trace (default {FULL['tokens']})")
    p.add_argument(
        "--repeat", type=int, help=f"runs per figure; medians are reported (default {FULL['repeat']}; credit 11)"
    )
    p.add_argument("--quick", action="store_true", help="tiny sizes for a smoke test (16 traces, 3k tokens, 1 run)")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument(
        "--workload",
        choices=list(WORKLOADS),
        default="core",
        help="core (synthetic ids and streams, the default) or realistic (real text, a trained BPE)",
    )
    p.add_argument(
        "--results",
        type=Path,
        help=f"results file (default {RESULTS}; credit: results-credit.json; batches: results-batches.json)",
    )
    p.add_argument("--seq-len", type=int, default=32_768, help="batches suite: tokens per micro-batch (default 32768)")
    p.add_argument("--ranks", type=int, default=8, help="batches suite: data-parallel ranks (default 8)")
    p.add_argument("--rate", type=float, help="live suite: episodes/s in the fixed-rate phase (default 2)")
    p.add_argument(
        "--rate-traces",
        type=int,
        help="live suite: episodes appended at --rate; the rest as fast as possible (default 96)",
    )
    p.add_argument("--readers", type=int, help="live suite: REST reader threads (default 8)")
    p.add_argument("--soak-traces", type=int, help="live suite: traces of the soak run (default 12288)")
    p.add_argument(
        "--format", choices=["arrow", "json"], default="arrow", help="live suite: the readers' branch format"
    )
    p.add_argument("--memory-limit", help="live suite: the server's TRACEDB_MEMORY_LIMIT (default: tracedb's default)")
    p.add_argument(
        "--catalog",
        choices=["sqlite", "postgres", "both"],
        default="both",
        help="lake suite: the catalogs of the many-writers measurement (default both)",
    )
    args = p.parse_args(argv)
    if args.suite == "credit":
        from benchmarks import credit

        default_results = credit.RESULTS
        defaults = credit.QUICK if args.quick else credit.FULL
    elif args.suite == "batches":
        from benchmarks import batches

        default_results = batches.RESULTS
        defaults = batches.QUICK if args.quick else batches.FULL
    elif args.suite == "live":
        from benchmarks import live

        default_results = live.RESULTS
        defaults = live.QUICK if args.quick else live.FULL
    elif args.suite == "lake":
        from benchmarks import lake

        default_results = lake.RESULTS
        defaults = lake.QUICK if args.quick else lake.FULL
    else:
        default_results = RESULTS
        defaults = QUICK if args.quick else FULL
    if args.results is None:  # the realistic workload's results do not overwrite the core one's
        suffix = "" if args.workload == "core" else f"-{args.workload}"
        args.results = default_results.with_name(f"{default_results.stem}{suffix}{default_results.suffix}")
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.traces < 1 or args.tokens < 100 or args.repeat < 1 or args.seq_len < 1 or args.ranks < 1:
        p.error("--traces >= 1, --tokens >= 100, --repeat >= 1, --seq-len >= 1 and --ranks >= 1")
    if args.suite == "live" and (args.rate <= 0 or args.rate_traces < 0 or args.readers < 1 or args.soak_traces < 1):
        p.error("--rate > 0, --rate-traces >= 0, --readers >= 1 and --soak-traces >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def log(message: str) -> None:
        print(f"[bench] {message}", file=sys.stderr, flush=True)

    from benchmarks.core import CorrectnessError, write_results
    from benchmarks.workload import build

    options: dict[str, Any] = {}
    if args.suite == "credit":
        from benchmarks.credit import render, run
    elif args.suite == "batches":
        from benchmarks.batches import render, run

        options = {"seq_len": args.seq_len, "ranks": args.ranks}
    elif args.suite == "live":
        from benchmarks.live import render, run

        options = {
            "rate": args.rate,
            "rate_traces": args.rate_traces,
            "readers": args.readers,
            "soak_traces": args.soak_traces,
            "fmt": args.format,
            "memory_limit": args.memory_limit,
        }
    elif args.suite == "lake":
        from benchmarks.lake import render, run

        options = {"catalog": args.catalog}
    else:
        from benchmarks.core import render, run

    workload = make(args.workload, traces=args.traces, tokens=args.tokens, seed=args.seed)
    files = build(workload, args.workdir, log=log)
    try:
        results = run(files, args.workdir, args.repeat, log=log, **options)
    except CorrectnessError as e:
        print(f"CORRECTNESS FAILURE: {e}", file=sys.stderr)
        return 2
    write_results(results, args.results)
    print(render(results))
    log(f"results written to {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
