"""Pydantic models of every request and response body: the OpenAPI schema comes from here.

Token routes build their JSON directly (numpy through orjson, far faster than model
validation for 32k-token arrays); their models still describe exactly what is sent, and
the schema fuzz test checks responses against them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

Floats = list[float]


CreditStatus = Annotated[
    Literal["unassigned", "zero", "partial", "assigned"],
    Field(
        description="In the credit set asked for (the library's trace_credit_status() / branch_credit_status()): "
        "unassigned (no node holds advantages: never scored), zero (assigned, every value 0: scored, no "
        "gradient), partial (some nodes with sampled tokens unassigned) or assigned."
    ),
]


class FollowerLoss(BaseModel):
    """Bytes a follower knows were in a followed file, are in no file now, and were not ingested."""

    file: str = Field(description="The followed file.")
    bytes: int = Field(description="At least this many bytes.")
    lines: int = Field(description="Of at least this many lines.")
    message: str


class FollowerStatus(BaseModel):
    """The run a server follows (``tracedb serve --follow``): what its follower did so far."""

    state: Literal["following", "failing", "stopped"] = Field(
        description="failing: the last poll raised (last_error); it is tried again, the server goes on."
    )
    paths: list[str]
    rotated: list[str] = Field(
        description="Glob patterns of rotated copies looked at besides NAME.1, NAME.<n>, NAME-<date> (--rotated)."
    )
    files: int = Field(description="Files followed so far.")
    polls: int
    commits: int
    lines: int
    traces: int = Field(description="Traces added.")
    skipped: int = Field(description="Traces read that were already stored.")
    rejected: int = Field(description="Lines rejected (kept in `rejects` with their reason).")
    bytes: int
    watermark: int = Field(description="The watermark after the follower's last commit.")
    behind: bool = Field(description="The last poll stopped at its byte budget with more to read.")
    waiting: dict[str, str] = Field(description="Compressed files not taken yet, and why.")
    restarts: list[str] = Field(
        description="Files read again from their start (shrunk, replaced, cut back and grown again), the last 20."
    )
    rotations: list[str] = Field(
        description="Rotations followed (renamed away, copied and truncated, deleted), the last 20."
    )
    lost: list[FollowerLoss] = Field(
        description="Bytes no file holds any more and that were not ingested (copytruncate, deletion), the last 20."
    )
    lost_bytes: int = Field(description="Bytes lost in all (at least).")
    errors: int = Field(description="Polls that failed.")
    last_error: str | None
    last_error_at: str | None
    last_commit_at: str | None
    interval_s: float
    settle_s: float


class Health(BaseModel):
    status: Literal["ok"] = "ok"
    tracedb_version: str
    schema_version: int
    database: str
    traces: int
    watermark: int = Field(description="The highest ingest sequence number committed (pass it as ?after=).")
    writes_enabled: bool = Field(description="A bearer token is configured (--token / TRACEDB_TOKEN).")
    sql_enabled: bool = Field(description="The server was started with --allow-sql.")
    follower: FollowerStatus | None = Field(None, description="Only on a server started with --follow.")


class TraceRow(BaseModel):
    """One trace in a listing."""

    trace_id: str
    episode_id: str | None
    group_id: str | None
    reward: float | None = Field(description="Weighted sum of scored rewards; null when nothing was scored.")
    ok: bool | None
    stop_condition: str | None
    n_nodes: int
    n_branches: int
    n_tokens: int = Field(description="Tokens over all nodes, each node once.")
    n_sampled: int = Field(description="Sampled (trainable) tokens over all nodes.")


class TracePage(BaseModel):
    traces: list[TraceRow]
    next_cursor: str | None = Field(description="Pass as ?cursor= for the next page; null on the last page.")


class LiveTraceRow(TraceRow):
    """One trace of a live listing (``?after=`` and friends), in arrival order."""

    seq: int = Field(description="The trace's ingest sequence number.")
    is_completed: bool | None
    is_timeout: bool | None
    source: str | None = Field(description="The file the trace was read from.")
    line: int | None
    ingested_at: str | None
    dropped: str | None = Field(None, description="Why consumers leave the trace out (verifiers 0.4.1); null: kept.")
    policy_min: int | None = Field(None, description="The lowest known policy version of its sampled tokens.")
    policy_max: int | None = Field(None, description="The highest.")
    work_type: str | None = Field(None, description="Its episode's work: train or eval.")
    tags: dict[str, Any] = Field(description="The trace's ingest tags.")


class LiveTracePage(BaseModel):
    watermark: int = Field(description="Pass as ?after= next time: nothing is missed, nothing repeated.")
    more: bool = Field(description="The limit stopped the listing short: ask again at once with after=watermark.")
    traces: list[LiveTraceRow]


class SemanticLink(BaseModel):
    node: int
    type: str


class NodeTokens(BaseModel):
    """A node's tokens and streams in full layout (one value per token, 0.0 off-sample)."""

    token_ids: list[int]
    sampled_mask: list[bool]
    logprobs: Floats
    advantages: Floats | None = Field(description="Null when the node holds none in this credit set.")
    reference_logprobs: Floats | None
    trainer_logprobs: Floats | None
    entropies: Floats | None
    loss_weights: dict[str, Floats]
    pieces: list[str] | None = Field(None, description="Decoded text per token (viewer, with --tokenizer).")


