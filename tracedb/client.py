"""A small client of ``tracedb serve``, standard library only (``urllib``) besides
pyarrow: poll a live run for new traces, fetch branch views and a trainer rank's
micro-batches, run SQL, read the stats.

Every call takes the server's base URL (``http://127.0.0.1:8000``). An HTTP error is
raised as :class:`ServerError` with the status and the server's own message; a server
that cannot be reached as :class:`ServerUnreachable`. Tag filters are a mapping as in
:meth:`tracedb.Database.branches` (``{"step": 12}``, ``{"step": (10, None)}``).

A trainer rank, fed by a server that follows the run::

    after = 0
    while True:
        batches, report = client.micro_batches(url, 8192, rank=r, ranks=R, after=after, complete_groups=8)
        train(batches)
        after = report["watermark"]
"""

from __future__ import annotations

import io
import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc

from tracedb.batches import MicroBatch, Replay
from tracedb.batches.plan import SAMPLES_SCHEMA
from tracedb.errors import TraceDBError
from tracedb.selection import Selection

ARROW_STREAM = "application/vnd.apache.arrow.stream"
TIMEOUT_S = 60.0
"""How long a call waits for the server's answer (a long-poll: its wait on top)."""


class ServerError(TraceDBError):
    """The server answered with an error: ``status``, its code (``error``) and message (``detail``)."""

    def __init__(self, url: str, status: int, error: str, detail: str) -> None:
        super().__init__(f"{url}: HTTP {status} {error}: {detail}")
        self.url, self.status, self.error, self.detail = url, status, error, detail


class ServerUnreachable(TraceDBError):
    """No answer from the server (refused, timed out, not HTTP)."""


def _tag_params(tags: Mapping[str, Any] | None) -> list[tuple[str, str]]:
    """``tags`` as ``tag=`` parameters: values as JSON (a string quoted, so ``"12"`` stays
    a string), a ``(low, high)`` range as ``low..high``."""
    out = []
    for name, want in (tags or {}).items():
        if isinstance(want, tuple):
            low, high = ("" if v is None else json.dumps(v) for v in want)
            out.append(("tag", f"{name}={low}..{high}"))
        else:
            out.append(("tag", f"{name}={json.dumps(want)}"))
    return out


def _selected(selection: Selection) -> dict[str, Any]:
    """A selection as the server's query parameters (``trace_id`` repeated, ``tag=``)."""
    values = selection.kwargs()
    values["trace_id"] = values.pop("trace_ids")
    return values


def _params(**values: Any) -> list[tuple[str, str]]:
    """Query parameters: None left out, booleans as true/false, sequences repeated."""
    out: list[tuple[str, str]] = []
    for key, value in values.items():
        if value is None:
            continue
        if key == "tags":
            out += _tag_params(value)
            continue
        items = [value] if isinstance(value, str | int | float | bool) else list(value)
        out += [(key, ("true" if v else "false") if isinstance(v, bool) else str(v)) for v in items]
    return out


def _replay_params(replay: Any) -> dict[str, Any]:
    """A :class:`tracedb.Replay` as ``/micro-batches``' ``replay*`` parameters. A use limit
    is refused (one line): uses are counted from the step manifests a trainer writes under
    its ``steps_root``, and a server writes none."""
    if replay is None:
        return {}
    if not isinstance(replay, Replay):
        raise ValueError(f"replay is a tracedb.Replay(...), not {type(replay).__name__} {replay!r}")
    if replay.max_uses is not None or replay.steps_root is not None:
        raise ValueError(
            "replay over a server takes no max_uses or steps_root: uses are counted from step manifests, "
            "which a server does not write (pack steps with db.micro_batches or tracedb pack for a use limit)"
        )
    return {
        "replay": True,
        "replay_max_staleness": replay.max_staleness,
        "replay_priority": replay.priority,
        "replay_seed": replay.seed,
    }


def _request(
    base: str,
    path: str,
    params: list[tuple[str, str]] | None = None,
    *,
    body: Any = None,
    accept: str = "application/json",
    token: str | None = None,
    timeout: float = TIMEOUT_S,
) -> tuple[bytes, Mapping[str, str]]:
    """The answer's body and headers; :class:`ServerError` for an HTTP error."""
    url = base.rstrip("/") + path + ("?" + urllib.parse.urlencode(params) if params else "")
    headers = {"Accept": accept}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, data=data, headers=headers, method="POST" if data else "GET")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.read(), response.headers
    except urllib.error.HTTPError as e:
        text = e.read().decode("utf-8", "replace")
        try:
            answer = json.loads(text)
            error, detail = str(answer.get("error", "http_error")), str(answer.get("detail", text))
        except (ValueError, AttributeError):
            error, detail = "http_error", text[:500] or e.reason
        raise ServerError(base, e.code, error, detail) from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise ServerUnreachable(f"cannot reach the tracedb server at {base}: {reason}") from None


