"""A real PostgreSQL server for the tests, started from Debian's binaries (`initdb`,
`pg_ctl`) in a temporary directory as an unprivileged user, on a free loopback port, with
trust authentication for one role. `scripts/dev test` installs Debian's `postgresql` where it
is missing; where it cannot be installed, `PgServer.find()` says why and the tests that need
it skip with that reason."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
import uuid

from tests.serverproc import free_port

ROLE = "specdec"


class PgServer:
    """`start()` a cluster; `database()` a new empty database's URL; `stop()` removes it all.

    Args:
        bindir: the folder holding initdb and pg_ctl.
    """

    def __init__(self, bindir: str) -> None:
        self.bindir = bindir
        self.dir = tempfile.mkdtemp(prefix="specdec-pg-")
        os.chmod(self.dir, 0o755)
        self.data = os.path.join(self.dir, "data")
        self.port = free_port()
        self.user = "nobody" if os.geteuid() == 0 else None  # initdb refuses root

    @staticmethod
    def find() -> tuple[str | None, str]:
        """(the bin folder of the newest PostgreSQL installed, ""), or (None, why not)."""
        found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"),
                       key=lambda p: int(p.split("/")[4]) if p.split("/")[4].isdigit() else 0)
        if found:
            return os.path.dirname(found[-1]), ""
        if shutil.which("pg_ctl") and shutil.which("initdb"):
            return os.path.dirname(shutil.which("pg_ctl")), ""  # type: ignore[arg-type]
        return None, ("no PostgreSQL server binaries (initdb, pg_ctl): install Debian's "
                      "postgresql (scripts/dev test does, as root)")

    def _run(self, *cmd: str) -> None:
        argv = list(cmd)
        if self.user is not None:
            argv = ["runuser", "-u", self.user, "--", *argv]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[:2])} failed: {out.stderr[-2000:]}")

    def start(self) -> PgServer:
        if self.user is not None:
            shutil.chown(self.dir, self.user)
        self._run(os.path.join(self.bindir, "initdb"), "-D", self.data, "-U", ROLE,
                  "--auth=trust", "-E", "UTF8", "--no-sync")
        self._run(os.path.join(self.bindir, "pg_ctl"), "-D", self.data, "-w", "-t", "60",
                  "-l", os.path.join(self.dir, "log"), "-o",
                  f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 "
                  "-c fsync=off -c max_connections=100", "start")
        return self

    @property
    def admin_url(self) -> str:
        return f"postgresql://{ROLE}@127.0.0.1:{self.port}/postgres"

    def database(self) -> str:
        """A new empty database; its URL."""
        import psycopg

        name = f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.admin_url, autocommit=True) as c:
            c.execute(f"CREATE DATABASE {name}")
        return f"postgresql://{ROLE}@127.0.0.1:{self.port}/{name}"

    def stop(self) -> None:
        try:
            self._run(os.path.join(self.bindir, "pg_ctl"), "-D", self.data, "-m", "immediate",
                      "stop")
        except (RuntimeError, subprocess.TimeoutExpired):
            pass
        shutil.rmtree(self.dir, ignore_errors=True)