class NodeInfo(BaseModel):
    node_index: int
    parent: int | None
    role: str | None
    sampled: bool | None
    n_tokens: int
    n_sampled: int
    has_logprobs: bool
    streams: list[str] = Field(
        description="Optional streams the node holds: advantages (in the chosen credit set), "
        "reference_logprobs, trainer_logprobs, entropies."
    )
    loss_weight_names: list[str]
    semantic_parents: list[SemanticLink]
    message: dict[str, Any] | None = Field(None, description="Only with ?messages=true.")
    tokens: NodeTokens | None = Field(None, description="Only with ?tokens=true.")


class TraceDetail(BaseModel):
    trace_id: str
    episode_id: str | None
    group_id: str | None
    position: int | None
    reward: float | None
    ok: bool | None
    is_completed: bool | None
    is_timeout: bool | None
    stop_condition: str | None
    n_nodes: int
    n_branches: int
    n_tokens: int
    n_sampled: int
    source: str | None
    line: int | None
    ingested_at: str | None
    credit: str = Field(description="The credit set the node list reports advantages from.")
    nodes: list[NodeInfo]


class BranchSummary(BaseModel):
    branch_index: int
    trainable: bool
    leaf: int
    path: list[int] = Field(description="Node indices from the root to the leaf.")
    n_tokens: int
    n_sampled: int
    credit_assigned: bool = Field(description="Some node on the path holds advantages (the view's are not null).")
    credit_status: CreditStatus
    credited_nodes: int
    sampled_nodes: int


class BranchList(BaseModel):
    """A page of a trace's branches, in index order (every branch when it has no more than
    the server's branch row limit)."""

    trace_id: str
    credit: str
    watermark: int | None = Field(
        None, description="With after/complete_groups/through/tag: the watermark the selection was read at."
    )
    n_branches: int = Field(description="The trace's branches in all.")
    branches_from: int = Field(description="The first branch index asked for.")
    limit: int = Field(description="Branches a page holds at most.")
    next_from: int | None = Field(description="Pass as ?branches_from= for the next page; null after the last.")
    branches: list[BranchSummary]


class BranchView(BaseModel):
    """One branch's token view, the fields and null rules of ``db.branches()``; token
    fields not asked for with ?fields= are absent."""

    trace_id: str
    branch_index: int
    trainable: bool
    token_ids: list[int] | None = None
    sampled_mask: list[bool] | None = None
    logprobs: Floats | None = None
    advantages: Floats | None = Field(None, description="Null when no node on the path holds advantages.")
    reference_logprobs: Floats | None = None
    trainer_logprobs: Floats | None = None
    entropies: Floats | None = None
    loss_weights: dict[str, Floats] | None = None