def _json(base: str, path: str, params: list[tuple[str, str]] | None = None, **kw: Any) -> Any:
    return json.loads(_request(base, path, params, **kw)[0])


def _arrow(data: bytes) -> pa.Table:
    with ipc.open_stream(io.BytesIO(data)) as reader:
        return reader.read_all()


def poll_traces(
    url: str,
    after: int = 0,
    wait: float = 0.0,
    *,
    trace_ids: str | Sequence[str] | None = None,
    group: str | Sequence[str] | None = None,
    episode: str | Sequence[str] | None = None,
    complete_groups: int | None = None,
    tags: Mapping[str, Any] | None = None,
    through: int | None = None,
    policy: int | None = None,
    max_staleness: int | None = None,
    stale: str | None = None,
    unknown: str | None = None,
    include_dropped: bool | None = None,
    include_eval: bool | None = None,
    max_groups: int | None = None,
    limit: int | None = None,
) -> dict[str, Any]:
    """The traces committed after the watermark ``after``, in arrival order (the other
    filters are :meth:`tracedb.Database.traces`'); waits up to ``wait`` seconds (at most 60)
    for one when there is none yet. Returns the server's answer: ``traces`` (rows with
    ``seq``, ids, reward, counts, ``tags``), ``watermark`` (pass it as ``after`` next time)
    and ``more`` (``limit`` cut it short: call again)."""
    selection = Selection.of(locals())
    params = _params(**_selected(selection), wait=wait, limit=limit)
    return _json(url, "/traces", params, timeout=TIMEOUT_S + wait)


def fetch_branches(
    url: str,
    *,
    trace_ids: str | Sequence[str] | None = None,
    group: str | Sequence[str] | None = None,
    episode: str | Sequence[str] | None = None,
    after: int | None = None,
    complete_groups: int | None = None,
    tags: Mapping[str, Any] | None = None,
    through: int | None = None,
    policy: int | None = None,
    max_staleness: int | None = None,
    stale: str | None = None,
    unknown: str | None = None,
    include_dropped: bool | None = None,
    include_eval: bool | None = None,
    max_groups: int | None = None,
    trainable: bool | None = None,
    branch_index: int | Sequence[int] | None = None,
    columns: Sequence[str] | None = None,
    train_once: bool = False,
    credit: str | None = None,
) -> tuple[pa.Table, dict[str, Any]]:
    """The branch views of a selection (the arguments of :meth:`tracedb.Database.branches`)
    as the Arrow table ``db.branches`` gives, carrying its watermark, and what the server
    said of it: ``watermark``, ``tokens``, ``token_limit``, ``n_branches``,
    ``branch_limit``, ``truncated`` and ``truncated_by`` (which of the server's limits was
    reached, ``"tokens"`` or ``"branches"``: pass ``after=watermark`` for the rest)."""
    selection = Selection.of(locals())
    params = _params(
        **_selected(selection),
        trainable=trainable,
        branch_index=branch_index,
        fields=columns,
        train_once=train_once,
        credit=credit,
    )
    data, headers = _request(url, "/branches", params, accept=ARROW_STREAM)
    info = {
        "watermark": int(headers["X-Tracedb-Watermark"]),
        "tokens": int(headers["X-Tracedb-Tokens"]),
        "token_limit": int(headers["X-Tracedb-Token-Limit"]),
        "n_branches": int(headers["X-Tracedb-Branches"]),
        "branch_limit": int(headers["X-Tracedb-Branch-Limit"]),
        "truncated": headers["X-Tracedb-Truncated"] != "no",
        "truncated_by": None if headers["X-Tracedb-Truncated"] == "no" else headers["X-Tracedb-Truncated"],
    }
    return _arrow(data), info


