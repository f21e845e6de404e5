"""A real `specdec serve` process on a free loopback port (tests and benchmarks), and the
same app served in the test's own process for tests that need no real one."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import openai


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """Start `specdec serve ARGS...` and wait for /health; `stop()` ends it. A server whose
    ARGS name no `--store` gets a store file of its own (in a temporary folder, gone with
    it), never the user's (`$SPECDEC_CACHE/responses.sqlite3`), which another checkout's
    server may hold, or have written in a later schema.

    Args:
        env: variables to set for the server (e.g. SPECDEC_BLAS=reference).
        launcher: the command before `serve` (default: `python -m specdec`).
        cwd: the server's working directory (default: this process's).
    """

    def __init__(self, *args: str, env: dict[str, str] | None = None,
                 launcher: list[str] | None = None, cwd: str | os.PathLike | None = None
                 ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        extra = env or {}
        env = dict(os.environ)
        env.pop("SPECDEC_BLAS_REEXEC", None)
        env.pop("SPECDEC_BLAS", None)  # the server picks the fast BLAS itself
        env.update(extra)
        launcher = launcher or [sys.executable, "-m", "specdec"]
        self._store = None
        if not any(a == "--store" or a.startswith("--store=") for a in args):
            self._store = tempfile.TemporaryDirectory(prefix="specdec-store-")
            args = (*args, "--store", os.path.join(self._store.name, "responses.sqlite3"))
        # The log goes to a file: a pipe nobody reads would block the server once full.
        self._log = tempfile.NamedTemporaryFile("w+", prefix="specdec-serve-", suffix=".log")
        self.proc = subprocess.Popen(
            [*launcher, "serve", "--port", str(self.port), *args],
            env=env, stdout=subprocess.DEVNULL, stderr=self._log, text=True, cwd=cwd)
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
        if self._store is not None:
            self._store.cleanup()
            self._store = None


class InProcess:
    """An app (`server.app.create_app`) served in this process, for the tests that need no
    real one: requests go through httpx's ASGI transport on one event loop of its own (as
    uvicorn runs the app on one loop), so sync clients and threads can call it like `Server`.
    The transport hands a response over whole: a client leaving mid-stream needs `Server`.

    Args:
        app: the ASGI app. engine: closed by `stop()` (its scheduler thread stops; a
            `Fleet`: every loaded model's).
    """

    url = "http://test"

    def __init__(self, app: object, engine: object = None) -> None:
        self.engine = engine
        self._asgi = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="asgi-loop",
                                        daemon=True)
        self._thread.start()
        self.http = httpx.Client(base_url=self.url, transport=_LoopTransport(self), timeout=300)

    def _send(self, request: httpx.Request) -> httpx.Response:
        async def go() -> httpx.Response:
            r = await self._asgi.handle_async_request(request)
            return httpx.Response(r.status_code, headers=r.headers, content=await r.aread())

        request.read()
        return asyncio.run_coroutine_threadsafe(go(), self._loop).result()

    def client(self, key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0,
                             http_client=httpx.Client(transport=_LoopTransport(self),
                                                      timeout=300))

    def anthropic_client(self, key: str = "unused") -> object:
        """Anthropic's client on this app (its SDK sends through httpx2: `_Httpx2Transport`)."""
        import anthropic
        import httpx2

        return anthropic.Anthropic(base_url=self.url, api_key=key, max_retries=0,
                                   http_client=httpx2.Client(transport=_Httpx2Transport(self),
                                                             timeout=300))

    def stop(self) -> None:
        self.http.close()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()
        if self.engine is not None:
            self.engine.close()  # type: ignore[attr-defined]


class _LoopTransport(httpx.BaseTransport):
    def __init__(self, target: InProcess) -> None:
        self.target = target

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        return self.target._send(request)


def serve_app(*args: str, models: dict[str, object] | None = None) -> InProcess:
    """What `specdec serve ARGS...` serves, in this process: the same flags through the same
    `build_engine` and `ServeConfig`, with `models` (name -> loaded model, e.g. the session's
    embedded target and draft) standing in for loading those names again."""
    from unittest import mock

    from server.app import create_app
    from specdec import cli, models as specdec_models

    ns = cli.build_parser().parse_args(["serve", *args])
    loaded, load = models or {}, specdec_models.load

    def reuse(name: str, **kw: object) -> object:
        return loaded[name] if name in loaded else load(name, **kw)  # type: ignore[arg-type]

    with mock.patch.object(specdec_models, "load", reuse):
        served = cli.serve_target(ns)
    return InProcess(create_app(served, cli.serve_config(ns)), served)


def error_of(r: httpx.Response, status: int, param: str | None = None) -> dict:
    """An OpenAI-shaped error answer's `error` object, checked for its status, its four
    fields and (when given) the field it names."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param, err
    return err


def _Httpx2Transport(target: InProcess) -> object:
    """An httpx2 transport (what Anthropic's SDK sends through) onto `target`'s app."""
    import httpx2

    class Transport(httpx2.BaseTransport):
        def handle_request(self, request: httpx2.Request) -> httpx2.Response:
            r = target._send(httpx.Request(request.method, str(request.url),
                                           headers=request.headers.raw,
                                           content=request.read()))
            return httpx2.Response(r.status_code, headers=r.headers.raw, content=r.content)

    return Transport()
