"""What a process tree listens on, read from ``/proc`` (Linux): the Ray tests' check that
a local Ray binds loopback only."""

from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path

LISTEN = "0A"
"""The TCP state LISTEN in ``/proc/net/tcp``."""


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (by parent pid, read now)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo.extend(children.get(p, []))
    return found


def _address(hex_address: str, family: int) -> str:
    raw = bytes.fromhex(hex_address)
    if family == socket.AF_INET:
        return socket.inet_ntop(family, raw[::-1])
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))  # four host-order words
    return socket.inet_ntop(family, words)


def _listeners() -> dict[int, tuple[str, int]]:
    """Listening TCP sockets of this network namespace by inode: (address, port)."""
    out = {}
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            lines = Path(f"/proc/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], int(fields[9])
            if state == LISTEN:
                address, port = local.split(":")
                out[inode] = (_address(address, family), int(port, 16))
    return out


def listening(pids: list[int]) -> list[tuple[int, str, str, int]]:
    """The TCP sockets the processes ``pids`` listen on: (pid, name, address, port)."""
    sockets = _listeners()
    found = []
    for pid in pids:
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inode = int(target[8:-1])
                if inode in sockets:
                    found.append((pid, name, *sockets[inode]))
    return found


def is_loopback(address: str) -> bool:
    """Whether a listening address is loopback only (``::ffff:127.0.0.1`` included)."""
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


__all__ = ["descendants", "is_loopback", "listening"]
