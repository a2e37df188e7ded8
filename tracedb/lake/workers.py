"""Ray in this process: the one place the lake's distributed calls get Ray from.

Ray is imported only when a distributed call runs (``lake.branches``, ``lake.ingest``,
``lake.credit``), never when the lake is opened, so a lake is usable without Ray. When
no Ray runs in the process, the first such call connects to the cluster ``RAY_ADDRESS``
names, or else starts a local Ray (as Ray Data does), which stays up until the process
ends. A local Ray started here is quiet and loopback-only (see :func:`start`).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import socket
import sys
import tempfile
import threading
import warnings
from collections.abc import Iterator
from typing import Any

from tracedb.lake.catalog import LakeError

LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""Ray's switch between a single-machine Ray (``0``: the node's address is 127.0.0.1, so
every Ray server listens on loopback only) and a cluster node (the default on Linux: the
node's routable address, servers on every interface)."""
CONNECT_SECONDS = 4.0
"""How long reaching a cluster's address may take (a TCP connection to it, then Ray's own
client asking it for its cluster id) before it counts as unreachable."""


def running_ray() -> Any:
    """Ray, running in this process: the one running already, else the cluster
    ``RAY_ADDRESS`` names, else a local one started here (see :func:`start`)."""
    ray = _import_ray()
    if not ray.is_initialized():
        start(os.environ.get("RAY_ADDRESS") or None)
    return ray


def start(address: str | None = None, *, num_cpus: int | None = None) -> bool:
    """Make Ray run in this process unless it does already; True when this call started
    or connected it (the caller may ``ray.shutdown()`` it after).

    With ``address`` (``host:port`` of a cluster's head, ``auto``, ``ray://...``) it
    connects there, failing within twice :data:`CONNECT_SECONDS` with a :class:`LakeError`
    naming the address when no Ray answers there (Ray itself would retry for minutes);
    ``num_cpus`` is then the cluster's affair.
    Without, it starts a local Ray of ``num_cpus`` CPUs (default: the machine's): no
    dashboard, workers' output not forwarded, Ray's log records below errors not shown,
    usage stats off unless ``RAY_USAGE_STATS_ENABLED`` says otherwise, and every server
    bound to 127.0.0.1 (Ray's single-machine mode: :data:`LOOPBACK_ENV`)."""
    ray = _import_ray()
    if ray.is_initialized():
        return False
    if address and address != "local":
        host = _reachable(address)
        with _loopback(_is_loopback(host)), _quiet_start():
            try:
                ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR)
            except (ConnectionError, RuntimeError, ValueError) as e:
                raise LakeError(f"Ray cluster {address}: cannot connect: {_first_line(e)}") from None
        return True
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    with _loopback(True), _quiet_start():
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
    return True


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise ImportError("the lake's Ray calls need the lake extra: pip install 'tracedb[lake]'") from e
    return ray


@contextlib.contextmanager
def _loopback(on: bool) -> Iterator[None]:
    """Ray's single-machine mode while Ray starts, the user's setting restored after.
    Ray reads the switch from the environment once, when imported, into a constant that
    the driver consults for its own address while it starts: both are set (and the
    processes Ray starts inherit the environment)."""
    if not on or os.environ.get(LOOPBACK_ENV) is not None:
        yield  # the user's own setting of the switch stands
        return
    os.environ[LOOPBACK_ENV] = "0"
    constants = sys.modules.get("ray._private.ray_constants")
    held = getattr(constants, "ENABLE_RAY_CLUSTER", None)
    if held is not None:
        constants.ENABLE_RAY_CLUSTER = False  # type: ignore[union-attr]
    try:
        yield
    finally:
        del os.environ[LOOPBACK_ENV]
        if held is not None:
            constants.ENABLE_RAY_CLUSTER = held  # type: ignore[union-attr]


