"""Bin packing and rank balancing for micro-batches: plain algorithms on sizes and costs.

:func:`pack` puts samples into bins of at most ``capacity`` tokens, first-fit decreasing
(the longest sample first, each into the first bin it fits), optionally counting the
tokens a sample shares with a bin's samples once (prefix sharing: a sample costs the
bin only what it does not share, and among the bins it fits it goes to the one it
shares most with). :func:`balance` splits bins over ranks so that every rank gets the
same number of bins (zero-cost padding bins make the count a multiple) and the rank
costs are close: it runs the balanced largest-differencing method (Karmarkar-Karp with
equal cardinality) and cardinality-constrained LPT, and keeps the better partition.

The bound reached, against the optimum found by brute force (``tests/batches/test_packing.py``,
2-3 ranks, up to 9 bins, random costs): the largest rank cost is within 7/6 of the optimum
(asserted; the worst of 360 seeded cases was 1.077, of 3,000 cases 1.132, where LPT alone
reached 1.143 and the differencing method alone 1.213). First-fit decreasing stays within
its bound of 11/9 OPT + 6/9 bins.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Bin:
    """One micro-batch's samples (indices into the caller's sample list)."""

    samples: list[int] = field(default_factory=list)
    tokens: int = 0
    """Physical tokens (a shared prefix counted once)."""
    shared: set[int] = field(default_factory=set)
    """Prefix keys (trie ids) present in the bin, with sharing."""


def pack(
    lengths: Sequence[int],
    capacity: int,
    *,
    prefixes: Sequence[Sequence[tuple[int, int]]] | None = None,
) -> list[Bin]:
    """Samples of ``lengths`` tokens into bins of at most ``capacity`` tokens.

    Without ``prefixes``: first-fit decreasing (ties keep the samples' order).
    With ``prefixes[i]``: sample ``i``'s shareable prefix as ``(trie id, tokens up to and
    including it)`` pairs, shortest first; a bin holding a trie id stores those tokens
    once. Every sample must fit a bin by itself (``lengths[i] <= capacity``)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[Bin] = []
    for i in order:
        size = int(lengths[i])
        if size > capacity:
            raise ValueError(f"sample {i} has {size} tokens, over the bin capacity {capacity}")
        if prefixes is None:
            target = next((b for b in bins if b.tokens + size <= capacity), None)
            if target is None:
                target = Bin()
                bins.append(target)
            target.samples.append(i)
            target.tokens += size
            continue
        best, best_shared = None, -1
        for b in bins:
            shared = _shared(prefixes[i], b.shared)
            if b.tokens + size - shared <= capacity and shared > best_shared:
                best, best_shared = b, shared
        if best is None:
            best, best_shared = Bin(), 0
            bins.append(best)
        best.samples.append(i)
        best.tokens += size - best_shared
        best.shared.update(key for key, _ in prefixes[i])
    return bins


def _shared(prefix: Sequence[tuple[int, int]], present: set[int]) -> int:
    """Tokens of ``prefix`` already in a bin: up to its deepest trie id the bin holds (a
    trie id stands for its whole path, so the ones before it are there too)."""
    tokens = 0
    for key, upto in prefix:
        if key not in present:
            break
        tokens = upto
    return tokens


def costs(tokens: np.ndarray, square_sums: np.ndarray, linear: float, quadratic: float) -> np.ndarray:
    """A bin's cost: ``linear * tokens + quadratic * sum of its samples' lengths squared``."""
    return linear * np.asarray(tokens, np.float64) + quadratic * np.asarray(square_sums, np.float64)


def balance(cost: Sequence[float], ranks: int) -> list[list[int]]:
    """Bins (by their costs; the count a multiple of ``ranks``) into ``ranks`` groups of
    equal size with close total costs; each group lists its bins in ascending order."""
    n = len(cost)
    if ranks < 1 or n % ranks:
        raise ValueError(f"{n} bins do not split evenly over {ranks} ranks")
    if n == 0:
        return [[] for _ in range(ranks)]
    candidates = [balanced_differencing(cost, ranks), balanced_lpt(cost, ranks)]
    best = min(candidates, key=lambda groups: (max_cost(cost, groups), groups))
    return [sorted(g) for g in best]


def max_cost(cost: Sequence[float], groups: Sequence[Sequence[int]]) -> float:
    """The largest group total."""
    return max((sum(cost[i] for i in g) for g in groups), default=0.0)


def balanced_lpt(cost: Sequence[float], ranks: int) -> list[list[int]]:
    """Longest processing time first, with equal cardinality: the costliest bin first, each
    to the least loaded rank that still has room (``len / ranks`` bins each)."""
    room = len(cost) // ranks
    groups: list[list[int]] = [[] for _ in range(ranks)]
    loads = [0.0] * ranks
    for i in sorted(range(len(cost)), key=lambda i: (-cost[i], i)):
        r = min((r for r in range(ranks) if len(groups[r]) < room), key=lambda r: (loads[r], r))
        groups[r].append(i)
        loads[r] += cost[i]
    return groups


def balanced_differencing(cost: Sequence[float], ranks: int) -> list[list[int]]:
    """The balanced largest differencing method (Karmarkar-Karp with equal cardinality).

    The bins, costliest first, are cut into rounds of ``ranks``; each round is a partial
    partition with one bin per rank. Repeatedly the two partial partitions whose spread
    (largest minus smallest subset) is widest are merged, largest subset of one with the
    smallest of the other, until one is left: every subset took one bin per round."""
    if not len(cost):
        return [[] for _ in range(ranks)]
    order = sorted(range(len(cost)), key=lambda i: (-cost[i], i))
    heap: list[tuple[float, int, list[tuple[float, list[int]]]]] = []
    for k, start in enumerate(range(0, len(order), ranks)):
        subsets = sorted(((cost[i], [i]) for i in order[start : start + ranks]), key=lambda s: -s[0])
        heapq.heappush(heap, (-(subsets[0][0] - subsets[-1][0]), k, subsets))
    tick = len(heap)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        # a and b are sorted by sum, descending: a's largest with b's smallest.
        merged = sorted(((sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, reversed(b))), key=lambda s: -s[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), tick, merged))
        tick += 1
    return [list(items) for _, items in heap[0][2]]
