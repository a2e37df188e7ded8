"""CEC rules as pure functions: test paths, edit blocks and eligibility, verifier-blind
selection, utility, coefficients and quantiles (see :mod:`tracedb.cec`)."""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from tracedb.errors import TraceDBError

if TYPE_CHECKING:
    pass

DEFAULT_LAM = 0.1
"""Coefficient scale lambda."""
DEFAULT_CAP = 1.0
"""Per-token cap c."""
ARMS = ("O", "B", "M", "E")
CREDIT_SETS = {arm: f"cec-{arm}" for arm in ARMS}
"""The credit set each arm is stamped as."""
CEC_SCHEMA_VERSION = 1

TEST_PATH_PATTERNS = (
    r"(^|/)(tests?|testing)(/|_)",
    r"(^|/)test_[^/]*\.py$",
    r"_tests?\.py$",
    r"(^|/)conftest\.py$",
)
"""Repository-relative paths matching any of these (case-sensitive) are test paths."""
_TEST_PATH = re.compile("|".join(f"(?:{p})" for p in TEST_PATH_PATTERNS))

PASSING = frozenset({"PASSED", "XFAIL"})
"""Test outcomes that count as passing (compared upper-cased), as SWE-bench grades them.
Anything else -- FAILED, ERROR, SKIPPED, XPASS, an unknown word, None (absent from the
report) -- is not passing."""

F32_EPS = 2.0**-24
"""Relative rounding bound of one float32 value (half an ulp): stored credit is float32."""


class CecError(TraceDBError):
    """A CEC operation that cannot run (no plan yet, bad parameters, ...)."""


# =========================================================================== rules


def is_test_path(path: str) -> bool:
    """True when a repository-relative path is a test path (:data:`TEST_PATH_PATTERNS`)."""
    return _TEST_PATH.search(path) is not None


def selection_key(instance_id: str, rep: int | str, cache_salt: str) -> str:
    """``instance_id|rep|cache_salt``; an integer ``rep`` enters in decimal."""
    return f"{instance_id}|{rep}|{cache_salt}"


def block_digest(key: str, index: int) -> int:
    """The integer value (big-endian) of the SHA-256 digest of ``key|index`` (UTF-8)."""
    return int.from_bytes(hashlib.sha256(f"{key}|{index}".encode()).digest(), "big")


def select_block(instance_id: str, rep: int | str, cache_salt: str, eligible_indices: Iterable[int]) -> int | None:
    """The eligible block index minimizing :func:`block_digest`; None when there is none.

    Never looks at a verdict. Indices are visited in increasing order, so a tie (only a
    repeated index can tie) keeps the first.
    """
    key = selection_key(instance_id, rep, cache_salt)
    best: int | None = None
    best_digest = 0
    for index in sorted(eligible_indices):
        digest = block_digest(key, index)
        if best is None or digest < best_digest:
            best, best_digest = index, digest
    return best


@dataclass(frozen=True)
class Turn:
    """One assistant turn's snapshot: its node, the tree after its actions, the changed paths."""

    node: int
    tree: str
    changed_paths: tuple[str, ...] = ()
    format_error: bool = False


@dataclass(frozen=True)
class EditBlock:
    """A maximal run of consecutive turns with non-empty changed paths."""

    index: int
    """Chronological, zero-based, assigned before any filtering."""
    nodes: tuple[int, ...]
    """The producing turns (node indices)."""
    pre_tree: str
    """The tree just before the block's first turn (the baseline for the first turn)."""
    post_tree: str
    """The tree after the block's last turn."""
    paths: tuple[str, ...]
    """Every path changed by any of its turns (sorted), including ones changed and restored within it."""
    reasons: tuple[str, ...] = ()
    """Why the block is not eligible: ``no_net_effect``, ``test_path``, ``modified_later``."""

    @property
    def eligible(self) -> bool:
        return not self.reasons

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "nodes": list(self.nodes),
            "pre_tree": self.pre_tree,
            "post_tree": self.post_tree,
            "paths": list(self.paths),
            "eligible": self.eligible,
            "reasons": list(self.reasons),
        }


def edit_blocks(turns: Sequence[Turn], baseline_tree: str) -> list[EditBlock]:
    """The edit blocks of a trace's turns (in chronological order), with eligibility.

    A block is eligible when its net effect is non-empty, it touches no test path, and
    no later turn changes any path it touched (even if a still later turn undoes that).
    The net effect is compared by tree id: every path that differs between the
    pre-block and the post-block tree was changed by a turn of the block, so the net
    effect on the touched paths is empty exactly when the two (content-addressed) trees
    are equal.
    """
    runs: list[list[int]] = []
    current: list[int] = []
    for i, turn in enumerate(turns):
        if turn.format_error and turn.changed_paths:
            raise ValueError(f"node {turn.node}: a format-error turn executes nothing, yet it lists changed paths")
        if turn.changed_paths:
            current.append(i)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    blocks = []
    for index, run in enumerate(runs):
        first, last = run[0], run[-1]
        pre = turns[first - 1].tree if first > 0 else baseline_tree
        post = turns[last].tree
        paths = sorted({p for i in run for p in turns[i].changed_paths})
        touched = set(paths)
        reasons = []
        if pre == post:
            reasons.append("no_net_effect")
        if any(is_test_path(p) for p in paths):
            reasons.append("test_path")
        if any(touched.intersection(t.changed_paths) for t in turns[last + 1 :]):
            reasons.append("modified_later")
        blocks.append(EditBlock(index, tuple(turns[i].node for i in run), pre, post, tuple(paths), tuple(reasons)))
    return blocks


