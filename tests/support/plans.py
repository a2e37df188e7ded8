"""Comparing what two stores packed: plans and step directories that must be equal but
for the watermark (a lake's and a file's count their commits apart)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def assert_same_plan(got: Any, want: Any) -> None:
    """Two plans equal in arguments, report (but its watermark) and every micro-batch."""
    assert got.arguments == want.arguments
    assert {**got.report.to_dict(), "watermark": None} == {**want.report.to_dict(), "watermark": None}
    assert len(got) == len(want)
    for rank_got, rank_want in zip(got, want, strict=True):
        assert len(rank_got) == len(rank_want)
        for mb_got, mb_want in zip(rank_got, rank_want, strict=True):
            assert mb_got.tokens.equals(mb_want.tokens)
            assert mb_got.samples.equals(mb_want.samples)


def assert_same_step(got: Path, want: Path, watermark: int) -> dict[str, Any]:
    """Two step directories with byte-equal rank files and equal manifests but for the
    report's watermark, ``got``'s being ``watermark``, and the selection record's
    ``read_at`` / ``watermark`` (each store's numbering); returns ``got``'s manifest."""
    names = sorted(p.name for p in want.iterdir())
    assert names == sorted(p.name for p in got.iterdir()) and "manifest.json" in names
    for name in names:
        if name != "manifest.json":
            assert (got / name).read_bytes() == (want / name).read_bytes(), name
    expected = json.loads((want / "manifest.json").read_text())
    found = json.loads((got / "manifest.json").read_text())
    assert found["report"].pop("watermark") == watermark
    expected["report"].pop("watermark")
    for manifest in (found, expected):  # the numbering of the store's (the lake's seqs are its own)
        for key in ("read_at", "watermark"):
            manifest.get("selection", {}).pop(key, None)
    assert found == expected
    return found
