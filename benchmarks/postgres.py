"""A throwaway PostgreSQL cluster for the lake's catalog tests and benchmark.

Debian's server (``apt-get install postgresql``; ``.ci/run`` installs it): ``initdb`` makes
a cluster in a fresh temporary directory, ``pg_ctl`` starts it listening on a Unix socket
in that directory only (``listen_addresses=''``: no TCP, so it serves inside a
loopback-only network namespace too), and stops it after, every wait bounded. PostgreSQL
refuses to run as root: as root, the directory is given to the ``postgres`` user and the
commands run as it (``runuser``).
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

WAIT_SECONDS = 60
"""How long pg_ctl may take to start or stop the server, and any other command to run."""
USER = "postgres"


def binaries() -> Path | None:
    """The directory of ``initdb``, ``pg_ctl`` and ``createdb``: Debian's newest
    ``/usr/lib/postgresql/*/bin``, else the one ``initdb`` is found in on PATH."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).resolve().parent if initdb else None


def problem() -> str | None:
    """Why no cluster can be made here (None: one can)."""
    where = binaries()
    if where is None or not all((where / tool).exists() for tool in ("initdb", "pg_ctl", "createdb")):
        return "no PostgreSQL server here (apt-get install postgresql)"
    if os.geteuid() == 0:
        if shutil.which("runuser") is None:
            return "running as root without runuser (util-linux) to start PostgreSQL as its own user"
        try:
            pwd.getpwnam(USER)
        except KeyError:
            return f"running as root and no {USER!r} user to run PostgreSQL as"
    try:
        import psycopg2  # noqa: F401
    except ImportError:
        return "psycopg2 is not installed (pip install '.[lake]')"
    return None


@dataclass
class Server:
    """A running cluster: reached through the Unix socket in ``directory``."""

    directory: Path
    bin: Path

    def run(self, *command: str) -> subprocess.CompletedProcess:
        """One of the server's programs, as the server's user, bounded."""
        prefix = ["runuser", "-u", USER, "--"] if os.geteuid() == 0 else []
        done = subprocess.run(
            [*prefix, str(self.bin / command[0]), *command[1:]],
            capture_output=True,
            text=True,
            timeout=WAIT_SECONDS,
            cwd=self.directory,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{command[0]} failed ({done.returncode}): {done.stderr.strip() or done.stdout.strip()}")
        return done

    def database(self, name: str | None = None) -> str:
        """A new, empty database; its SQLAlchemy URI (psycopg2, over the socket)."""
        name = name or f"lake_{uuid.uuid4().hex[:12]}"
        self.run("createdb", "-h", str(self.directory), "-U", USER, name)
        return f"postgresql+psycopg2://{USER}@/{name}?host={self.directory}"

    def lake_properties(self, path: Path, warehouse: Path) -> Path:
        """A ``.yaml`` of catalog properties at ``path`` for a lake in a new database of
        this server, its files in the local directory ``warehouse``."""
        path.write_text(f"type: sql\nuri: {self.database()}\nwarehouse: {warehouse}\n")
        return path


@contextlib.contextmanager
def cluster() -> Iterator[Server]:
    """A cluster made, started, yielded and stopped (its directory removed)."""
    where = binaries()
    assert where is not None, problem()
    # Not under pytest's tmp_path: the server's user must reach the directory, and pytest's
    # is private to this one; and short, for the socket's path.
    directory = Path(tempfile.mkdtemp(prefix="tracedb-pg-"))
    if os.geteuid() == 0:
        user = pwd.getpwnam(USER)
        os.chown(directory, user.pw_uid, user.pw_gid)
    server = Server(directory, where)
    data = directory / "data"
    started = False
    try:
        server.run("initdb", "-D", str(data), "-U", USER, "-A", "trust", "-E", "UTF8", "--locale=C", "--no-sync")
        options = f"-c listen_addresses='' -k {directory} -c fsync=off -c max_connections=300"
        log = directory / "server.log"
        server.run("pg_ctl", "-D", str(data), "-l", str(log), "-o", options, "-w", "-t", str(WAIT_SECONDS), "start")
        started = True
        yield server
    finally:
        try:
            if started:
                stop = ["pg_ctl", "-D", str(data), "-w", "-t", str(WAIT_SECONDS)]
                try:
                    server.run(*stop, "-m", "fast", "stop")
                except (RuntimeError, subprocess.TimeoutExpired):
                    server.run(*stop, "-m", "immediate", "stop")
        finally:
            shutil.rmtree(directory, ignore_errors=True)


__all__ = ["Server", "binaries", "cluster", "problem"]
