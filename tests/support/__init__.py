"""Helpers the tests share, imported as ``support`` (``pythonpath`` in pyproject.toml)."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
"""The repository's root."""
FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "verifiers-0.4.0"
"""Real traces.jsonl files written by verifiers 0.4.0, each beside its NAME.branches.json:
verifiers' own branch views of that file (the ground truth)."""
FIXTURES_041 = FIXTURES.parent / "verifiers-0.4.1"
"""The same for verifiers 0.4.1.dev86 (weight versions, dropped traces, run work); see its
README.md. Its ``weight_versions.invalid.jsonl`` is not a fixture to ingest whole: pick the
``*.traces.jsonl`` files."""