@contextlib.contextmanager
def _quiet_start() -> Iterator[None]:
    """Python warnings Ray raises while it starts (deprecations of its own) not shown."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _reachable(address: str) -> str:
    """The host of ``address`` once a TCP connection to its port succeeds and (but for a
    ``ray://`` client address) Ray's own client gets the cluster's id from it; ``auto``:
    the address of the Ray this machine runs, as Ray finds it (none found: Ray's error)."""
    target = address.removeprefix("ray://")
    if target == "auto":
        target = _auto_address()
        if not target:
            return ""
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise LakeError(f"Ray cluster {address}: not an address (host:port, ray://host:port or auto)")
    host = host.strip("[]")
    try:
        with socket.create_connection((host, int(port)), timeout=CONNECT_SECONDS):
            pass
    except TimeoutError:
        raise LakeError(f"Ray cluster {address}: unreachable (no answer within {CONNECT_SECONDS:.0f} s)") from None
    except OSError as e:
        raise LakeError(f"Ray cluster {address}: unreachable ({e.strerror or e})") from None
    if not address.startswith("ray://"):
        _answers_as_ray(address, target)
    return host


def _answers_as_ray(address: str, target: str) -> None:
    """Ray's client asks ``target`` for the cluster's id once, within :data:`CONNECT_SECONDS`
    (what answers a TCP connection may be no Ray at all: a proxy, another service)."""
    from ray._raylet import GcsClient

    answer: dict[str, Any] = {}

    def ask() -> None:
        try:
            answer["id"] = GcsClient(address=target).cluster_id
        except Exception as e:  # its message says what answered
            answer["error"] = e

    asking = threading.Thread(target=ask, daemon=True, name="tracedb-ray-probe")
    with _stderr_aside():  # Ray's client logs its failed attempts on stderr
        asking.start()
        asking.join(CONNECT_SECONDS)
    if asking.is_alive():
        raise LakeError(f"Ray cluster {address}: unreachable (no Ray answer within {CONNECT_SECONDS:.0f} s)")
    if "error" in answer:
        raise LakeError(f"Ray cluster {address}: unreachable (no Ray there: {_first_line(answer['error'])})")


@contextlib.contextmanager
def _stderr_aside() -> Iterator[None]:
    """File descriptor 2 (where Ray's C++ code logs) into a temporary file for the block."""
    sys.stderr.flush()
    held = os.dup(2)
    try:
        with tempfile.TemporaryFile() as aside:
            os.dup2(aside.fileno(), 2)
            try:
                yield
            finally:
                os.dup2(held, 2)
    finally:
        os.close(held)


def _auto_address() -> str:
    """The address of the Ray running on this machine that ``address='auto'`` finds
    (``RAY_ADDRESS``, else the one Ray last started here), as written; empty when none."""
    try:
        from ray._private.services import get_ray_address_from_environment

        return get_ray_address_from_environment("auto", None) or ""
    except Exception:
        return ""


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]


@contextlib.contextmanager
def quiet_data() -> Iterator[None]:
    """A Ray Data run of the lake's own (not the user's dataset) without progress bars
    or execution logs on the terminal (Ray Data's log file keeps them)."""
    import ray.data

    context = ray.data.DataContext.get_current()
    held = (context.enable_progress_bars, context.print_on_execution_start)
    consoles = [h for h in logging.getLogger("ray.data").handlers if h.get_name() == "console"]
    levels = [h.level for h in consoles]
    context.enable_progress_bars = False
    context.print_on_execution_start = False
    for h in consoles:
        h.setLevel(logging.ERROR)
    try:
        yield
    finally:
        context.enable_progress_bars, context.print_on_execution_start = held
        for h, level in zip(consoles, levels, strict=True):
            h.setLevel(level)


def chunks(ids: list[str], size: int) -> list[list[str]]:
    return [ids[i : i + size] for i in range(0, len(ids), size)]


__all__ = ["CONNECT_SECONDS", "LOOPBACK_ENV", "chunks", "quiet_data", "running_ray", "start"]
