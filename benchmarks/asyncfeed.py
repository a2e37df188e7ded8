"""The asynchronous trainer's feed: ``micro_batches`` with a staleness bound against the
plain call, and what the policy-version spans cost the file (``python -m benchmarks async``).

**Workload.** The core workload's episodes (``benchmarks/workload.py``, read back from the
verifiers-written file) as an asynchronous run (:func:`tracedb.synthetic.versioned`): every
group dispatched at step ``STEP`` with a policy span on every episode (``run.work.policy``
= ``[STEP - 1, STEP]``) and 1-3 weight-version spans per assistant node (a weight swap
mid-turn); then exactly 25% of the groups made zero-variance (one reward for every member)
and exactly 20% moved two versions further back, so stale at ``K = 1`` (:func:`_shape`:
``versioned`` draws its shares per group, which at 32 groups can land far from them).
Written with ``json.dumps`` (verifiers 0.4.0, the version the core workload is written
with, has no ``weight_versions``). A twin file holds the same episodes without the spans.

**Figures** (medians over ``repeat`` runs, warm, one database):

- ``plain``: ``micro_batches(seq_len, ranks=...)`` on the versioned database (the baseline);
- ``bound``: the same with ``policy=STEP, max_staleness=1`` (prime-rl's rule: stale groups
  left out whole), and ``mask``: with ``stale="mask"`` (stale groups kept, their old tokens
  out of the loss): each at most ``TARGET``x the plain call;
- ``twin`` (info): the plain call over the same call on the spanless twin, whose tokens
  take their version from the episode's policy span (what the spans cost the feed);
- ``spans``: the bytes the spans add to the database file (versioned minus the twin, both
  closed), at most ``SPAN_TARGET`` of the twin's; ``column``: ``nodes.weight_versions``' own
  bytes from ``db.storage()`` (without the unused block tails charged to it), at most
  ``SPAN_TARGET`` of the file.

Correctness, checked every run: the bound leaves out exactly the groups whose oldest
member's ``policy_min`` is below ``STEP - 1``, no loss token of a bounded plan is older
than the bound, and the masked plan packs every sample the plain one does.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

import tracedb
from benchmarks import tables
from benchmarks.harness import CorrectnessError, Metric, Run, db_bytes, remove_db, repeats, timed
from benchmarks.workload import WorkloadFiles
from tracedb.synthetic import versioned

RESULTS = Path(__file__).resolve().parent / "results-async.json"
QUICK = {"traces": 16, "tokens": 3_000, "repeat": 1}
FULL = {"traces": 256, "tokens": 30_000, "repeat": 5}
TARGET = 1.15
"""A staleness bound costs at most this multiple of the plain call."""
SPAN_TARGET = 0.01
"""The spans add at most this share to the file's bytes."""
STEP = 5
"""The trainer's policy version; every group is dispatched at this step."""
K = 1
"""The staleness bound measured."""
STALE_SHARE = 0.2
ZERO_VARIANCE_SHARE = 0.25


def _shape(episodes: list[dict[str, Any]], seed: int) -> tuple[set[str], set[str]]:
    """Exactly ``STALE_SHARE`` of the groups (rounded) two policy versions further back
    (``run.work.policy`` and every span label, as :func:`versioned`'s lag does) and exactly
    ``ZERO_VARIANCE_SHARE`` with one reward for every member (advantages 0), each drawn
    with ``seed``; returns both sets of group ids."""
    by_group: dict[str, list[dict[str, Any]]] = {}
    for ep in episodes:
        by_group.setdefault((ep.get("group") or {}).get("id", ep["id"]), []).append(ep)
    order = sorted(by_group)
    rng = np.random.default_rng(seed + 31)
    stale = {order[i] for i in rng.permutation(len(order))[: round(STALE_SHARE * len(order))]}
    flat = {order[i] for i in rng.permutation(len(order))[: round(ZERO_VARIANCE_SHARE * len(order))]}
    for gid in stale:
        for ep in by_group[gid]:
            policy = ep["run"]["work"]["policy"]
            policy["start"], policy["end"] = policy["start"] - 2, policy["end"] - 2
            for trace in ep["traces"]:
                for node in trace["nodes"]:
                    for span in node.get("weight_versions") or ():
                        span["version"] = f"step_{int(span['version'].removeprefix('step_')) - 2}"
    for gid in flat:
        for ep in by_group[gid]:
            for trace in ep["traces"]:
                trace["rewards"] = {"resolved": {"score": 1.0, "weight": 1.0}}
                for node in trace["nodes"]:
                    if node.get("advantages") is not None:
                        node["advantages"] = [0.0] * len(node["advantages"])
    return stale, flat