@dataclass(frozen=True)
class Utility:
    """The parts of U = Y + F/4 - G/4, exact (F is a fraction of the F2P list)."""

    y: int
    f: Fraction
    g: int

    @property
    def exact(self) -> Fraction:
        return self.y + self.f / 4 - Fraction(self.g, 4)

    @property
    def value(self) -> float:
        return float(self.exact)


def _passes(outcome: str | None) -> bool:
    return isinstance(outcome, str) and outcome.upper() in PASSING


def utility_parts(
    resolved: bool | int | None, f2p: Mapping[str, str | None] | None, p2p: Mapping[str, str | None] | None
) -> Utility | None:
    """(Y, F, G) of a verification, or None when the utility is unavailable: a missing
    report (any argument None) or an empty F2P list. See :func:`utility`."""
    if resolved is None or f2p is None or p2p is None or len(f2p) == 0:
        return None
    passed = sum(1 for outcome in f2p.values() if _passes(outcome))
    failing_p2p = any(not _passes(outcome) for outcome in p2p.values())
    return Utility(1 if resolved else 0, Fraction(passed, len(f2p)), 1 if failing_p2p else 0)


def utility(
    resolved: bool | int | None, f2p: Mapping[str, str | None] | None, p2p: Mapping[str, str | None] | None
) -> float | None:
    """U(P) = Y + F/4 - G/4 of one verification, or None when unavailable (never 0).

    ``f2p`` and ``p2p`` map each *expected* test id (the fixed, deduplicated lists) to
    its outcome in the report: ``"PASSED"``/``"XFAIL"`` pass (any case); ``"FAILED"``,
    ``"SKIPPED"``, ``"ERROR"``, ``"MISSING"``, any other word, or ``None`` (the test is
    absent from the report) do not. Y is 1 when ``resolved`` is truthy, F the passing
    fraction of the F2P list, G 1 when any P2P test does not pass (0 for an empty P2P
    list). A missing or unparseable report is ``None`` for any argument; an empty F2P
    list also makes the utility unavailable.
    """
    parts = utility_parts(resolved, f2p, p2p)
    return None if parts is None else parts.value


def contrast(original: Utility, intervention: Utility) -> tuple[float, float, float, float]:
    """(D, dY, dF, dG) with D = U(original) - U(intervention) = dY + dF + dG, where
    dY = Y(o) - Y(i), dF = (F(o) - F(i))/4, dG = -(G(o) - G(i))/4. Exact, then rounded."""
    d = original.exact - intervention.exact
    d_y = Fraction(original.y - intervention.y)
    d_f = (original.f - intervention.f) / 4
    d_g = -Fraction(original.g - intervention.g, 4)
    return float(d), float(d_y), float(d_f), float(d_g)


def _check_params(L: int, m: int, lam: float, cap: float) -> None:
    if not (lam > 0 and math.isfinite(lam)):
        raise ValueError(f"lam must be a positive number, got {lam}")
    if not (cap > 0 and math.isfinite(cap)):
        raise ValueError(f"cap must be a positive number, got {cap}")
    if not (0 < m <= L):
        raise ValueError(f"need 0 < m <= L (receiving and generated tokens), got m={m}, L={L}")


def coefficients(
    D: float, L: int, m: int, lam: float = DEFAULT_LAM, cap: float = DEFAULT_CAP
) -> tuple[float, float, float]:
    """``(s, c_M, c_B)``: the shared shrinkage and the per-token coefficients on each
    arm's receiving tokens (M: the m selected tokens, B: all L generated tokens).

    s = 1 if D = 0, else min(1, c*m / (lam*|D|*L)); c_M = lam*D*s*L/m; c_B = lam*D*s.
    When the cap binds these are exactly c*sign(D) and c*sign(D)*m/L.
    """
    _check_params(L, m, lam, cap)
    if not math.isfinite(D):
        raise ValueError(f"D must be finite, got {D}")
    if D == 0:
        return 1.0, 0.0, 0.0
    if cap * m < lam * abs(D) * L:  # capped: magnitude information is gone
        s = cap * m / (lam * abs(D) * L)
        return s, math.copysign(cap, D), math.copysign(cap * m / L, D)
    return 1.0, lam * D * L / m, lam * D


def edit_focus(A: float, L: int, m: int, lam: float = DEFAULT_LAM, cap: float = DEFAULT_CAP) -> float:
    """E's per-token coefficient on the selected tokens: clip(lam*A*L/m, -c, c)."""
    _check_params(L, m, lam, cap)
    return float(min(cap, max(-cap, lam * A * L / m)))


def quantile(values: Iterable[float], q: float) -> float | None:
    """The sorted element at zero-based index floor(q*(N-1)); None for no values."""
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[math.floor(q * (len(ordered) - 1))]


# =========================================================================== records
