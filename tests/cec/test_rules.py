"""The pure rules of counterfactual edit credit: test paths, blocks and eligibility,
verifier-blind selection (against a direct SHA-256 computation), utility, coefficients
(hand-computed cases, a capped one, D = 0), edit focus, the quantile convention, and the
M/B identities on random inputs."""

from __future__ import annotations

import hashlib
import math
import random
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tracedb import cec
from tracedb.cec import Turn

# --------------------------------------------------------------------------- test paths

TEST_PATHS = [
    "tests/test_x.py",
    "pkg/tests/test_x.py",
    "pkg/tests/helpers.py",
    "test/a.c",
    "testing/util.py",
    "pkg/testing/x.py",
    "pkg/test_utils/x.py",  # (tests?|testing)_ as a directory prefix
    "tests_helpers.py",
    "test_x.txt",  # test_ at the start of a path component, any extension
    "pkg/test_foo.py",
    "foo_test.py",
    "pkg/foo_tests.py",
    "conftest.py",
    "a/b/conftest.py",
]
NOT_TEST_PATHS = [
    "src/app.py",
    "latest/x.py",  # "test/" but not at a component start
    "contest.py",
    "Tests/x.py",  # case-sensitive
    "pkg/TEST_x.py",
    "pkg/testdata.py",
    "src/mytest.py",
    "attest_x.py",
    "pkg/x_test.pyc",
    "conftest.pyc",
    "pkg/conftest.py.orig",
    "docs/testimony.md",
]


@pytest.mark.parametrize("path", TEST_PATHS)
def test_test_paths(path: str) -> None:
    assert cec.is_test_path(path)


@pytest.mark.parametrize("path", NOT_TEST_PATHS)
def test_not_test_paths(path: str) -> None:
    assert not cec.is_test_path(path)


# --------------------------------------------------------------------------- selection


def direct(instance_id: str, rep: int | str, salt: str, eligible: list[int]) -> int | None:
    """The rule spelled out: argmin over eligible of int(sha256('iid|rep|salt|index')), first on ties."""
    best = None
    for i in eligible:
        value = int(hashlib.sha256(f"{instance_id}|{rep}|{salt}|{i}".encode()).hexdigest(), 16)
        if best is None or value < best[0]:
            best = (value, i)
    return None if best is None else best[1]


def test_selection_matches_a_direct_sha256_computation() -> None:
    rng = random.Random(7)
    chosen = set()
    for _ in range(300):
        instance = rng.choice(["django__django-14007", "sympy__sympy-15875", "astropy__astropy-12907"])
        rep = rng.choice([0, 3, 7, "alias-2"])
        salt = rng.choice(["pilot", "w17", ""])
        eligible = sorted(rng.sample(range(40), rng.randint(1, 8)))
        got = cec.select_block(instance, rep, salt, eligible)
        assert got == direct(instance, rep, salt, eligible)
        chosen.add(eligible.index(got))
    assert len(chosen) > 3  # not always the first or the last eligible block


def test_selection_edge_cases() -> None:
    assert cec.select_block("i", 0, "s", []) is None
    assert cec.select_block("i", 0, "s", [5]) == 5
    # A hand-checked digest: the key and index are joined with '|'.
    key = cec.selection_key("inst", 2, "salt")
    assert key == "inst|2|salt"
    assert cec.block_digest(key, 3) == int(hashlib.sha256(b"inst|2|salt|3").hexdigest(), 16)
    # The order indices come in does not matter; a repeated index (the only possible tie) keeps one.
    eligible = [9, 1, 4, 4, 7]
    assert cec.select_block("x", 1, "y", eligible) == direct("x", 1, "y", sorted(set(eligible)))
    # An integer rep enters the key in decimal, like the string.
    assert cec.select_block("x", 12, "y", range(20)) == cec.select_block("x", "12", "y", range(20))


# --------------------------------------------------------------------------- blocks