def write_runs(files: WorkloadFiles, rundir: Path, seed: int = 0) -> tuple[Path, Path, dict[str, Any]]:
    """The versioned run and its spanless twin under ``rundir``; facts about them."""
    versioned_path, twin_path = rundir / "versioned.jsonl", rundir / "twin.jsonl"
    with files.jsonl.open() as src:
        episodes = [json.loads(line) for line in src]
    groups = len({(e.get("group") or {}).get("id", e["id"]) for e in episodes})
    episodes = list(
        versioned(
            episodes,
            step=STEP,
            groups_per_step=groups,
            stale_share=0.0,
            zero_variance_share=0.0,
            seed=seed,
            first_step=STEP,
        )
    )
    stale, flat = _shape(episodes, seed)
    spans = nodes = 0
    with versioned_path.open("w") as out, twin_path.open("w") as twin:
        for ep in episodes:
            out.write(json.dumps(ep, separators=(",", ":")) + "\n")
            for trace in ep["traces"]:
                for node in trace["nodes"]:
                    held = node.pop("weight_versions", None)
                    if held:
                        spans += len(held)
                        nodes += 1
            twin.write(json.dumps(ep, separators=(",", ":")) + "\n")
    return (
        versioned_path,
        twin_path,
        {
            "groups": groups,
            "stale_groups": len(stale),
            "zero_variance_groups": len(flat),
            "spans": spans,
            "nodes_with_spans": nodes,
            "jsonl_bytes": versioned_path.stat().st_size,
            "twin_jsonl_bytes": twin_path.stat().st_size,
        },
    )


def ingest(jsonl: Path, db_path: Path) -> float:
    """A fresh database of ``jsonl``, closed (checkpointed); its seconds."""
    remove_db(db_path)
    start = time.perf_counter()
    with tracedb.connect(db_path) as db:
        report = db.ingest(jsonl, progress=False)
    if not report.ok:
        raise CorrectnessError(f"tracedb rejected the versioned run: {report.rejected[:3]}")
    return time.perf_counter() - start


def _packed(plan: Any) -> set[str]:
    return {t for rank in plan for mb in rank for t in mb.samples.column("trace_id").to_pylist()}


def _loss_versions(plan: Any) -> np.ndarray:
    out = [np.zeros(0, np.int64)]
    for rank in plan:
        for mb in rank:
            t = mb.tokens
            if "policy_version" not in t.schema.names:
                raise CorrectnessError("a micro-batch of the versioned run has no policy_version column")
            loss = t.column("loss_mask").to_numpy(zero_copy_only=False)
            v = t.column("policy_version")
            known = v.is_valid().to_numpy(zero_copy_only=False)
            out.append(v.fill_null(-1).to_numpy(zero_copy_only=False)[loss & known].astype(np.int64))
    return np.concatenate(out)


def check(db: Any, plain: Any, bound: Any, mask: Any) -> dict[str, Any]:
    """The bounded and masked plans against the rule, read from the database in SQL."""
    floor = STEP - K
    stale = db.sql(
        "SELECT group_id, count(*) AS traces FROM traces GROUP BY group_id HAVING min(policy_min) < ?", [floor]
    ).to_pylist()
    groups = db.scalar("SELECT count(DISTINCT group_id) FROM traces")
    r = bound.report
    if r.stale_groups != len(stale) or r.stale_traces != sum(g["traces"] for g in stale):
        raise CorrectnessError(f"bound: {r.stale_groups} stale groups reported, {len(stale)} in the database")
    stale_ids = set(db.traces(group=[g["group_id"] for g in stale]).column("trace_id").to_pylist()) if stale else set()
    if _packed(bound) & stale_ids or _packed(bound) != _packed(plain) - stale_ids:
        raise CorrectnessError("bound: the packed traces are not the plain plan's minus the stale groups'")
    ages = STEP - _loss_versions(bound)
    if len(ages) and ages.max() > K:
        raise CorrectnessError(f"bound: a loss token {ages.max()} versions old (bound {K})")
    if _packed(mask) != _packed(plain) or (mask.report.stale_tokens == 0) != (not stale):
        raise CorrectnessError("mask: not every plain sample packed, or no token masked")
    return {
        "passed": True,
        "groups": groups,
        "stale_groups": len(stale),
        "stale_group_share": len(stale) / groups if groups else None,
        "bound_samples": r.samples,
        "plain_samples": plain.report.samples,
        "masked_tokens": mask.report.stale_tokens,
        "off_policy_level": r.off_policy_level,
        "off_policy_max": r.off_policy_max,
    }


