"""Ray in this process: the one place the lake's distributed calls get Ray from.

Ray is imported only when a distributed call runs (``lake.branches``, ``lake.ingest``,
``lake.credit``), never when the lake is opened, so a lake is usable without Ray.
"""

from __future__ import annotations

from typing import Any


def running_ray() -> Any:
    """Ray, once it runs in this process (an error saying what to do otherwise)."""
    try:
        import ray
    except ImportError as e:
        raise ImportError("the lake's Ray calls need the lake extra: pip install 'tracedb[lake]'") from e
    if not ray.is_initialized():
        raise RuntimeError("Ray is not running in this process: call ray.init(...) first (tracedb lake: --ray-address)")
    return ray


def chunks(ids: list[str], size: int) -> list[list[str]]:
    return [ids[i : i + size] for i in range(0, len(ids), size)]


__all__ = ["chunks", "running_ray"]
