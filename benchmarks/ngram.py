"""A token n-gram model with Witten-Bell smoothing, for the realistic workload's logprobs.

Fitted on the encoded corpus, it gives each sampled token the log-probability of the
token given the ``order - 1`` before it, interpolated down to the unigram (add-one
smoothed over the vocabulary): at each level ``p = (n + b * T * p_lower) / (seen + b * T)``,
where ``seen`` is how often the context was followed by anything, ``T`` by how many
distinct tokens and ``n`` by this one. ``b = 1`` is Witten-Bell; the default ``b`` below
1 makes a context the corpus always continued the same way give a logprob near zero, as a
confident policy does on text it knows, and leaves the long negative tail to the tokens it
did not see coming.

Counts are kept per order as sorted 64-bit keys (a polynomial hash of the n-gram; 64-bit
collisions among a few million n-grams are not expected, and the hash is deterministic),
looked up with ``searchsorted``: no Python loop per token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

ORDER = 5
CONFIDENCE = 0.1
_MUL = np.uint64(0x9E3779B97F4A7C15)


def _hash(cols: list[np.ndarray]) -> np.ndarray:
    """A 64-bit key of each row of the n-gram columns (oldest token first)."""
    h = np.full(len(cols[0]), np.uint64(len(cols)), np.uint64)
    with np.errstate(over="ignore"):
        for c in cols:
            h = (h ^ (c.astype(np.uint64) + np.uint64(1))) * _MUL
    return h


def _lookup(keys: np.ndarray, values: np.ndarray, query: np.ndarray) -> np.ndarray:
    """``values`` at ``query`` (0 where a query key is not among ``keys``)."""
    if not len(keys):
        return np.zeros(len(query))
    at = np.minimum(np.searchsorted(keys, query), len(keys) - 1)
    return np.where(keys[at] == query, values[at], 0.0)


@dataclass
class _Level:
    """The counts of one order k >= 2: n-grams, and their (k-1)-token contexts."""

    keys: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    counts: np.ndarray = field(default_factory=lambda: np.zeros(0))
    ctx_keys: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    ctx_seen: np.ndarray = field(default_factory=lambda: np.zeros(0))
    ctx_types: np.ndarray = field(default_factory=lambda: np.zeros(0))


def _windows(s: np.ndarray, k: int) -> list[np.ndarray]:
    return [s[i : len(s) - k + 1 + i] for i in range(k)]


@dataclass
class NGram:
    vocab: int
    order: int
    confidence: float
    tokens: int
    unigram: np.ndarray
    levels: dict[int, _Level]

    @classmethod
    def fit(cls, sequences: list[np.ndarray], vocab: int, order: int = ORDER, confidence: float = CONFIDENCE) -> NGram:
        """Counts over every sequence (no n-gram crosses from one sequence to the next)."""
        if order < 1:
            raise ValueError(f"order {order}: at least 1")
        seqs = [np.asarray(s, np.int64) for s in sequences]
        for s in seqs:
            if s.size and (s.min() < 0 or s.max() >= vocab):
                raise ValueError(f"token ids outside [0, {vocab})")
        unigram = np.zeros(vocab)
        for s in seqs:
            unigram += np.bincount(s, minlength=vocab)
        levels: dict[int, _Level] = {}
        for k in range(2, order + 1):
            grams, ctxs = [], []
            for s in seqs:
                if len(s) >= k:
                    w = _windows(s, k)
                    grams.append(_hash(w))
                    ctxs.append(_hash(w[:-1]))
            if not grams:
                levels[k] = _Level()
                continue
            g, c = np.concatenate(grams), np.concatenate(ctxs)
            keys, first, counts = np.unique(g, return_index=True, return_counts=True)
            # Each distinct n-gram's context, then per context: occurrences and distinct followers.
            ctx_of = c[first]
            order_ctx = np.argsort(ctx_of, kind="stable")
            ctx_sorted = ctx_of[order_ctx]
            ctx_keys, starts = np.unique(ctx_sorted, return_index=True)
            ctx_seen = np.add.reduceat(counts[order_ctx].astype(np.float64), starts)
            ctx_types = np.diff(np.append(starts, len(ctx_sorted))).astype(np.float64)
            levels[k] = _Level(keys, counts.astype(np.float64), ctx_keys, ctx_seen, ctx_types)
        return cls(vocab, order, confidence, int(unigram.sum()), unigram, levels)

    def logprobs(self, context: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """Natural-log probability of each of ``tokens`` after ``context`` (the tokens
        before the first one) and the tokens of ``tokens`` before it."""
        tokens = np.asarray(tokens, np.int64)
        n = len(tokens)
        ctx = np.asarray(context, np.int64)[-(self.order - 1) :] if self.order > 1 else np.zeros(0, np.int64)
        seq = np.concatenate([ctx, tokens])
        k0 = len(ctx)
        p = (self.unigram[tokens] + 1.0) / (self.tokens + self.vocab)
        b = self.confidence
        for k in range(2, self.order + 1):
            level = self.levels[k]
            # Rows whose k-gram fits: position i of tokens needs k-1 tokens before it in seq.
            have = np.arange(n) + k0 >= k - 1
            if not have.any():
                break
            idx = np.flatnonzero(have) + k0
            cols = [seq[idx - (k - 1) + j] for j in range(k)]
            seen = _lookup(level.ctx_keys, level.ctx_seen, _hash(cols[:-1]))
            types = _lookup(level.ctx_keys, level.ctx_types, _hash(cols[:-1]))
            count = _lookup(level.keys, level.counts, _hash(cols))
            lower = p[have]
            p[have] = np.where(seen > 0, (count + b * types * lower) / np.maximum(seen + b * types, 1e-300), lower)
        return np.log(p)
