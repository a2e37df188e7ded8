"""What the per-turn credit references (returns, gae, vtrace) share, written as plain loops
over the generated dicts: which traces they credit, each branch's turns and whether it
bootstraps, and a shared node's value (a stamped table is read back with
:func:`support.state_traces.result`).

A *turn* is a node on a branch with sampled tokens; a branch is a root-to-leaf path. A
branch bootstraps its last value (instead of ending at 0) when its trace stopped at a
limit (``LIMITS``, a timeout) or the branch is a compaction attempt, or it is not
trainable (an attempt that no compaction resumed).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

LIMITS = (
    *("max_turns", "max_input_tokens", "max_output_tokens", "max_total_tokens"),
    *("max_turn_tokens", "compaction_failed"),
)
"""The stop conditions that truncate a rollout (its last value is bootstrapped)."""


def num(node: dict[str, Any], field: str | None) -> float:
    """A node's numeric field (0 when absent, null, a bool or not a number)."""
    value = node.get(field) if field else None
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


def credited(trace: dict[str, Any], outcome: float | None, terminal_reward: bool, include_failed: bool) -> bool:
    """Whether a credit run assigns ``trace`` (scored when its reward counts; ok and not
    timed out unless failed rollouts are included)."""
    if terminal_reward and outcome is None:
        return False
    return include_failed or (bool(trace.get("ok")) and not trace.get("is_timeout"))


@dataclass
class Branch:
    """One root-to-leaf path of a trace, as a turn loop sees it."""

    turns: list[int]
    """The path's nodes holding sampled tokens, root first."""
    trainable: bool
    bootstraps: bool
    """The last turn's value is bootstrapped (a limit, an attempt, not trainable)."""


def branches(trace: dict[str, Any]) -> Iterator[Branch]:
    """The trace's branches, leaf by leaf in node order."""
    nodes = trace["nodes"]
    parents = [n.get("parent") for n in nodes]
    resumed = {link["node"] for n in nodes for link in n.get("semantic_parents") or [] if link["type"] == "compaction"}
    limit = trace.get("stop_condition") in LIMITS or bool(trace.get("is_timeout"))
    for leaf in [i for i in range(len(nodes)) if i not in parents]:
        path, at = [], leaf
        while at is not None:
            path.insert(0, at)
            at = parents[at]
        attempt = any(link["type"] == "compaction_attempt" for link in nodes[leaf].get("semantic_parents") or [])
        trainable = not attempt or leaf in resumed
        turns = [i for i in path if sum(nodes[i].get("mask") or [])]
        yield Branch(turns, trainable, limit or attempt or not trainable)


def turn_values(
    branch: Branch,
    nodes: list[dict[str, Any]],
    outcome: float | None,
    *,
    reward_field: str | None,
    value_field: str | None,
    bootstrap_field: str | None,
    terminal_reward: bool,
) -> tuple[list[float], list[float], float]:
    """A branch's per-turn rewards (``reward_field``, the outcome added to the last turn's
    with ``terminal_reward``), values (``value_field``) and the value after its last turn:
    0 at a terminal end, else the last turn's ``bootstrap_field`` (default: its value)."""
    turns = branch.turns
    r = [num(nodes[i], reward_field) for i in turns]
    if terminal_reward:
        assert outcome is not None
        r[-1] += outcome
    v = [num(nodes[i], value_field) for i in turns]
    v_end = 0.0
    if branch.bootstraps:
        v_end = num(nodes[turns[-1]], bootstrap_field) if bootstrap_field else v[-1]
    return r, v, v_end


def per_node(
    trace: dict[str, Any],
    outcome: float | None,
    branch_credit: Callable[[Branch, list[dict[str, Any]], float | None], dict[int, float]],
    out: dict[tuple[str, int], float],
) -> None:
    """Credit each branch of ``trace`` with ``branch_credit(branch, nodes, outcome)`` (node
    -> value; called for branches holding turns) and keep, for a
    node several branches share, the first trainable branch's value, else the first
    branch's (tracedb's rule: one node, one value)."""
    per_branch = [(b.trainable, branch_credit(b, trace["nodes"], outcome) if b.turns else {}) for b in branches(trace)]
    for prefer in (True, False):
        for trainable, credit in per_branch:
            if trainable == prefer:
                for node, value in credit.items():
                    out.setdefault((trace["id"], node), value)