class BranchSelection(BaseModel):
    """``GET /branches`` as JSON: the branch views of a selection, bounded by the server's
    token limit and branch row limit (whole traces; ``truncated`` says when it stopped there)."""

    watermark: int = Field(description="Pass as ?after= for the rest and what arrived since.")
    traces: int
    tokens: int = Field(description="View tokens answered (the branches' lengths summed).")
    token_limit: int
    n_branches: int = Field(description="Branches answered.")
    branch_limit: int = Field(description="The most branches one answer holds (the server's --branch-row-limit).")
    truncated: bool
    truncated_by: Literal["tokens", "branches"] | None = Field(description="Which limit stopped the answer.")
    truncated_why: str | None
    branches: list[BranchView]


class Stats(BaseModel):
    """``db.stats()``: counts and sizes."""

    path: str
    schema_version: int
    episodes: int
    traces: int
    nodes: int
    branches: int
    segments: int
    rejects: int
    tokens: int
    sampled_tokens: int
    branch_tokens: int = Field(description="Tokens over every branch view (shared prefixes counted per branch).")
    stored_tokens: int = Field(description="Tokens stored (each distinct segment once).")
    dedup_ratio: float | None
    bytes: int | None = Field(description="The database file and its WAL (null in memory).")
    watermark: int


class GroupTrace(TraceRow):
    credited_nodes: int
    sampled_nodes: int
    credit_status: CreditStatus


class GroupDetail(BaseModel):
    group_id: str
    credit: str
    n_traces: int
    reward_mean: float | None
    reward_std: float | None = Field(description="Population std of the scored rewards.")
    zero_variance: bool = Field(description="Every scored member has the same reward: no group-relative gradient.")
    traces: list[GroupTrace]


class CreditSet(BaseModel):
    name: str
    algorithm: str
    params: Any = None
    description: str | None
    created_at: str | None
    assigned_nodes: int


class CreditSetCreate(BaseModel):
    name: str = Field(min_length=1, max_length=200)
    algorithm: str = Field("manual", max_length=200)
    params: dict[str, Any] = Field(default_factory=dict)
    description: str | None = Field(None, max_length=10_000)
    replace: bool = False


class PolicyVersionsWrite(BaseModel):
    versions: dict[Annotated[str, Field(min_length=1, max_length=500)], Annotated[int, Field(ge=0, le=2**31 - 1)]] = (
        Field(description="Weight label -> policy version (labels such as step_12 name their own).", max_length=10_000)
    )


class PolicyVersionsResult(BaseModel):
    labels: int = Field(description="Labels mapped.")
    traces: int = Field(description="Traces whose policy-version bounds were stored again.")


class PolicyLabel(BaseModel):
    label: str
    version: int
    set_at: str | None


class AdvantagesWrite(BaseModel):
    values: Floats | None = Field(
        description="One value per sampled token of the node (compact layout); null clears the node."
    )


class WriteResult(BaseModel):
    trace_id: str
    node_index: int
    credit: str
    nodes_written: int


class Reject(BaseModel):
    file: str | None
    line: int | None
    trace_id: str | None
    node: int | None
    field: str | None
    reason: str


class IngestResult(BaseModel):
    files: int
    lines: int
    episodes: int
    traces: int
    skipped: int = Field(description="Traces already present, not added again.")
    nodes: int
    tokens: int
    segments_added: int
    rejected: list[Reject]
    seconds: float


class SqlQuery(BaseModel):
    sql: str = Field(min_length=1, max_length=100_000, description="One SELECT statement; tracedb's macros are there.")
    limit: int | None = Field(None, ge=1, description="At most this many rows (capped by the server's row limit).")


class SqlColumn(BaseModel):
    name: str
    type: str


class SqlResult(BaseModel):
    columns: list[SqlColumn]
    rows: list[list[Any]]
    row_count: int
    truncated: bool = Field(description="The answer stopped before the last matching row.")
    truncated_by: Literal["rows", "bytes"] | None = Field(
        default=None, description="What stopped it: the row limit or the byte budget of the answer."
    )
    truncated_why: str | None = None
    limit: int
    max_bytes: int = Field(description="The byte budget of the answer's rows (JSON).")
    elapsed_ms: float
