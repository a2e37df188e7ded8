"""Records for the CEC database tests (``tests/cec/test_db_*.py``): the traces of the real
``groups.traces.jsonl`` fixture (four groups of eight SWE-style rollouts; assistant turns
at the even nodes), builders of the harness's trace, turn and verification records, and
the hand-computed case."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from support import FIXTURES

GROUPS = FIXTURES / "groups.traces.jsonl"
EPISODES = [json.loads(line) for line in GROUPS.read_text().splitlines()]
G0 = [ep["traces"][0]["id"] for ep in EPISODES[:8]]  # group-0: rewards 1 1 0 1 0 0 1 1, all valid
G1 = [ep["traces"][0]["id"] for ep in EPISODES[8:16]]
G2 = [ep["traces"][0]["id"] for ep in EPISODES[16:24]]  # group-2: two failed (ok: false) members
TRACES = {ep["traces"][0]["id"]: ep["traces"][0] for ep in EPISODES}


def assistant_nodes(trace: dict[str, Any]) -> list[int]:
    """The sampled assistant nodes of a trace (the turns of the harness)."""
    return [i for i, n in enumerate(trace["nodes"]) if n["message"]["role"] == "assistant" and n.get("sampled")]


def n_sampled(trace: dict[str, Any], node: int) -> int:
    """The number of sampled tokens of a node."""
    return sum(trace["nodes"][node]["mask"])


def write(path: Path, records: list[Any]) -> Path:
    """``records`` (dicts as JSON, strings as written) as the lines of ``path``."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def trace_record(
    trace_id: str, *, instance: str = "repo__issue-1", rep: int | str = 0, salt: str = "pilot"
) -> dict[str, Any]:
    return {
        "kind": "trace",
        "trace_id": trace_id,
        "baseline_tree": f"{trace_id[:6]}-t0",
        "instance_id": instance,
        "rep": rep,
        "cache_salt": salt,
    }


def turn_records(
    trace_id: str,
    edits: dict[int, list[str]],
    fmt: frozenset[int] = frozenset(),
    trace: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """A turn record for every sampled assistant node; a new tree where paths changed."""
    trace = trace or TRACES[trace_id]
    out, k = [], 0
    for node in assistant_nodes(trace):
        paths = edits.get(node, [])
        if paths:
            k += 1
        out.append(
            {
                "kind": "turn",
                "trace_id": trace_id,
                "node": node,
                "tree": f"{trace_id[:6]}-t{k}",
                "changed_paths": paths,
                "format_error": node in fmt,
            }
        )
    return out


def verification(
    trace_id: str,
    role: str,
    resolved: bool | None = None,
    f2p: dict[str, Any] | None = None,
    p2p: dict[str, Any] | None = None,
    status: str | None = None,
) -> dict[str, Any]:
    record = {"kind": "verification", "trace_id": trace_id, "role": role}
    if status is not None:
        record["status"] = status
    else:
        record.update(resolved=resolved, f2p=f2p, p2p=p2p)
    return record


# --------------------------------------------------------------------------- the hand-computed case

PASS2 = {"t1": "PASSED", "t2": "PASSED"}


def hand_records() -> list[dict[str, Any]]:
    i0, i1, i2, i3, i4, i5, i6, i7 = G0
    g1 = G1[0]
    r: list[dict[str, Any]] = []
    # i0: one block (nodes 4, 6; m = 58 of L = 145); D = 1.25 - 0.125 = 1.125 = 1 + 0.125 + 0.
    r += [trace_record(i0), *turn_records(i0, {4: ["src/a.py"], 6: ["src/b.py"]})]
    r += [verification(i0, "original", True, PASS2, {"p1": "PASSED"})]
    r += [verification(i0, "intervention", False, {"t1": "FAILED", "t2": "PASSED"}, {"p1": "PASSED"})]
    # i1: a format-error trajectory: no query, no auxiliary term (E included).
    r += [trace_record(i1), *turn_records(i1, {2: ["x.py"]}, fmt=frozenset({7}))]
    r += [verification(i1, "original", True, {"t1": "PASSED"}, {})]
    # i2: its only block touches a test path: no eligible block.
    r += [trace_record(i2), *turn_records(i2, {2: ["tests/test_a.py"]})]
    r += [verification(i2, "original", False, {"t1": "FAILED"}, {})]
    # i3: the original report is missing: utility unavailable, no query.
    r += [trace_record(i3), *turn_records(i3, {2: ["a.py"]}), verification(i3, "original", status="missing")]
    # i4: a capped negative contrast: m = 27 of L = 158, D = -0.25 - 1.25 = -1.5 = -1 - 0.25 - 0.25.
    r += [trace_record(i4), *turn_records(i4, {10: ["fix.py"]})]
    r += [verification(i4, "original", False, {"t1": "FAILED"}, {"p": "FAILED"})]
    r += [verification(i4, "intervention", True, {"t1": "PASSED"}, {"p": "PASSED"})]
    # i5: a zero contrast on a failed original (m = 15 of L = 60).
    same = ({"t1": "FAILED", "t2": "PASSED"}, {"p": "PASSED"})
    r += [trace_record(i5), *turn_records(i5, {2: ["m.py"]}), verification(i5, "original", False, *same)]
    r += [verification(i5, "intervention", False, *same)]
    # i6: planned, the intervention not verified yet (m = 17 of L = 76).
    r += [trace_record(i6), *turn_records(i6, {2: ["p.py"]}), verification(i6, "original", True, {"t1": "PASSED"}, {})]
    # i7: the intervention was graded against other lists: unusable.
    r += [trace_record(i7), *turn_records(i7, {2: ["q.py"]}), verification(i7, "original", True, {"t1": "PASSED"}, {})]
    r += [verification(i7, "intervention", True, {"other": "PASSED"}, {})]
    # g1: a failed original whose intervention report could not be parsed.
    r += [trace_record(g1), *turn_records(g1, {2: ["r.py"]}), verification(g1, "original", False, {"t1": "FAILED"}, {})]
    r += [verification(g1, "intervention", status="unparseable")]
    return r
