"""The one runner and what the suites share (``benchmarks/__main__.py``, ``harness.py``,
``tables.py``): every registered suite is whole and its options exist, the run's frame puts
the common keys where every results file has them, and the table's text is fixed."""

from __future__ import annotations

import subprocess
import sys

import pytest

from benchmarks import tables
from benchmarks.__main__ import SUITES, parse_args
from benchmarks.harness import Metric, OtherLoad, Run, Sample, repeats


@pytest.mark.parametrize("name", list(SUITES))
def test_every_suite_is_whole_and_its_options_are_on_the_command_line(name: str) -> None:
    suite = SUITES[name]
    module = suite.load()
    for attribute in ("RESULTS", "QUICK", "FULL", "run", "render"):
        assert hasattr(module, attribute), f"{suite.module} lacks {attribute}"
    for quick in (False, True):
        args = parse_args([name, *(["--quick"] if quick else [])])
        assert args.suite == name and args.results == module.RESULTS
        for option, value in (module.QUICK if quick else module.FULL).items():
            assert getattr(args, option) == value, (name, option)
        for attribute in suite.options.values():
            assert hasattr(args, attribute), (name, attribute)  # None only where run() takes it (memory_limit)


def test_the_api_suite_runs_on_its_own_workload() -> None:
    args = parse_args(["api", "--quick", "--clients", "2"])
    assert (args.traces, args.tokens, args.seconds, args.clients) == (8, 32_768, 2.0, 2)
    assert not SUITES["api"].workload and all(SUITES[s].workload for s in SUITES if s != "api")
    with pytest.raises(SystemExit):
        parse_args(["api", "--workload", "realistic"])
    with pytest.raises(SystemExit):
        parse_args(["api", "--seconds", "0"])


def test_repeats_alternate_which_side_goes_first() -> None:
    logged: list[str] = []
    assert list(repeats(3, logged.append)) == [(0, True), (1, False), (2, True)]
    assert logged == ["repeat 1/3", "repeat 2/3", "repeat 3/3"]


def test_the_results_frame_puts_the_common_keys_around_the_suites() -> None:
    met = Metric("a", "a", "speedup", 2.0)
    met.add(Sample(4.0, 4.0), Sample(1.0, 1.0))
    missed = Metric("b", "b", "fraction", 0.25)
    missed.add(Sample(1.0, 0.0), Sample(0.5, 0.0))
    results = Run().results(workload={"traces": 1}, repeat=1, metrics={"a": met, "b": missed}, correctness={})
    assert list(results) == [
        "machine",
        "workload",
        "repeat",
        "metrics",
        "correctness",
        "all_targets_met",
        "other_load",
        "seconds",
        "timestamp",
    ]
    assert results["metrics"]["a"]["ratio"] == 4.0 and results["all_targets_met"] is False
    assert "all_targets_met" not in Run().results(setup={})  # no metrics, no targets of theirs


def test_reaped_children_count_as_the_benchmarks_own_cpu() -> None:
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass"
    own, alone = OtherLoad(children=True), OtherLoad()
    before = (own.own_seconds(), alone.own_seconds())
    subprocess.run([sys.executable, "-c", burn], check=True)
    assert own.own_seconds() - before[0] >= 0.25
    assert alone.own_seconds() - before[1] < 0.25


def test_the_metric_table_text() -> None:
    speed = Metric("ingest", "ingest: a vs b", "speedup", 5.0)
    speed.add(Sample(2.0, 2.0), Sample(0.25, 0.5))
    size = Metric("storage", "storage", "fraction", 0.25, unit="MB")
    size.peer, size.tracedb = [100.0], [20.0]
    info = Metric("export", "  export", "info")
    info.add(None, Sample(0.125, 0.1))
    metrics = {m.key: m.to_dict() for m in (speed, size, info)}
    header = ("metric", "peer median (min)", "tracedb median (min)", "ratio", "target", "result")
    assert tables.metric_table(metrics, header) == [
        "metric          peer median (min)  tracedb median (min)  ratio  target  result",
        "------------------------------------------------------------------------------",
        "ingest: a vs b    2.000s (2.000s)       0.250s (0.250s)   8.0x  >= 5x   PASS",
        "storage                  100.0 MB               20.0 MB  20.0%  <= 25%  PASS",
        "  export                        -       0.125s (0.125s)      -  info    -",
    ]
    assert tables.cpu_ratio_lines(metrics) == ["cpu-time ratios (process CPU, all threads): ingest 4.0x"]
    assert tables.cpu_ratio_lines({"export": metrics["export"]}) == []
    load = {"load_average_before": [1.0], "load_average_after": [2.5], "other_cpu_seconds": 12.0}
    assert tables.load_lines({**load, "other_cpu_share": 0.02}) == [
        "load average before/after: 1.00/2.50; other processes used 2% of the cpus during the run"
    ]
    assert tables.busy_note({**load, "other_cpu_share": 0.02}, 2) == []
    assert tables.busy_note({**load, "other_cpu_share": 0.3}, 2) == [
        "note: other processes used 30% of the machine's 2 cpus during the run (12 cpu-seconds): "
        "figures are noisier than usual"
    ]
