"""The realistic workload's text: pinned Python sources of installed packages, and a
byte-level BPE tokenizer trained on them.

The corpus is every ``.py`` file of the packages in :data:`PACKAGES` (tracedb's own
dependencies, plus verifiers, which the benchmarks need) as ``corpus-pins.json`` lists
them: each file by package, path and the SHA-256 of its content, with the package version
the pins were taken from. :func:`load` reads the pinned files from where the packages are
installed and says exactly which ones differ (a missing file, other content, another
package version): the workload is then built from what is there, under another hash, so
two machines build the same workload or say why not. ``python -m benchmarks.corpus --pin``
rewrites the pins from the installed packages.

The tokenizer (``tokenizers``' BPE over bytes, GPT-2's pre-tokenizer, the chat
template's special tokens) is trained once per corpus hash and vocabulary size and cached
as JSON beside the encoded corpus (token ids per file), which the n-gram model is fitted
on. Training is deterministic (the same corpus gives the same tokenizer file); the
tokenizer's SHA-256 is part of every manifest.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import sys
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import numpy as np

PINS = Path(__file__).resolve().parent / "corpus-pins.json"
PACKAGES = ("verifiers", "pydantic", "rich", "duckdb", "pyarrow", "polars", "fastapi", "typer", "jinja2", "uvicorn")
VOCAB = 48_000
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


@dataclass(frozen=True)
class SourceFile:
    package: str
    path: str  # relative to the package's directory, "/"-separated
    text: str
    sha256: str


@dataclass
class Corpus:
    """The pinned files found installed, and how they differ from the pins."""

    files: list[SourceFile]
    versions: dict[str, str | None]
    pinned_hash: str
    differences: list[str] = field(default_factory=list)

    @property
    def hash(self) -> str:
        """SHA-256 over every used file's package, path and content hash."""
        return combined_hash((f.package, f.path, f.sha256) for f in self.files)

    @property
    def matches_pins(self) -> bool:
        return not self.differences and self.hash == self.pinned_hash

    def by_package(self) -> dict[str, list[SourceFile]]:
        out: dict[str, list[SourceFile]] = {}
        for f in self.files:
            out.setdefault(f.package, []).append(f)
        return out

    def describe(self) -> dict[str, Any]:
        """What a results file records of the corpus."""
        return {
            "hash": self.hash,
            "pinned_hash": self.pinned_hash,
            "matches_pins": self.matches_pins,
            "differences": self.differences,
            "packages": self.versions,
            "files": len(self.files),
            "bytes": sum(len(f.text.encode()) for f in self.files),
        }


def combined_hash(entries: Any) -> str:
    h = hashlib.sha256()
    for package, path, digest in sorted(entries):
        h.update(f"{package}/{path}\0{digest}\n".encode())
    return h.hexdigest()