def T(node: int, tree: str, *paths: str, fmt: bool = False) -> Turn:
    return Turn(node, tree, tuple(paths), fmt)


def test_blocks_are_maximal_runs_indexed_before_filtering() -> None:
    turns = [
        T(2, "t1", "a.py"),
        T(4, "t2", "b.py"),  # same block as node 2
        T(6, "t2"),  # read-only: ends the block
        T(8, "t3", "tests/test_a.py"),  # block 1: a test path
        T(10, "t3", fmt=True),  # format error: unchanged snapshot, ends the block
        T(12, "t4", "c.py"),  # block 2
        T(14, "t5", "d.py"),
        T(16, "t5"),
        T(18, "t6", "e.py"),  # block 3
        T(20, "t6"),
        T(22, "t7", "e.py"),  # block 4 modifies block 3's path
    ]
    blocks = cec.edit_blocks(turns, "t0")
    assert [b.index for b in blocks] == [0, 1, 2, 3, 4]
    assert [b.nodes for b in blocks] == [(2, 4), (8,), (12, 14), (18,), (22,)]
    assert [(b.pre_tree, b.post_tree) for b in blocks] == [
        ("t0", "t2"),
        ("t2", "t3"),
        ("t3", "t5"),
        ("t5", "t6"),
        ("t6", "t7"),
    ]
    assert [b.reasons for b in blocks] == [(), ("test_path",), (), ("modified_later",), ()]
    assert blocks[0].paths == ("a.py", "b.py")
    assert blocks[0].to_dict()["eligible"] and not blocks[1].eligible


def test_eligibility_rules() -> None:
    # Changed and restored within the block: every path counts, the net effect is judged by trees.
    turns = [T(2, "t1", "a.py"), T(4, "t0", "a.py"), T(6, "t0")]
    (block,) = cec.edit_blocks(turns, "t0")
    assert block.paths == ("a.py",) and block.reasons == ("no_net_effect",)
    # A path changed and restored inside the block, another kept: eligible, both touched.
    turns = [T(2, "t1", "a.py", "b.py"), T(4, "t2", "a.py"), T(6, "t2")]
    (block,) = cec.edit_blocks(turns, "t0")
    assert block.paths == ("a.py", "b.py") and block.eligible
    # Modified later, even when a still later turn restores it; several reasons at once.
    turns = [T(2, "t1", "a.py", "tests/x.py"), T(4, "t1"), T(6, "t2", "a.py"), T(8, "t2"), T(10, "t1", "a.py")]
    blocks = cec.edit_blocks(turns, "t0")
    assert blocks[0].reasons == ("test_path", "modified_later")
    assert blocks[1].reasons == ("modified_later",)
    assert blocks[2].eligible  # the last block restores what block 1 did: it has a net effect
    # No turn changes anything: no blocks at all.
    assert cec.edit_blocks([T(2, "t0"), T(4, "t0", fmt=True)], "t0") == []
    assert cec.edit_blocks([], "t0") == []
    with pytest.raises(ValueError, match="format-error turn"):
        cec.edit_blocks([T(2, "t1", "a.py", fmt=True)], "t0")


# --------------------------------------------------------------------------- utility


def test_utility_values() -> None:
    f2p = {"a": "PASSED", "b": "PASSED", "c": "FAILED"}
    assert cec.utility(True, f2p, {"p": "PASSED"}) == pytest.approx(1 + (2 / 3) / 4)
    assert cec.utility(False, {"a": "FAILED"}, {"p": "FAILED"}) == -0.25  # the minimum
    assert cec.utility(True, {"a": "PASSED"}, {"p": "PASSED"}) == 1.25  # the maximum
    assert cec.utility(1, {"a": "PASSED"}, {}) == 1.25  # resolved may be 0/1
    parts = cec.utility_parts(False, f2p, {"p": "PASSED", "q": "ERROR"})
    assert (parts.y, parts.f, parts.g) == (0, Fraction(2, 3), 1)


