"""``python -m benchmarks``: tracedb against verifiers v1, side by side in one run.

Prints the table and writes ``benchmarks/results.json``. ``--suite credit`` (or
``python -m benchmarks credit``) runs the credit-stamping suite instead (``benchmarks/credit.py``,
writing ``results-credit.json``); ``--suite batches`` (or ``python -m benchmarks batches``) the
trainer-feed suite (``benchmarks/batches.py``, ``db.micro_batches``, writing
``results-batches.json``); ``--suite live`` (or ``python -m benchmarks live``) a run followed
by ``tracedb serve --follow`` while a writer appends it and REST readers poll it
(``benchmarks/live.py``, writing ``results-live.json``); ``--suite lake`` the lake beside the
file store on Ray, and the 1M-rollout projection (``benchmarks/lake.py``, ``results-lake.json``);
``--suite async`` micro-batches under a staleness bound against the plain call, and the
bytes policy-version spans add, on a versioned core run (``benchmarks/asyncfeed.py``,
``results-async.json``); ``--suite api`` REST branch lookup, JSON against Arrow, on its own workload
(``benchmarks/bench_api.py``, ``results-api.json``).
``--workload realistic`` runs any suite on the realistic workload (``benchmarks/realistic.py``:
real text, a trained BPE, agent-shaped episodes) instead of the core one (the default); its
results go to ``results-realistic.json`` (``results-batches-realistic.json``, ...).
Exits 0 whether or not the targets are met (the table
reports PASS/MISS); 2 when tracedb's answers differ from verifiers' (the figures would mean
nothing); 1 on any other error.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from benchmarks.workload import WORKLOADS, make


@dataclass(frozen=True)
class Suite:
    """A suite: its module (``RESULTS``, ``QUICK``, ``FULL``, ``run``, ``render``), the
    keywords its ``run`` takes from the command line (keyword -> option attribute), and
    whether it runs on the verifiers-written workload (built first) or builds its own."""

    module: str
    options: dict[str, str] = field(default_factory=dict)
    workload: bool = True

    def load(self) -> ModuleType:
        return importlib.import_module(self.module)


SUITES = {
    "core": Suite("benchmarks.core"),
    "credit": Suite("benchmarks.credit"),
    "batches": Suite("benchmarks.batches", {"seq_len": "seq_len", "ranks": "ranks"}),
    "live": Suite(
        "benchmarks.live",
        {
            "rate": "rate",
            "rate_traces": "rate_traces",
            "readers": "readers",
            "soak_traces": "soak_traces",
            "fmt": "format",
            "memory_limit": "memory_limit",
        },
    ),
    "lake": Suite("benchmarks.lake", {"catalog": "catalog"}),
    "async": Suite("benchmarks.asyncfeed", {"seq_len": "seq_len", "ranks": "ranks"}),
    "api": Suite(
        "benchmarks.bench_api",
        {"traces": "traces", "tokens": "tokens", "clients": "clients", "seconds": "seconds"},
        workload=False,
    ),
}
"""Every suite ``python -m benchmarks [--suite] NAME`` runs (the first is the default)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] and argv[0] in SUITES:  # `... credit` = `--suite credit`
        argv = ["--suite", *argv]
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", choices=list(SUITES), default="core", help="which suite to run (default core)")
    p.add_argument("--workdir", type=Path, default=Path("out/bench"), help="workload cache and scratch databases")
    p.add_argument("--traces", type=int, help="traces, in groups of 8 (default 256; api 32)")
    p.add_argument("--tokens", type=int, help="tokens per trace (default 30000; api 32768)")
    p.add_argument("--repeat", type=int, help="runs per figure; medians are reported (default 5; credit 11)")
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
        help="results file (default benchmarks/results.json; credit: results-credit.json; batches: "
        "results-batches.json; ...)",
    )
    p.add_argument(
        "--seq-len", type=int, default=32_768, help="batches and async suites: tokens per micro-batch (default 32768)"
    )
    p.add_argument("--ranks", type=int, default=8, help="batches and async suites: data-parallel ranks (default 8)")
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
    p.add_argument("--seconds", type=float, help="api suite: seconds per row (default 30; --quick 2)")
    p.add_argument("--clients", type=int, help="api suite: client threads (default 8)")
    args = p.parse_args(argv)
    suite = SUITES[args.suite]
    module = suite.load()
    defaults = module.QUICK if args.quick else module.FULL
    if args.results is None:  # the realistic workload's results do not overwrite the core one's
        default_results = module.RESULTS
        suffix = "" if args.workload == "core" else f"-{args.workload}"
        args.results = default_results.with_name(f"{default_results.stem}{suffix}{default_results.suffix}")
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.traces < 1 or args.tokens < 100 or args.repeat < 1 or args.seq_len < 1 or args.ranks < 1:
        p.error("--traces >= 1, --tokens >= 100, --repeat >= 1, --seq-len >= 1 and --ranks >= 1")
    if args.suite == "live" and (args.rate <= 0 or args.rate_traces < 0 or args.readers < 1 or args.soak_traces < 1):
        p.error("--rate > 0, --rate-traces >= 0, --readers >= 1 and --soak-traces >= 1")
    if args.suite == "api" and (args.seconds <= 0 or args.clients < 1):
        p.error("--seconds > 0 and --clients >= 1")
    if not suite.workload and args.workload != "core":
        p.error(f"the {args.suite} suite builds its own workload: --workload is for the others")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def log(message: str) -> None:
        print(f"[bench] {message}", file=sys.stderr, flush=True)

    from benchmarks.harness import CorrectnessError, write_results
    from benchmarks.workload import build

    suite = SUITES[args.suite]
    module = suite.load()
    options = {keyword: getattr(args, attribute) for keyword, attribute in suite.options.items()}
    files = None
    if suite.workload:
        workload = make(args.workload, traces=args.traces, tokens=args.tokens, seed=args.seed)
        files = build(workload, args.workdir, log=log)
    try:
        results = module.run(files, args.workdir, args.repeat, log=log, **options)
    except CorrectnessError as e:
        print(f"CORRECTNESS FAILURE: {e}", file=sys.stderr)
        return 2
    write_results(results, args.results)
    print(module.render(results))
    log(f"results written to {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