def package_dir(package: str) -> Path | None:
    """Where ``package`` is installed (its directory), without importing it."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _version(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def installed_files(package: str) -> list[Path]:
    root = package_dir(package)
    if root is None:
        return []
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def pin(packages: tuple[str, ...] = PACKAGES, path: Path = PINS) -> dict[str, Any]:
    """Write the pins of the installed ``packages`` to ``path``; returns them."""
    pins: dict[str, Any] = {"packages": {}}
    for package in packages:
        root = package_dir(package)
        if root is None:
            raise SystemExit(f"corpus: package {package} is not installed: nothing to pin")
        files = {
            p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in installed_files(package)
        }
        pins["packages"][package] = {"version": _version(package), "files": files}
    pins["hash"] = combined_hash(
        (pkg, rel, digest) for pkg, entry in pins["packages"].items() for rel, digest in entry["files"].items()
    )
    path.write_text(json.dumps(pins, indent=1, sort_keys=True) + "\n")
    return pins


def load(path: Path = PINS, packages: tuple[str, ...] | None = None) -> Corpus:
    """The pinned files as installed here, with every difference from the pins worded;
    ``packages``: only those of the pinned packages (their own pinned hash)."""
    pins = json.loads(path.read_text())
    if packages is not None:
        unknown = sorted(set(packages) - set(pins["packages"]))
        if unknown:
            raise ValueError(f"packages {unknown} are not pinned in {path}")
        pins["packages"] = {k: v for k, v in pins["packages"].items() if k in packages}
        pins["hash"] = combined_hash(
            (pkg, rel, digest) for pkg, entry in pins["packages"].items() for rel, digest in entry["files"].items()
        )
    files: list[SourceFile] = []
    versions: dict[str, str | None] = {}
    differences: list[str] = []
    for package, entry in sorted(pins["packages"].items()):
        installed = _version(package)
        versions[package] = installed
        root = package_dir(package)
        if root is None:
            differences.append(
                f"{package}: not installed (pinned {entry['version']}): its {len(entry['files'])} files are missing"
            )
            continue
        if installed != entry["version"]:
            differences.append(f"{package}: version {installed} installed, the pins are of {entry['version']}")
        missing = changed = 0
        for rel, digest in sorted(entry["files"].items()):
            file = root / rel
            try:
                data = file.read_bytes()
            except OSError as e:
                differences.append(f"{package}/{rel}: pinned, not readable here ({e.strerror or e})")
                missing += 1
                continue
            got = hashlib.sha256(data).hexdigest()
            if got != digest:
                differences.append(f"{package}/{rel}: content differs (sha256 {got[:16]}..., pinned {digest[:16]}...)")
                changed += 1
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                differences.append(f"{package}/{rel}: not UTF-8 text here: left out")
                continue
            files.append(SourceFile(package, rel, text, got))
        if missing or changed:
            differences.append(f"{package}: {missing} pinned files missing, {changed} with other content")
    return Corpus(files=files, versions=versions, pinned_hash=pins["hash"], differences=differences)


# --------------------------------------------------------------------------- tokenizer


@dataclass
class Encoded:
    """The trained tokenizer and the corpus encoded with it (one id array per file)."""

    tokenizer: Any  # tokenizers.Tokenizer
    path: Path
    sha256: str
    ids: list[np.ndarray]

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size())

    def special(self, token: str) -> int:
        got = self.tokenizer.token_to_id(token)
        if got is None:
            raise KeyError(f"the tokenizer at {self.path} has no special token {token}")
        return int(got)

    def describe(self) -> dict[str, Any]:
        return {
            "vocab_size": self.vocab_size,
            "sha256": self.sha256,
            "corpus_tokens": int(sum(len(a) for a in self.ids)),
            "library": f"tokenizers {_version('tokenizers')}",
        }


def _train(corpus: Corpus, vocab: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([f.text for f in corpus.files], trainer)
    return tok


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def encoded(corpus: Corpus, cache: Path, vocab: int = VOCAB, *, log: Any = print) -> Encoded:
    """The tokenizer of ``corpus`` (trained unless cached under ``cache``) and the corpus's ids."""
    from tokenizers import Tokenizer

    cache.mkdir(parents=True, exist_ok=True)
    stem = f"bpe-{corpus.hash[:16]}-{vocab}-tokenizers{_version('tokenizers')}"
    tok_path = cache / f"{stem}.json"
    if tok_path.exists():
        tok = Tokenizer.from_file(str(tok_path))
    else:
        log(f"corpus: training a {vocab}-token byte-level BPE on {len(corpus.files)} files")
        tok = _train(corpus, vocab)
        _write_atomic(tok_path, tok.to_str().encode())
    sha = hashlib.sha256(tok_path.read_bytes()).hexdigest()
    ids = encode_cached(tok, sha, [f.text for f in corpus.files], cache / f"{stem}.corpus.npz", log=log)
    return Encoded(tokenizer=tok, path=tok_path, sha256=sha, ids=ids)


def encode_cached(tokenizer: Any, sha: str, texts: list[str], path: Path, *, log: Any = print) -> list[np.ndarray]:
    """``texts`` encoded (an id array each), cached at ``path`` for this tokenizer and texts."""
    digest = hashlib.sha256(sha.encode())
    for t in texts:
        digest.update(hashlib.sha256(t.encode()).digest())
    key = digest.hexdigest()
    if path.exists():
        with np.load(path) as z:
            if "key" in z.files and str(z["key"]) == key:
                return np.split(z["ids"], np.cumsum(z["lengths"])[:-1]) if len(texts) else []
    log(f"corpus: encoding {len(texts)} texts ({sum(len(t) for t in texts) / 1e6:.1f} MB)")
    ids = [np.asarray(e.ids, np.int32) for e in tokenizer.encode_batch(texts)]
    lengths = np.array([len(a) for a in ids], np.int64)
    tmp = path.with_name(f".{path.stem}.partial-{os.getpid()}.npz")
    flat = np.concatenate(ids) if ids else np.zeros(0, np.int32)
    np.savez(tmp, ids=flat, lengths=lengths, key=np.array(key))
    os.replace(tmp, path)
    return ids


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.corpus", description=__doc__.split("\n\n")[0])
    p.add_argument("--pin", action="store_true", help=f"rewrite {PINS.name} from the installed packages")
    args = p.parse_args(argv)
    if args.pin:
        pins = pin()
        print(f"pinned {sum(len(e['files']) for e in pins['packages'].values())} files, hash {pins['hash']}")
        return 0
    corpus = load()
    print(json.dumps(corpus.describe(), indent=2))
    return 0 if corpus.matches_pins else 1


if __name__ == "__main__":
    sys.exit(main())