def test_utility_edge_cases() -> None:
    # Unavailable, never zero: an empty F2P list, a missing / unparseable report.
    assert cec.utility(True, {}, {"p": "PASSED"}) is None
    assert cec.utility(None, {"a": "PASSED"}, {}) is None
    assert cec.utility(True, None, {}) is None
    assert cec.utility(True, {"a": "PASSED"}, None) is None
    # An empty P2P list gives G = 0.
    assert cec.utility(False, {"a": "PASSED"}, {}) == 0.25
    # Skipped, missing (None or the word), errors and unknown words do not pass.
    for outcome in ("SKIPPED", "MISSING", None, "ERROR", "XPASS", "weird", ""):
        assert cec.utility(False, {"a": outcome}, {}) == 0.0, outcome
        assert cec.utility(False, {"a": "PASSED"}, {"p": outcome}) == 0.0, outcome
    # PASSED and XFAIL pass, in any case.
    for outcome in ("PASSED", "passed", "XFAIL", "xfail"):
        assert cec.utility(False, {"a": outcome}, {"p": outcome}) == 0.25, outcome


def test_contrast_parts_add_up_exactly() -> None:
    o = cec.utility_parts(False, {"a": "FAILED", "b": "FAILED"}, {"p": "PASSED"})
    i = cec.utility_parts(True, {"a": "PASSED", "b": "PASSED"}, {"p": "PASSED"})
    assert cec.contrast(o, i) == (-1.25, -1.0, -0.25, 0.0)  # sympy-15875 in the paper's appendix D
    o = cec.utility_parts(True, {"a": "PASSED"}, {"p": "PASSED"})
    i = cec.utility_parts(False, {"a": "FAILED"}, {"p": "FAILED"})
    assert cec.contrast(o, i) == (1.5, 1.0, 0.25, 0.25)  # django-14007
    # Cancelling parts give an exact zero, not a rounding residue.
    o = cec.utility_parts(False, {"a": "PASSED", "b": "FAILED", "c": "FAILED"}, {"p": "FAILED"})
    i = cec.utility_parts(False, {"a": "FAILED", "b": "FAILED", "c": "FAILED"}, {"p": "FAILED"})
    d, d_y, d_f, d_g = cec.contrast(o, i)
    assert d == d_y + d_f + d_g == pytest.approx(1 / 12)
    o = cec.utility_parts(False, {"a": "PASSED"}, {"p": "FAILED"})
    i = cec.utility_parts(False, {"a": "FAILED"}, {"p": "PASSED"})
    assert cec.contrast(o, i) == (0.0, 0.0, 0.25, -0.25)


# --------------------------------------------------------------------------- coefficients


def test_coefficients_uncapped() -> None:
    # s = min(1, 1*100 / (0.1*0.5*1000)) = min(1, 2) = 1; c_M = 0.1*0.5*1000/100; c_B = 0.1*0.5.
    s, c_m, c_b = cec.coefficients(0.5, 1000, 100)
    assert (s, c_m, c_b) == (1.0, pytest.approx(0.5), pytest.approx(0.05))
    s, c_m, c_b = cec.coefficients(-0.25, 400, 200, lam=0.2, cap=2.0)
    assert (s, c_m, c_b) == (1.0, pytest.approx(-0.1), pytest.approx(-0.05))
    # Exactly at the cap: c*m = lam*|D|*L, s = 1 and c_M = c.
    assert cec.coefficients(1.0, 100, 10) == (1.0, pytest.approx(1.0), pytest.approx(0.1))


def test_coefficients_capped() -> None:
    # The paper's django-14007 example: D = 1.5, L = 21162, m = 186.
    s, c_m, c_b = cec.coefficients(1.5, 21162, 186)
    assert s == pytest.approx(186 / (0.1 * 1.5 * 21162)) and round(s, 5) == 0.05860
    assert c_m == 1.0  # exactly c * sign(D)
    assert c_b == pytest.approx(186 / 21162) and round(c_b, 5) == 0.00879
    assert c_m * 186 == pytest.approx(c_b * 21162) == pytest.approx(186)  # equal signed mass
    s, c_m, c_b = cec.coefficients(-1.25, 1000, 10, cap=0.5)
    assert s == pytest.approx(0.5 * 10 / (0.1 * 1.25 * 1000))
    assert (c_m, c_b) == (-0.5, pytest.approx(-0.5 * 10 / 1000))


