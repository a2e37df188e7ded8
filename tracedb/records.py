"""The records tracedb stores: pydantic models of the verifiers v1 record (Episode, Trace,
MessageNode), the node fields it keeps in columns, and the trace-reward rule.

They are the contract tracedb validates against. Every model keeps unknown fields
(``extra="allow"``), so a record from a newer producer survives a round trip, and a
semantic edge ``type`` is any string, not an enum. Per-token streams follow the
verifiers layouts: ``mask`` and ``is_content`` are per token, the compact streams hold
one value per True in ``mask``, ``loss_weights`` streams are per token.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError, ValidationError

COMPACT_STREAMS = ("logprobs", "advantages", "reference_logprobs", "trainer_logprobs", "entropies")
"""Streams with one value per sampled token (True in ``mask``)."""
OPTIONAL_STREAMS = COMPACT_STREAMS[1:]
"""Compact streams where None (never assigned) differs from an empty list."""

NODE_KEYS = (
    "parent",
    "semantic_parents",
    "message",
    "sampled",
    "timestamp",
    "token_ids",
    "mask",
    "is_content",
    *COMPACT_STREAMS,
    "loss_weights",
)
"""Node fields stored in their own columns; bit ``i`` of ``nodes.present`` says key ``i``
was in the record (so an absent key and an explicit null read back as they were written)."""
BIT = {k: 1 << i for i, k in enumerate(NODE_KEYS)}
"""``present`` bit of each of :data:`NODE_KEYS`."""
WEIGHT_VERSIONS_BIT = 1 << len(NODE_KEYS)
"""``present`` bit: the record held ``weight_versions`` (its spans in ``nodes.weight_versions``,
a null for an explicit null). Not in :data:`BIT`: the parsers keep the key with the unknown
fields, and ingest moves it into its column (:func:`tracedb.ingest.rows.split_weight_versions`)."""


def trace_reward(rewards: Mapping[str, Any] | None) -> float | None:
    """A trace's reward: the weighted sum of the scores present, None when none is scored.

    ``rewards`` is ``Trace.rewards`` as the record holds it (``{name: {score, weight}}``,
    a value None when that scoring did not run), already checked against :class:`Reward`:
    ingest rejects a record whose rewards the model refuses instead of guessing a reward.
    The one definition of the rule; ``traces.reward`` is stored from it.
    """
    scored = [r for r in (rewards or {}).values() if r is not None]
    if not scored:
        return None
    total = 0.0
    for r in scored:
        score, weight = (r.score, r.weight) if isinstance(r, Reward) else (r["score"], r.get("weight", 1.0))
        total += score * weight
    return float(total)


def non_finite(value: Any) -> tuple[tuple[str | int, ...], float] | None:
    """The first NaN or infinity inside a JSON value (keys and list positions down to
    it, and the number), or None. Iterative: a record may nest deeper than Python's
    recursion limit."""
    stack: list[tuple[tuple[str | int, ...], Any]] = [((), value)]
    while stack:
        path, x = stack.pop()
        if isinstance(x, float):
            if not math.isfinite(x):
                return path, x
        elif isinstance(x, dict):
            stack.extend((path + (k,), v) for k, v in reversed(list(x.items())))
        elif isinstance(x, list | tuple):
            stack.extend((path + (i,), v) for i, v in reversed(list(enumerate(x))))
    return None


def _refuse_non_finite(value: Any, at: tuple[str | int, ...] = ()) -> None:
    found = non_finite(value)
    if found is not None:
        path, number = found
        error = PydanticCustomError("finite_number", "Input should be a finite number")  # pydantic's own words
        raise ValidationError.from_exception_data("finite", [InitErrorDetails(type=error, loc=at + path, input=number)])


NUMBERS_CHECKED = {"numbers_finite": True}
"""The validation context (``model_validate(obj, context=NUMBERS_CHECKED)``) of a record
whose JSON text is known to hold no NaN, no infinity and no number beyond the double
range: ingest's compiled scanner refuses a line holding one itself (the parser words
it). Free-form values are then not walked again for them (~35 ms per 133 MB of
text-heavy rollouts, measured)."""


def _numbers_checked(info: ValidationInfo) -> bool:
    return isinstance(info.context, dict) and info.context.get("numbers_finite") is True


def _finite_json(value: Any, info: ValidationInfo) -> Any:
    if not _numbers_checked(info):
        _refuse_non_finite(value)
    return value


FiniteJson = Annotated[Any, AfterValidator(_finite_json)]
"""Free-form JSON (a message, ``info``, ``metrics``) holding no NaN or infinity."""


class _Open(BaseModel):
    # strict: a "1" is not a parent index and a 0 is not a mask entry; values are never
    # converted, so what is stored is what was written. No NaN or infinity anywhere: not
    # in a number the contract declares (streams, rewards, weights, timestamps), where a
    # NaN reward poisons every group mean it enters, and not in free-form JSON (a message,
    # info, metrics, timing, unknown fields), which tracedb hands back as JSON, which has
    # neither. Python's json reads them; verifiers never writes them (pydantic writes
    # null), so such a record did not come from it.
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    @model_validator(mode="after")
    def _finite_extras(self, info: ValidationInfo) -> _Open:
        if _numbers_checked(info):
            return self
        for key, value in (self.__pydantic_extra__ or {}).items():
            _refuse_non_finite(value, (key,))
        return self


class ParentLink(_Open):
    """A typed causal link to another node of the same trace (not ancestry)."""

    node: int = Field(ge=0)
    """Index into ``Trace.nodes`` of the linked node."""
    type: str
    """The edge type, e.g. ``compaction``; unknown types are kept as they are."""


class WeightVersionSpan(_Open):
    """Completion tokens ``[start, end)`` of a node (positions among its sampled tokens,
    as its compact ``logprobs``) were sampled by the engine weights labelled ``version``
    (verifiers 0.4.1)."""

    version: str
    start: int = Field(ge=0)
    end: int = Field(ge=0)


class MessageNode(_Open):
    """One distinct message and the tokens it adds to the running sequence."""

    parent: int | None = Field(default=None, ge=0)
    """Index of the predecessor node; None for a root."""
    semantic_parents: list[ParentLink] = Field(default_factory=list)
    """Typed incoming causal links."""
    message: dict[str, FiniteJson]
    """The system / user / assistant / tool message, kept as written."""
    sampled: bool = False
    """True when a model call produced this message."""
    timestamp: float | None = None
    """Wall-clock epoch seconds when the node was created."""
    token_ids: list[int] = Field(default_factory=list)
    """Only the tokens this node adds."""
    mask: list[bool] = Field(default_factory=list)
    """Per token: True on sampled (trainable) tokens."""
    is_content: list[bool] = Field(default_factory=list)
    """Per token when non-empty: message body vs template scaffold."""
    logprobs: list[float] = Field(default_factory=list)
    """Compact: sampling logprobs, one per True in ``mask``; empty when unknown."""
    advantages: list[float] | None = None
    """Compact credit; None means never assigned, which is not zero credit."""
    reference_logprobs: list[float] | None = None
    """Compact reference-model logprobs, or None."""
    trainer_logprobs: list[float] | None = None
    """Compact trainer-recomputed logprobs, or None."""
    entropies: list[float] | None = None
    """Compact trainer entropies, or None."""
    loss_weights: dict[str, list[float]] | None = None
    """Named per-token weight streams, aligned to ``token_ids``."""
    weight_versions: list[WeightVersionSpan] | None = None
    """Which engine weights sampled which of the node's sampled tokens (verifiers 0.4.1);
    None when the engine labels none. Stored in ``nodes.weight_versions``."""

    @property
    def n_sampled(self) -> int:
        """Number of True entries in ``mask``."""
        return sum(self.mask)


class Reward(_Open):
    """A named, weighted reward."""

    score: float
    weight: float = 1.0


class Trace(_Open):
    """One agent's rollout: its message graph plus run metadata."""

    version: int = 1
    id: str
    """Unique trace id; tracedb's key."""
    nodes: list[MessageNode] = Field(default_factory=list)
    """The message graph; list order is the node id."""
    rewards: dict[str, Reward | None] | None = None
    """Named rewards; a None value means scoring did not run."""
    ok: bool = False
    is_completed: bool = False
    stop_condition: str | None = None
    is_timeout: bool = False
    dropped: str | None = None
    """Why consumers leave this trace out of reward means and training batches (verifiers
    0.4.1; independent of ``ok``); None when it is kept."""

    @property
    def reward(self) -> float | None:
        """Weighted sum of the scored rewards; None when nothing was scored (:func:`trace_reward`)."""
        return trace_reward(self.rewards)


class GroupInfo(_Open):
    id: str


class PolicySpan(_Open):
    """The span of live policy versions while an episode was generated."""

    start: int
    end: int

    @model_validator(mode="after")
    def _ordered(self) -> PolicySpan:
        if self.end < self.start:
            raise ValueError(f"policy.end ({self.end}) is below policy.start ({self.start})")
        return self


class WorkInfo(_Open):
    """What a training run dispatched the episode as: ``train`` or ``eval`` work at ``step``."""

    type: str
    step: int
    policy: PolicySpan | None = None


class RunInfo(_Open):
    """The run an episode belongs to (``type`` ``train``: with its ``work``; ``eval``: none)."""

    type: str
    id: str
    name: str | None = None
    work: WorkInfo | None = None


class Episode(_Open):
    """One line of ``traces.jsonl``: a run's traces for one task."""

    id: str
    group: GroupInfo | None = None
    run: RunInfo | None = None
    """verifiers' ``Episode.run``: the training step and live policy span of the episode."""
    ok: bool = False
    traces: list[Trace] = Field(default_factory=list)