def run(
    files: WorkloadFiles,
    workdir: Path,
    repeat: int,
    *,
    log: Callable[[str], None],
    seq_len: int = 32_768,
    ranks: int = 8,
) -> dict[str, Any]:
    """Build the runs, measure the three calls and the bytes; returns the results."""
    frame = Run()
    rundir = workdir / "async"
    rundir.mkdir(parents=True, exist_ok=True)
    log("writing the versioned run and its spanless twin")
    versioned_path, twin_path, facts = write_runs(files, rundir)
    db_path, twin_db = rundir / "versioned.duckdb", rundir / "twin.duckdb"
    log("tracedb: ingest both (untimed)")
    setup = {
        "ingest_versioned": round(ingest(versioned_path, db_path), 2),
        "ingest_twin": round(ingest(twin_path, twin_db), 2),
    }
    m = {
        "bound": Metric("bound", f"micro_batches policy={STEP}, max_staleness={K} vs plain", "multiple", TARGET),
        "mask": Metric("mask", "  same, stale='mask' vs plain", "multiple", TARGET),
        "twin": Metric("twin", "plain call: with spans vs its spanless twin", "multiple", None),
    }
    sizes = {"versioned": db_bytes(db_path), "twin": db_bytes(twin_db)}
    m["spans"] = Metric("spans", "file bytes the spans add (share of the twin's)", "fraction", SPAN_TARGET, unit="MB")
    m["spans"].peer.append(sizes["twin"] / 1e6)
    m["spans"].tracedb.append((sizes["versioned"] - sizes["twin"]) / 1e6)
    m["column"] = Metric(
        "column", "  nodes.weight_versions' own bytes (share of the file)", "fraction", SPAN_TARGET, unit="MB"
    )

    def call(db: Any, **kwargs: Any) -> Any:
        return db.micro_batches(seq_len, ranks=ranks, **kwargs)

    with tracedb.connect(db_path, read_only=True) as db, tracedb.connect(twin_db, read_only=True) as twin:
        storage = db.storage()
        column = next(
            (
                c
                for t in storage["tables"]
                if t["table"] == "nodes"
                for c in t["columns"]
                if c["column"] == "weight_versions"
            ),
            None,
        )
        m["column"].peer.append(sizes["versioned"] / 1e6)
        m["column"].tracedb.append(((column or {}).get("bytes", 0) - (column or {}).get("tail_bytes", 0)) / 1e6)
        log("warm-up (untimed): each call once")
        plain, bound, mask = (
            call(db),
            call(db, policy=STEP, max_staleness=K),
            call(db, policy=STEP, max_staleness=K, stale="mask"),
        )
        call(twin)
        correctness = check(db, plain, bound, mask)
        del plain, bound, mask
        for _, first in repeats(repeat, log):
            order = ["plain", "bound", "mask"] if first else ["mask", "bound", "plain"]
            samples = {}
            for name in order:
                kwargs = {} if name == "plain" else {"policy": STEP, "max_staleness": K}
                if name == "mask":
                    kwargs["stale"] = "mask"
                samples[name] = timed(partial(call, db, **kwargs))[0]
            spanless = timed(partial(call, twin))[0]
            m["bound"].add(samples["plain"], samples["bound"])
            m["mask"].add(samples["plain"], samples["mask"])
            m["twin"].add(spanless, samples["plain"])
    return frame.results(
        workload={**files.manifest, "path": str(files.jsonl)},
        versioned={
            **facts,
            "step": STEP,
            "k": K,
            "stale_share": STALE_SHARE,
            "zero_variance_share": ZERO_VARIANCE_SHARE,
        },
        call={"seq_len": seq_len, "ranks": ranks},
        setup_seconds=setup,
        file_bytes={
            **sizes,
            "weight_versions_column": None if column is None else column.get("bytes"),
            "weight_versions_tail": None if column is None else column.get("tail_bytes"),
        },
        repeat=repeat,
        metrics=m,
        correctness=correctness,
    )


def render(results: dict[str, Any]) -> str:
    """The table, then the workload, bytes, correctness and machine lines."""
    header = ("metric", "plain / twin median (min)", "tracedb median (min)", "ratio", "target", "result")
    lines = tables.metric_table(results["metrics"], header, digits=4)
    v, c, b = results["versioned"], results["correctness"], results["file_bytes"]
    lines += [
        "",
        f"workload: the core run ({results['workload']['traces']} traces, {v['groups']} groups) at step {v['step']}, "
        f"{v['spans']:,} weight-version spans on {v['nodes_with_spans']:,} nodes, {v['stale_groups']} groups two "
        f"versions back, {v['zero_variance_groups']} zero-variance; micro_batches({results['call']['seq_len']}, "
        f"ranks={results['call']['ranks']})",
        f"bytes: database {b['versioned']:,} with spans, {b['twin']:,} without; nodes.weight_versions "
        f"{b['weight_versions_column'] or 0:,} bytes in db.storage(), {b['weight_versions_tail'] or 0:,} of them the "
        "unused tails of blocks it shares (charged to its last segments; the twin's all-null column is "
        "charged as many)",
        f"correctness: {c['stale_groups']} of {c['groups']} groups stale at K={v['k']} "
        f"({c['stale_group_share']:.0%}), left out whole ({c['bound_samples']} of {c['plain_samples']} samples packed, "
        f"off-policy level {c['off_policy_level']}, max {c['off_policy_max']}); masked: {c['masked_tokens']:,} tokens "
        "out of the loss: " + ("PASSED" if c["passed"] else "FAILED"),
        "ratios: "
        + ", ".join(f"{k} {results['metrics'][k]['ratio']:.3f}" for k in ("bound", "mask", "twin", "spans", "column")),
        tables.machine_line(results),
        *tables.load_lines(results["other_load"]),
    ]
    return "\n".join(lines)