def test_coefficients_zero_contrast_and_bad_input() -> None:
    assert cec.coefficients(0.0, 1000, 10) == (1.0, 0.0, 0.0)
    assert cec.coefficients(-0.0, 5, 5) == (1.0, 0.0, 0.0)
    for args in [(0.5, 10, 0), (0.5, 10, 11), (0.5, 0, 0)]:
        with pytest.raises(ValueError, match="m <= L"):
            cec.coefficients(*args)
    with pytest.raises(ValueError, match="lam"):
        cec.coefficients(0.5, 10, 5, lam=0)
    with pytest.raises(ValueError, match="cap"):
        cec.coefficients(0.5, 10, 5, cap=-1)
    with pytest.raises(ValueError, match="finite"):
        cec.coefficients(math.nan, 10, 5)


def test_edit_focus() -> None:
    assert cec.edit_focus(0.5, 1000, 100) == pytest.approx(0.5)  # 0.1 * 0.5 * 10
    assert cec.edit_focus(0.5, 1000, 10) == 1.0  # clipped at c
    assert cec.edit_focus(-0.625, 158, 27, cap=0.5) == pytest.approx(-0.1 * 0.625 * 158 / 27)
    assert cec.edit_focus(-3.0, 100, 10, cap=0.5) == -0.5
    assert cec.edit_focus(0.0, 100, 10) == 0.0


def test_quantile_convention() -> None:
    values = list(range(10, 0, -1))  # unsorted on purpose
    assert cec.quantile(values, 0.05) == 1  # index floor(0.05*9) = 0
    assert cec.quantile(values, 0.5) == 5  # index floor(4.5) = 4: the lower median
    assert cec.quantile(values, 0.95) == 9  # index floor(8.55) = 8
    assert cec.quantile([3.0], 0.95) == 3.0
    assert cec.quantile([], 0.5) is None
    assert cec.quantile(range(21), 0.95) == 19


# --------------------------------------------------------------------------- identities


@settings(max_examples=300, deadline=None)
@given(
    d=st.one_of(st.just(0.0), st.floats(-1.5, 1.5, allow_nan=False).filter(lambda x: abs(x) > 1e-9)),
    L=st.integers(1, 100_000),
    frac=st.floats(0.0, 1.0),
    lam=st.floats(0.001, 10.0),
    cap=st.floats(0.001, 10.0),
)
def test_identities_on_random_coefficients(d: float, L: int, frac: float, lam: float, cap: float) -> None:
    m = max(1, min(L, round(frac * L)))
    s, c_m, c_b = cec.coefficients(d, L, m, lam, cap)
    assert 0 < s <= 1
    assert abs(c_m) <= cap * (1 + 1e-12)  # the cap bounds M's per-token coefficient
    C_M = np.zeros(L)
    C_M[:m] = c_m
    C_B = np.full(L, c_b)
    mass = lam * d * s * L
    assert C_M.sum() == pytest.approx(mass, rel=1e-9, abs=1e-12)
    assert C_B.sum() == pytest.approx(mass, rel=1e-9, abs=1e-12)
    assert np.abs(C_M).sum() == pytest.approx(np.abs(C_B).sum(), rel=1e-9, abs=1e-12)
    if d != 0:
        assert (C_M**2).sum() / (C_B**2).sum() == pytest.approx(L / m, rel=1e-9)
        capped = cap * m < lam * abs(d) * L
        assert (s < 1) == capped
        if capped:
            assert c_m == math.copysign(cap, d)
    else:
        assert c_m == c_b == 0.0 and s == 1.0
