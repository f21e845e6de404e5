"""A real HAProxy (Debian's, installed by `scripts/dev test`) in front of two replicas, with
the configuration the project ships (`deploy/haproxy.cfg`), or the same without its
affinity rules (round-robin: a conversation's turns alternate replicas)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from tests.serverproc import free_port

CONFIG = Path(__file__).resolve().parent.parent / "deploy" / "haproxy.cfg"


def haproxy() -> tuple[str | None, str]:
    """(the haproxy binary, ""), or (None, why not)."""
    found = shutil.which("haproxy") or ("/usr/sbin/haproxy" if os.path.exists(
        "/usr/sbin/haproxy") else None)
    return (found, "") if found else (None, "no haproxy: install Debian's haproxy "
                                            "(scripts/dev test does, as root)")


def round_robin(text: str) -> str:
    """The shipped configuration without its affinity (its `stick` rules)."""
    return "\n".join(line for line in text.splitlines()
                     if not line.strip().startswith(("stick", "option http-buffer-request"))) + "\n"


class Balancer:
    """HAProxy on a free loopback port in front of `a` and `b` (host:port each)."""

    def __init__(self, a: str, b: str, affinity: bool = True) -> None:
        binary, why = haproxy()
        if binary is None:
            raise RuntimeError(why)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        text = CONFIG.read_text()
        self._dir = tempfile.mkdtemp(prefix="specdec-haproxy-")
        cfg = os.path.join(self._dir, "haproxy.cfg")
        Path(cfg).write_text(text if affinity else round_robin(text))
        env = {**os.environ, "SPECDEC_REPLICA_A": a, "SPECDEC_REPLICA_B": b,
               "SPECDEC_BALANCER_PORT": str(self.port)}
        self._log = open(os.path.join(self._dir, "log"), "w+")
        self.proc = subprocess.Popen([binary, "-f", cfg, "-db"], env=env,
                                     stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.time() + 30
        while True:
            if self.proc.poll() is not None:
                self._log.seek(0)
                raise RuntimeError(f"haproxy exited: {self._log.read()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise RuntimeError("haproxy did not come up")
            time.sleep(0.2)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()
        shutil.rmtree(self._dir, ignore_errors=True)
