"""Ingest tags: typed values stored on each trace an ingest adds (``trace_tags``).

``tracedb ingest --tag step=12`` stores a constant (the text is read as JSON when it is
JSON, so ``12`` is the number 12 and ``abc`` the string "abc"); ``--tag step=$.info.step``
reads a JSON path from each record: ``$.a.b[0]`` looks in the trace's record (the trace
without its nodes) and, when the trace has no such field, in its episode's (the line
without its traces); ``$episode.a`` and ``$trace.a`` look in one of them only. A record
without the field gets no tag (a missing tag is not a null one), and so does a value
holding a non-finite number (JSON has none). Numbers are stored in
``number`` as well (so they compare as numbers), strings in ``text``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

MISSING = object()
"""What a path finds in a record without the field."""

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*\Z")
_STEP = re.compile(r"\.([A-Za-z_][A-Za-z0-9_\-]*)|\[(\d+)\]|\[\"((?:[^\"\\]|\\.)*)\"\]")
TagRow = tuple[str, str, str, float | None, str | None]
"""One row of ``trace_tags``: (trace_id, name, value as JSON, number, text)."""


@dataclass(frozen=True)
class Tag:
    """One ``--tag``: a name and either a constant or a path into each record."""

    name: str
    constant: Any = MISSING
    path: tuple[str | int, ...] | None = None
    scope: str = "both"
    """Where a path looks: ``"trace"``, ``"episode"`` or ``"both"`` (trace first)."""

    @classmethod
    def parse(cls, text: str) -> Tag:
        """``name=value`` or ``name=$.json.path``; ValueError with the reason otherwise."""
        name, sep, spec = text.partition("=")
        name = name.strip()
        if not sep or not _NAME.match(name):
            raise ValueError(f"--tag {text!r}: expected name=value or name=$.json.path (a name: letters, digits, _.-)")
        if spec.startswith("$"):
            scope, rest = "both", spec[1:]
            for word in ("trace", "episode"):
                if rest.startswith(word):
                    scope, rest = word, rest[len(word) :]
            return cls(name, path=_path(text, rest), scope=scope)
        try:
            value = json.loads(spec)
        except ValueError:
            value = spec
        try:
            json.dumps(value, allow_nan=False)
        except ValueError:
            raise ValueError(f"--tag {text!r}: a tag's numbers must be finite (JSON has no NaN or Infinity)") from None
        return cls(name, constant=value)

    def value(self, trace: dict[str, Any], episode: dict[str, Any] | None) -> Any:
        """The tag's value for one trace (:data:`MISSING` when the record has no such field)."""
        if self.path is None:
            return self.constant
        found = MISSING
        if self.scope in ("trace", "both") and self.path[0] != "nodes":  # the trace without its nodes
            found = _lookup(trace, self.path)
        if found is MISSING and self.scope in ("episode", "both") and episode is not None and self.path[0] != "traces":
            found = _lookup(episode, self.path)  # the line without its traces
        return found


def _path(text: str, rest: str) -> tuple[str | int, ...]:
    steps: list[str | int] = []
    at = 0
    while at < len(rest):
        m = _STEP.match(rest, at)
        if m is None:
            raise ValueError(f'--tag {text!r}: cannot read the JSON path at {rest[at:]!r} (use $.a.b[0] or $["a b"])')
        key, index, quoted = m.groups()
        steps.append(key if key is not None else int(index) if index is not None else json.loads(f'"{quoted}"'))
        at = m.end()
    if not steps:
        raise ValueError(f"--tag {text!r}: the JSON path names no field")
    return tuple(steps)


def _lookup(record: Any, path: Sequence[str | int]) -> Any:
    for step in path:
        if isinstance(step, int) and isinstance(record, list) and step < len(record):
            record = record[step]
        elif isinstance(step, str) and isinstance(record, dict) and step in record:
            record = record[step]
        else:
            return MISSING
    return record


def tag_rows(tags: Iterable[Tag], trace_id: str, trace: dict[str, Any], episode: dict[str, Any] | None) -> list[TagRow]:
    """The ``trace_tags`` rows of one trace."""
    rows = []
    for tag in tags:
        value = tag.value(trace, episode)
        if value is MISSING:
            continue
        try:
            encoded = json.dumps(value, separators=(",", ":"), allow_nan=False)
        except ValueError:
            continue  # a non-finite number somewhere in it: JSON has none, so no tag
        number = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
        text = value if isinstance(value, str) else None
        rows.append((trace_id, tag.name, encoded, number, text))
    return rows


def parse_tags(texts: Iterable[str | Tag]) -> list[Tag]:
    """Each ``--tag`` parsed (a :class:`Tag` is taken as it is); a name given twice is refused."""
    tags = [t if isinstance(t, Tag) else Tag.parse(t) for t in texts]
    names = [t.name for t in tags]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"--tag given twice for {', '.join(twice)}")
    return tags
