"""A real `specdec serve` process on a free loopback port (tests and benchmarks)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import openai


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """Start `specdec serve ARGS...` and wait for /health; `stop()` ends it.

    Args:
        env: variables to set for the server (e.g. SPECDEC_BLAS=reference).
        launcher: the command before `serve` (default: `python -m specdec`).
    """

    def __init__(self, *args: str, env: dict[str, str] | None = None,
                 launcher: list[str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        extra = env or {}
        env = dict(os.environ)
        env.pop("SPECDEC_BLAS_REEXEC", None)
        env.pop("SPECDEC_BLAS", None)  # the server picks the fast BLAS itself
        env.update(extra)
        launcher = launcher or [sys.executable, "-m", "specdec"]
        # The log goes to a file: a pipe nobody reads would block the server once full.
        self._log = tempfile.NamedTemporaryFile("w+", prefix="specdec-serve-", suffix=".log")
        self.proc = subprocess.Popen(
            [*launcher, "serve", "--port", str(self.port), *args],
            env=env, stdout=subprocess.DEVNULL, stderr=self._log, text=True)
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.log()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.3)
        raise RuntimeError("server did not come up")

    def log(self) -> str:
        """What the server has logged so far (all of it, once stopped)."""
        if self._log.closed:
            return self._final
        with open(self._log.name) as f:
            return f.read()

    def client(self, key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0,
                             timeout=300)

    def stop(self, wait_s: float = 20) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        if not self._log.closed:
            self._final = self.log()
            self._log.close()
