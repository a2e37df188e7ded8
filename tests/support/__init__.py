"""Helpers the tests share, imported as ``support`` (``pythonpath`` in pyproject.toml)."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
"""The repository's root."""
FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "verifiers-0.4.0"
"""Real traces.jsonl files written by verifiers 0.4.0, each beside its NAME.branches.json:
verifiers' own branch views of that file (the ground truth)."""
