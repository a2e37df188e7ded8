"""A local tokenizer for the viewer's decoded-token tests (never a hub download)."""

from __future__ import annotations

from pathlib import Path


def make_tokenizer(path: Path, ids: list[int]) -> Path:
    """A tiny local WordLevel tokenizer.json whose word for id i is `w<i>`."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{f"w{i}": i for i in sorted(set(ids)) if i}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path))
    return path
