"""The reference packer's rules (``benchmarks/reference_packer.py``), which the trainer-feed
benchmark's peer and the tests' reference model (``support.batches``) share: the train-once
rule against its plainest statement (a set of the (node, k) tokens already in a loss), FFD's
order and room, LPT's equal counts."""

from __future__ import annotations

import random

import numpy as np
import pytest

from benchmarks.reference_packer import apply_train_once, ffd, lpt


def _token_set_rule(branches: list[tuple[list[int], list[int], list[bool], int]]) -> list[list[bool]]:
    """Per sample (path, node sizes, sampled mask, kept length), in order: a sampled token is in
    the loss when no earlier sample's loss held the same (node, k)."""
    taken: set[tuple[int, int]] = set()
    out = []
    for path, sizes, sampled, n in branches:
        origin = [(node, k) for node, size in zip(path, sizes) for k in range(size)]
        mask = []
        for pos in range(n):
            mine = sampled[pos] and origin[pos] not in taken
            if mine:
                taken.add(origin[pos])
            mask.append(mine)
        out.append(mask)
    return out


@pytest.mark.parametrize("seed", range(60))
def test_train_once_is_the_token_set_rule(seed: int) -> None:
    """Random trees of nodes, samples along random root-to-leaf paths (a path several times,
    with other cuts) cut to a random length (inside a node, on a boundary, or not at all):
    the prefix bookkeeping equals the token set."""
    rng = random.Random(seed)
    parents = [None] + [rng.randrange(i) for i in range(1, rng.randint(2, 9))]
    sizes = [rng.randint(0, 6) for _ in parents]
    masks = [[rng.random() < 0.6 for _ in range(size)] for size in sizes]
    leaves = [i for i in range(len(parents)) if i not in parents]
    branches = []
    for leaf in [rng.choice(leaves) for _ in range(2 * len(leaves) + 2)]:
        path = []
        at: int | None = leaf
        while at is not None:
            path.append(at)
            at = parents[at]
        path.reverse()
        full = sum(sizes[i] for i in path)
        n = rng.randint(0, full) if rng.random() < 0.5 else full
        sampled = [m for i in path for m in masks[i]]
        branches.append((path, [sizes[i] for i in path], sampled, n))

    trained: dict[object, int] = {}
    got, shared = [], 0
    for path, path_sizes, sampled, n in branches:
        loss = np.array(sampled[:n], np.bool_)
        shared += apply_train_once(loss, zip(path, path_sizes), trained)
        got.append(loss.tolist())
    want = _token_set_rule(branches)
    assert got == want
    assert shared == sum(sum(b[2][: b[3]]) for b in branches) - sum(sum(m) for m in want)


def test_train_once_leaves_a_first_sample_alone_and_counts_what_it_takes() -> None:
    trained: dict[object, int] = {}
    first = np.array([False, True, True, True, True])
    assert apply_train_once(first, [("prompt", 1), ("turn", 4)], trained) == 0
    assert first.tolist() == [False, True, True, True, True] and trained == {"prompt": 1, "turn": 4}
    cut = np.array([False, True, True])  # the same nodes, cut inside the turn
    assert apply_train_once(cut, [("prompt", 1), ("turn", 4)], trained) == 2
    assert cut.tolist() == [False, False, False]
    assert trained == {"prompt": 1, "turn": 4}  # a shorter cut does not forget what was trained
    again = np.array([False, True, True, True, True])
    assert apply_train_once(again, [("prompt", 1), ("turn", 4)], trained) == 4
    assert not again.any()


def test_ffd_longest_first_ties_in_order_first_bin_with_room() -> None:
    assert ffd([3, 5, 3, 2, 5], 8) == [[1, 0], [4, 2], [3]]
    assert ffd([], 8) == []
    assert ffd([9], 8) == [[0]]  # a sample over the capacity gets a bin of its own


def test_lpt_gives_every_rank_as_many_bins_costliest_first() -> None:
    groups = lpt([10, 9, 8, 1, 1, 1], 3)
    assert sorted(len(g) for g in groups) == [2, 2, 2]
    assert sorted(sorted(g) for g in groups) == [[0, 5], [1, 4], [2, 3]]
