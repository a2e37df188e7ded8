"""The text every suite's table is made of, from its results (``results.json``).

A table of :class:`benchmarks.harness.Metric` rows (:func:`metric_table`: metric, the peer's
and tracedb's median (min), the ratio, the target, PASS/MISS), the machine line, the CPU-time
ratios and what other processes took of the machine meanwhile. Each suite's ``render`` puts
its own lines around these.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

LEFT = (0, 4, 5)
"""Columns of a metric table aligned left (the label, the target, the result); the others
(figures) right."""


def side(values: list[float] | None, *, digits: int = 3, unit: str = "s") -> str:
    """One side's figure: ``median (min)`` seconds, or the median in MB; ``-`` without one."""
    if not values:
        return "-"
    if unit == "MB":
        return f"{statistics.median(values):.1f} MB"
    return f"{statistics.median(values):.{digits}f}s ({min(values):.{digits}f}s)"


def verdict(passed: bool | None) -> str:
    return "-" if passed is None else ("PASS" if passed else "MISS")


def metric_cells(d: dict[str, Any], *, digits: int = 3) -> tuple[str, ...]:
    """A metric's row (``Metric.to_dict()``): label, peer, tracedb, ratio, target, result."""
    ratio = d["ratio"]
    if ratio is None:
        ratio_text = "-"
    elif d["kind"] == "fraction":
        ratio_text = f"{ratio:.1%}"
    else:
        ratio_text = f"{ratio:.1f}x"
    return (
        d["label"],
        side(d["peer"]["samples"] if d["peer"] else None, digits=digits, unit=d["unit"]),
        side(d["tracedb"]["samples"] if d["tracedb"] else None, digits=digits, unit=d["unit"]),
        ratio_text,
        d["target"],
        verdict(d["passed"]),
    )


def table(rows: Sequence[Sequence[str]], left: Sequence[int] = LEFT) -> list[str]:
    """The header row, a rule, the rows: columns two spaces apart, each as wide as its
    widest cell, those in ``left`` aligned left."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for n, row in enumerate(rows):
        cells = [c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
        if n == 0:
            lines.append("-" * len(lines[0]))
    return lines


def metric_table(
    metrics: dict[str, dict[str, Any]],
    header: Sequence[str],
    *,
    digits: int = 3,
    extra: Callable[[dict[str, Any]], Sequence[str]] | None = None,
) -> list[str]:
    """:func:`table` of the metrics' rows (:func:`metric_cells`, then ``extra(metric)``'s cells)."""
    rows = [tuple(header)]
    for d in metrics.values():
        rows.append((*metric_cells(d, digits=digits), *(extra(d) if extra else ())))
    return table(rows)


def machine_line(results: dict[str, Any]) -> str:
    mach = results["machine"]
    return (
        f"machine: {mach['cpu_count']} cpus, {(mach['memory_bytes'] or 0) / 2**30:.0f} GiB, python {mach['python']}, "
        f"duckdb {mach['packages']['duckdb']}; {results['repeat']} repeats, {results['seconds']:.0f}s"
    )


def cpu_ratio_lines(metrics: dict[str, dict[str, Any]], aside: str = "") -> list[str]:
    """The peer's CPU time over tracedb's for every metric timed on both sides, as one line
    (none without such a metric); ``aside`` is added to the line's parenthesis."""
    ratios = [
        f"{k} {d['peer']['cpu_median'] / d['tracedb']['cpu_median']:.1f}x"
        for k, d in metrics.items()
        if d["peer"] and d["tracedb"] and d["peer"].get("cpu_median") and d["tracedb"].get("cpu_median")
    ]
    return [f"cpu-time ratios (process CPU, all threads{aside}): " + ", ".join(ratios)] if ratios else []


def load_lines(load: dict[str, Any]) -> list[str]:
    """The load average before and after, the other processes' share of the CPUs, and a
    note when that share is above 5%."""
    share = load.get("other_cpu_share")
    lines = [
        f"load average before/after: {load['load_average_before'][0]:.2f}/{load['load_average_after'][0]:.2f}"
        + (f"; other processes used {share:.0%} of the cpus during the run" if share is not None else "")
    ]
    if share is not None and share > 0.05:
        lines.append("note: other load above 5% of the machine: figures are noisier than usual")
    return lines


def busy_note(load: dict[str, Any], cpus: int | None) -> list[str]:
    """A note, only when other processes took more than 5% of the ``cpus``."""
    share = load.get("other_cpu_share")
    if share is None or share <= 0.05:
        return []
    return [
        f"note: other processes used {share:.0%} of the machine's {cpus} cpus during the run "
        f"({load['other_cpu_seconds']:.0f} cpu-seconds): figures are noisier than usual"
    ]
