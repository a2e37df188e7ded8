"""Which parser an ingest reads with (``runtime.Settings.scanner``): ``auto`` keeps small
inputs on the parser unless this process has loaded the compiled scanner already, because
loading it (numba's import and its cache, ~0.4 s of CPU) costs more than the parser's
extra time on them; a large input loads it (compiled) or compiles it (not yet)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tracedb import jitcache, runtime
from tracedb.ingest import run
from tracedb.ingest.files import ByteRange

from support import FIXTURES

LINEAR = FIXTURES / "linear.traces.jsonl"


def _file(tmp_path: Path, size: int) -> Path:
    path = tmp_path / f"{size}.jsonl"
    path.write_bytes(b"x" * size)
    return path


@pytest.mark.parametrize(
    ("loaded", "compiled", "size", "expected"),
    [
        (True, True, 10, True),  # loaded in this process: free to use, whatever the size
        (True, False, 10, True),
        (False, True, 999, False),  # compiled, not loaded: a small input stays on the parser
        (False, True, 1000, True),  # ... from scanner_load_bytes it loads it
        (False, False, 1000, False),  # not compiled: only from scanner_min_bytes
        (False, False, 5000, True),
    ],
)
def test_auto_loads_the_scanner_when_it_pays(tmp_path, monkeypatch, loaded, compiled, size, expected):
    monkeypatch.setattr(run, "_scanner_loaded", lambda: loaded)
    monkeypatch.setattr(jitcache, "is_compiled", lambda source: compiled)
    files = [_file(tmp_path, size // 2), _file(tmp_path, size - size // 2)]  # the input is every file
    with runtime.configure(scanner="auto", scanner_load_bytes=1000, scanner_min_bytes=5000):
        assert run.uses_scanner(runtime.settings(), files) is expected


def test_byte_ranges_count_their_own_bytes(tmp_path, monkeypatch):
    monkeypatch.setattr(run, "_scanner_loaded", lambda: False)
    monkeypatch.setattr(jitcache, "is_compiled", lambda source: True)
    big = _file(tmp_path, 10_000)
    with runtime.configure(scanner="auto", scanner_load_bytes=1000):
        assert not run.uses_scanner(runtime.settings(), [ByteRange(big, 0, 999)])
        assert run.uses_scanner(runtime.settings(), [ByteRange(big, 0, 1000)])


@pytest.mark.parametrize("mode", ["always", "never"])
def test_always_and_never_decide_alone(tmp_path, monkeypatch, mode):
    monkeypatch.setattr(run, "_scanner_loaded", lambda: mode == "never")
    with runtime.configure(scanner=mode):
        assert run.uses_scanner(runtime.settings(), [_file(tmp_path, 1)]) is (mode == "always")


CHILD = """
import json, sys
from tracedb import runtime
from tracedb.ingest import run
import tracedb

out = {}
with runtime.configure(scanner="auto"), tracedb.connect(":memory:") as db:
    out["small"] = db.ingest(sys.argv[1]).traces
    out["numba_after_small"] = "numba" in sys.modules
    with runtime.configure(scanner="always"):
        db.ingest(sys.argv[2])
    out["loaded"] = run._scanner_loaded()
    out["auto_after_load"] = run.uses_scanner(runtime.settings(), [run.Path(sys.argv[1])])
print(json.dumps(out))
"""


def test_a_process_loads_the_scanner_only_when_it_uses_it(tmp_path):
    """In a fresh process a small ``auto`` ingest does not import numba; once an ingest
    has run the scanner, ``auto`` keeps using it (it costs nothing more)."""
    other = tmp_path / "other.jsonl"
    other.write_text((FIXTURES / "groups.traces.jsonl").read_text())
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(LINEAR), str(other)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out == {"small": out["small"], "numba_after_small": False, "loaded": True, "auto_after_load": True}
    assert out["small"] > 0
