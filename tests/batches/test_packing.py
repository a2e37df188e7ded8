"""``tracedb.batches.packing`` on plain numbers, against brute force.

- ``balance``: equal-size groups; on small cases (ranks 2-3, up to 9 bins) its largest
  group cost is within 7/6 of the best equal-cardinality partition (every one is
  enumerated), and never worse than either method it picks from;
- ``pack``: first-fit decreasing, every item once, no bin over capacity, and at most
  11/9 OPT + 6/9 bins (OPT by exhaustive search, up to 8 items).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator, Sequence

import pytest

from tracedb.batches import packing

from support.batches import ffd

BALANCE_BOUND = 7 / 6


def group_cost(cost: Sequence[float], groups: Sequence[Sequence[int]]) -> float:
    return max(sum(cost[i] for i in g) for g in groups)


def equal_partitions(items: list[int], ranks: int) -> Iterator[list[list[int]]]:
    """Every partition of ``items`` into ``ranks`` unordered groups of equal size."""
    if ranks == 1:
        yield [items]
        return
    size = len(items) // ranks
    first, rest = items[0], items[1:]
    for others in itertools.combinations(rest, size - 1):
        group = [first, *others]
        left = [i for i in rest if i not in others]
        for tail in equal_partitions(left, ranks - 1):
            yield [group, *tail]


def optimum(cost: Sequence[float], ranks: int) -> float:
    return min(group_cost(cost, p) for p in equal_partitions(list(range(len(cost))), ranks))


def check_groups(groups: list[list[int]], n: int, ranks: int) -> None:
    assert len(groups) == ranks
    assert all(len(g) == n // ranks for g in groups), groups
    assert sorted(i for g in groups for i in g) == list(range(n))


def test_equal_partitions_counts() -> None:
    """The enumeration itself: 9 items in 3 groups of 3 is 9!/(3!^3 3!) = 280 ways."""
    assert sum(1 for _ in equal_partitions(list(range(9)), 3)) == 280
    assert sum(1 for _ in equal_partitions(list(range(8)), 2)) == 35
    assert sum(1 for _ in equal_partitions(list(range(6)), 3)) == 15


def cases() -> Iterator[tuple[list[float], int]]:
    """A few hundred seeded small cases: integer and float costs, skewed ones, and zero
    cost padding bins as the plan adds them."""
    rng = random.Random(20240611)
    for k in range(360):
        ranks = rng.choice([2, 3])
        n = ranks * rng.randint(1, 9 // ranks if ranks == 3 else 4)
        kind = k % 4
        if kind == 0:
            cost = [float(rng.randint(1, 20)) for _ in range(n)]
        elif kind == 1:
            cost = [rng.uniform(0, 100) for _ in range(n)]
        elif kind == 2:
            cost = [rng.expovariate(1.0) ** 2 * 100 for _ in range(n)]
        else:
            real = rng.randint(1, n)
            cost = [float(rng.randint(1, 50)) for _ in range(real)] + [0.0] * (n - real)
        yield cost, ranks


def test_balance_is_close_to_the_optimum() -> None:
    worst = 1.0
    for cost, ranks in cases():
        groups = packing.balance(cost, ranks)
        check_groups(groups, len(cost), ranks)
        assert all(g == sorted(g) for g in groups)
        best = optimum(cost, ranks)
        got = group_cost(cost, groups)
        assert got >= best - 1e-9
        lpt = group_cost(cost, packing.balanced_lpt(cost, ranks))
        kk = group_cost(cost, packing.balanced_differencing(cost, ranks))
        assert got <= min(lpt, kk) + 1e-9, (cost, ranks)
        if best > 0:
            worst = max(worst, got / best)
    print(f"worst balance / optimum over the seeded cases: {worst:.4f}")
    assert worst <= BALANCE_BOUND, worst


@pytest.mark.parametrize("method", [packing.balanced_lpt, packing.balanced_differencing])
def test_each_method_makes_equal_groups(method: object) -> None:
    rng = random.Random(7)
    for _ in range(100):
        ranks = rng.randint(1, 5)
        n = ranks * rng.randint(0, 6)
        cost = [rng.uniform(0, 10) for _ in range(n)]
        groups = method(cost, ranks)  # type: ignore[operator]
        check_groups(groups, n, ranks)


def test_balance_edges() -> None:
    assert packing.balance([], 3) == [[], [], []]
    assert packing.balance([5.0, 1.0, 1.0, 5.0], 2) in ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    assert sorted(packing.balance([3.0, 3.0, 3.0], 3)) == [[0], [1], [2]]
    with pytest.raises(ValueError):
        packing.balance([1.0, 2.0, 3.0], 2)
    with pytest.raises(ValueError):
        packing.balance([1.0], 0)


def test_costs() -> None:
    assert packing.costs([10, 0], [50.0, 0.0], 1.0, 0.5).tolist() == [35.0, 0.0]
    assert packing.costs([7], [49.0], 2.0, 0.0).tolist() == [14.0]


# --------------------------------------------------------------------------- pack


def fits(items: list[int], bins: int, capacity: int) -> bool:
    """Exhaustive: can ``items`` go into ``bins`` bins of ``capacity``?"""
    loads = [0] * bins

    def place(k: int) -> bool:
        if k == len(items):
            return True
        tried = set()
        for b in range(bins):
            if loads[b] in tried or loads[b] + items[k] > capacity:
                continue
            tried.add(loads[b])
            loads[b] += items[k]
            if place(k + 1):
                return True
            loads[b] -= items[k]
        return False

    return place(0)


def opt_bins(items: list[int], capacity: int) -> int:
    items = sorted(items, reverse=True)
    k = max(1, -(-sum(items) // capacity))
    while not fits(items, k, capacity):
        k += 1
    return k


def test_pack_first_fit_decreasing_against_brute_force() -> None:
    rng = random.Random(99)
    worst = 0.0
    for case in range(400):
        capacity = rng.choice([10, 16, 25, 100])
        n = rng.randint(1, 8)
        low = 1 if case % 3 else capacity // 4
        lengths = [rng.randint(low, capacity) for _ in range(n)]
        bins = packing.pack(lengths, capacity)
        assert sorted(i for b in bins for i in b.samples) == list(range(n))
        for b in bins:
            assert b.tokens == sum(lengths[i] for i in b.samples) <= capacity
        assert sorted(sorted(b.samples) for b in bins) == sorted(sorted(b) for b in ffd(lengths, capacity))
        best = opt_bins(lengths, capacity)
        assert best <= len(bins) <= 11 / 9 * best + 6 / 9, (lengths, capacity)
        worst = max(worst, len(bins) / best)
    assert worst >= 1.0


def test_pack_known_ffd_case() -> None:
    """FFD on 6,5,4,3,2 in bins of 10: [6,4], [5,3,2] (first fit, longest first)."""
    bins = packing.pack([2, 6, 3, 5, 4], 10)
    assert [sorted(b.samples) for b in bins] == [[1, 4], [0, 2, 3]]
    assert [b.tokens for b in bins] == [10, 10]


def test_pack_refuses_an_item_over_capacity() -> None:
    with pytest.raises(ValueError, match="sample 1"):
        packing.pack([3, 11], 10)
    assert packing.pack([], 10) == []


def test_pack_with_prefixes_counts_shared_tokens_once() -> None:
    """Three samples of 8 tokens whose first 6 are one shared prefix (trie ids 1 then 2):
    8 + 2 + 2 = 12 tokens fit one bin of 12; without the prefixes they need three."""
    prefixes = [[(1, 4), (2, 6)]] * 3
    (b,) = packing.pack([8, 8, 8], 12, prefixes=prefixes)
    assert sorted(b.samples) == [0, 1, 2] and b.tokens == 12
    assert len(packing.pack([8, 8, 8], 12)) == 3
    # A sample sharing only the first trie node saves 4 tokens, and goes where it shares most.
    bins = packing.pack([8, 8, 6], 12, prefixes=[[(1, 4), (2, 6)], [(3, 4)], [(1, 4), (2, 6)]])
    by_sample = {i: k for k, b in enumerate(bins) for i in b.samples}
    assert by_sample[2] == by_sample[0] != by_sample[1]
    assert sorted(b.tokens for b in bins) == [8, 8]