def fetch_micro_batches(
    url: str,
    seq_len: int,
    *,
    rank: int,
    ranks: int = 1,
    part: str = "tokens",
    trace_ids: str | Sequence[str] | None = None,
    group: str | Sequence[str] | None = None,
    episode: str | Sequence[str] | None = None,
    after: int | None = None,
    complete_groups: int | None = None,
    tags: Mapping[str, Any] | None = None,
    through: int | None = None,
    policy: int | None = None,
    max_staleness: int | None = None,
    stale: str | None = None,
    unknown: str | None = None,
    include_dropped: bool | None = None,
    include_eval: bool | None = None,
    max_groups: int | None = None,
    **options: Any,
) -> tuple[pa.Table, dict[str, Any]]:
    """One file of one rank's micro-batches, as ``tracedb pack`` writes it: ``part="tokens"``
    (one record batch per micro-batch: ``table.to_batches()``) or ``"samples"`` (with a
    ``micro_batch`` column); and the plan's report (``report["watermark"]``: the next
    ``after``). The selection is :meth:`tracedb.Database.micro_batches`'; ``options`` its
    packing arguments (``credit``, ``overflow``, ``cost``, ``share_prefixes``, ``importance``, ``clip`` ...;
    ``trainable=None`` for every branch; ``replay=tracedb.Replay(...)`` without a use
    limit, as the server takes it: ``report["replayed"]`` says what replaced what). Pass
    ``through`` to read several parts or ranks of one step."""
    selection = Selection.of(locals())
    extra = dict(options)
    if "cost" in extra:
        extra["cost_linear"], extra["cost_quadratic"] = extra.pop("cost")
    if "trainable" in extra:
        trainable = extra.pop("trainable")
        if trainable is not None and trainable is not True:
            raise ValueError("the server packs trainable branches (trainable=True) or every branch (None)")
        extra["all_branches"] = trainable is None
    extra.update(_replay_params(extra.pop("replay", None)))
    params = _params(seq_len=seq_len, rank=rank, ranks=ranks, part=part, **_selected(selection), **extra)
    data, headers = _request(url, "/micro-batches", params, accept=ARROW_STREAM)
    return _arrow(data), json.loads(headers["X-Tracedb-Report"])


def micro_batches(
    url: str,
    seq_len: int,
    *,
    rank: int,
    ranks: int = 1,
    trace_ids: str | Sequence[str] | None = None,
    group: str | Sequence[str] | None = None,
    episode: str | Sequence[str] | None = None,
    after: int | None = None,
    complete_groups: int | None = None,
    tags: Mapping[str, Any] | None = None,
    through: int | None = None,
    policy: int | None = None,
    max_staleness: int | None = None,
    stale: str | None = None,
    unknown: str | None = None,
    include_dropped: bool | None = None,
    include_eval: bool | None = None,
    max_groups: int | None = None,
    **options: Any,
) -> tuple[list[MicroBatch], dict[str, Any]]:
    """One rank's micro-batches, the objects ``db.micro_batches(...)[rank]`` gives, and the
    plan's report: both files of the rank, the second read as of the first's watermark."""
    selection = Selection.of(locals())
    chosen = selection.kwargs()
    tokens, report = fetch_micro_batches(url, seq_len, rank=rank, ranks=ranks, part="tokens", **chosen, **options)
    chosen["through"] = report["watermark"]
    samples, _ = fetch_micro_batches(url, seq_len, rank=rank, ranks=ranks, part="samples", **chosen, **options)
    index = samples.column("micro_batch")
    out = []
    for i, batch in enumerate(tokens.to_batches()):
        rows = samples.filter(pc.equal(index, i)).drop_columns(["micro_batch"])
        out.append(MicroBatch(batch, rows.cast(SAMPLES_SCHEMA)))
    return out, report


def sql(url: str, query: str, *, limit: int | None = None, token: str | None = None) -> dict[str, Any]:
    """One read-only SELECT on a server started with ``--allow-sql``: ``columns``, ``rows``
    (lists), and ``truncated`` / ``truncated_why`` when the server's row limit or byte
    budget stopped it (``limit`` asks for fewer rows than the server's limit)."""
    body: dict[str, Any] = {"sql": query}
    if limit is not None:
        body["limit"] = limit
    return _json(url, "/sql", body=body, token=token)


def stats(url: str) -> dict[str, Any]:
    """The served database's counts and sizes (``db.stats()``)."""
    return _json(url, "/stats")


def health(url: str) -> dict[str, Any]:
    """The server's ``/health``: versions, watermark, what it allows, its follower."""
    return _json(url, "/health")
