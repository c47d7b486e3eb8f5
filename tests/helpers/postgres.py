"""A throwaway PostgreSQL server for the cluster tier's tracking-store tests.

Debian's postgresql (installed by ``tests/cluster/install_postgres.sh`` when its binaries are
missing); a fresh cluster in a temporary directory on a free port, run as the ``postgres`` user
when this process is root (PostgreSQL refuses to run as root), small and without fsync (it holds
test data only), stopped and removed at the end. Each test gets its own empty database::

    with postgres_server() as server, server.database() as url:
        TrackingStore.open(url)
"""

from __future__ import annotations

import contextlib
import itertools
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import sqlalchemy as sa

from tests.helpers.ports import free_port

INSTALLER = Path(__file__).parents[1] / "cluster" / "install_postgres.sh"
# A zone with a 45-minute offset that changes with daylight saving: a timestamp that lost or
# misread its zone anywhere on the way shows up as a different instant.
SERVER_TIMEZONE = "Pacific/Chatham"
SETTINGS = {
    "listen_addresses": "127.0.0.1",
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "shared_buffers": "16MB",
    "max_connections": "60",
    "timezone": SERVER_TIMEZONE,
}


def server_binaries() -> Path:
    """The directory holding initdb and pg_ctl, installing Debian's postgresql first if needed."""
    subprocess.run(["bash", str(INSTALLER)], check=True, timeout=900)
    installed = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parts[-3]))
    if installed:
        return installed[-1].parent
    on_path = shutil.which("initdb")
    if on_path is None:
        raise RuntimeError(f"{INSTALLER.name} ran but no initdb was found")
    return Path(on_path).parent


@dataclass
class PostgresServer:
    """A running server; ``url()`` reaches its ``postgres`` database as the superuser."""

    port: int
    _names: Iterator[int] = field(default_factory=itertools.count)

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    @contextlib.contextmanager
    def database(self) -> Iterator[str]:
        """A new empty database for one test, dropped afterwards (with any connection still open)."""
        name = f"govray_test_{next(self._names)}"
        admin = sa.create_engine(self.url(), isolation_level="AUTOCOMMIT")
        try:
            with admin.connect() as connection:
                connection.exec_driver_sql(f"CREATE DATABASE {name}")
            try:
                yield self.url(name)
            finally:
                with admin.connect() as connection:
                    connection.exec_driver_sql(f"DROP DATABASE {name} WITH (FORCE)")
        finally:
            admin.dispose()


@contextlib.contextmanager
def postgres_server() -> Iterator[PostgresServer]:
    """Start a fresh PostgreSQL cluster; stop it and delete its files when the block ends."""
    binaries = server_binaries()
    root = Path(tempfile.mkdtemp(prefix="govray-postgres-"))
    as_postgres: list[str] = []
    if os.geteuid() == 0:
        owner = pwd.getpwnam("postgres")
        os.chown(root, owner.pw_uid, owner.pw_gid)
        as_postgres = ["runuser", "-u", "postgres", "--"]
    data, log = root / "data", root / "server.log"
    port = free_port()
    options = " ".join(f"-c {key}={value}" for key, value in {**SETTINGS, "port": port}.items())
    try:
        initdb = [str(binaries / "initdb"), "-D", str(data), "-U", "postgres", "-A", "trust", "-E", "UTF8"]
        subprocess.run(
            [*as_postgres, *initdb, "--no-sync"],
            check=True,
            capture_output=True,
            timeout=120,
        )
        pg_ctl = [*as_postgres, str(binaries / "pg_ctl"), "-D", str(data), "-w", "-t", "60"]
        started = subprocess.run(
            [*pg_ctl, "-l", str(log), "-o", f"{options} -c unix_socket_directories={root}", "start"],
            capture_output=True,
            text=True,
            timeout=90,
        )
        if started.returncode != 0:
            raise RuntimeError(f"PostgreSQL did not start: {started.stderr}\n{_tail(log)}")
        try:
            yield PostgresServer(port)
        finally:
            subprocess.run([*pg_ctl, "-m", "fast", "stop"], capture_output=True, timeout=90)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _tail(log: Path) -> str:
    try:
        return "\n".join(log.read_text().splitlines()[-20:])
    except OSError:
        return ""
