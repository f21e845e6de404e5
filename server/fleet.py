"""The models a server serves, by name: each loaded on its first request, at most
`max_loaded` resident and at most `memory_budget` bytes (weights, grammar caches, KV budgets
and prompt stores: `footprint`), the
least recently used idle one unloaded to make room, an idle one unloaded past its TTL, a
pinned one never.

Each loaded model is an `Engine` of its own: its tokenizer, grammar compiler, chat template,
reasoning and tool formats, draft, KV budget and scheduler thread. One scheduler per model,
not one for all: a round decodes one model's forward over its batch, so a shared scheduler
would interleave rounds of different models anyway, and separate ones need no change to
the scheduler, keep a request's tokens independent of the other models' requests (each
batch holds one model's requests only), and let two models decode at the same time.

A request holds a lease on its model from routing to its last event (`Door.open`,
`Run.close`): a model with a lease, or with requests in its scheduler, is busy and never
unloaded. Loads run one at a time on a thread of their own; concurrent first requests for a
model wait on its one load.

A request for a model that cannot load yet (no room, and the models that hold it busy)
waits in one FIFO queue until they are idle, then swaps them out: at most `load_wait_s`
(`--load-wait`) and its own time limit, then a 503 `models_busy`. While anyone waits, a
new request joins the queue behind them, whatever its model (a model in steady use cannot
starve a waiting one). Only where waiting cannot help (the models in the way are pinned)
is the 503 at once. `waiting`, `waits`, `wait_s` and `wait_timeouts` are for /metrics.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import gc
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from specdec.catalog import DEFAULT_NAME, Catalog, ModelSpec
from specdec.engine import Engine
from specdec.errors import DeadlineExceeded, ModelLoadError, ModelsBusy, SpecdecError
from specdec.prompt_bound import PromptBound

from .errors import NoRoom, WireError

log = logging.getLogger("specdec.server")
REAP_EVERY_S = 1.0  # how often idle models are checked against their TTL
LOAD_WAIT_S = 120.0  # the longest a request waits for room for its model (--load-wait)
WAIT_POLL_S = 0.05  # how often a waiting request looks again


@dataclass(eq=False)
class Seat:
    """A served model: its spec, what `/v1/models` says of it, and its engine while loaded.

    Attributes:
        card: family, quantization, context length (from its config.json, unloaded too).
        leases: requests routed to it and not yet ended. last_used: when the last one
            began or ended (`time.monotonic`). loads, evictions, load_s, requests,
            tokens: its history (for /metrics).
    """

    spec: ModelSpec
    card: dict[str, Any]
    engine: Engine | None = None
    bound: PromptBound | None = None  # the loaded engine's (`bound_of`)
    loading: Future[Engine] | None = None
    leases: int = 0
    last_used: float = field(default_factory=time.monotonic)
    loads: int = 0
    evictions: int = 0
    load_s: float = 0.0
    bytes: int = 0  # what it may hold: its weights' (and its draft's) bytes, estimated then
    # measured once loaded, and its compiled-grammar cache's size (`footprint`)
    requests: int = 0  # submitted to its engine
    tokens: int = 0  # output tokens of its finished requests
    pinned: bool = False  # never unloaded to make room or for its TTL (the spec's, or set)

    def __post_init__(self) -> None:
        self.pinned = self.spec.pinned

    @property
    def name(self) -> str:
        return self.spec.name


def card_of(config: dict[str, Any]) -> dict[str, Any]:
    """What a model's config.json says of it for `/v1/models`."""
    q = config.get("quantization") or config.get("quantization_config")
    return {"family": config.get("model_type"),
            "quantization": (f"{q['bits']}-bit" if isinstance(q, dict) and "bits" in q
                             else q if isinstance(q, str) else None),  # a GGUF's file type
            "context_length": int(config.get("max_position_embeddings") or 2048)}


def bound_of(engine: Engine) -> PromptBound | None:
    """A loaded engine's prompt bound: its context length and its tokenizer's (None for a
    stand-in engine without a preparer, as the protocol tests serve)."""
    preparer = getattr(engine, "preparer", None)
    if preparer is None:
        return None
    return PromptBound.of(preparer.context_length, preparer.target.tokenizer,
                          preparer.compiler.tokenizer)


def weight_bytes(engine: Engine) -> int:
    """The bytes of a loaded engine's parameters: its target's and its own draft's."""
    from mlx.utils import tree_flatten

    models = [engine.target] + ([engine.draft] if getattr(engine, "draft", None) is not None
                                and engine.draft is not engine.target else [])
    return sum(v.nbytes for m in models if hasattr(m, "model")
               for _, v in tree_flatten(m.model.parameters()))


def footprint(engine: Engine) -> int:
    """What a loaded engine may hold: its weights, and full (they fill as requests come, and
    only an unload empties them) its compiled-grammar cache, its KV budget (`Engine.kv_bytes`)
    and its prompt store's bound."""
    compiler = getattr(engine, "compiler", None)
    store = getattr(engine, "kv_store", None)
    return (weight_bytes(engine) + (compiler.cache_bytes if compiler is not None else 0)
            + getattr(engine, "kv_bytes", 0) + (store.max_bytes if store is not None else 0))


KV_BUDGET_SHARE = 4  # under a memory budget, an "auto" KV budget is 1/4 of it
PROMPT_STORE_SHARE = 16  # and the prompt store at most 1/16 of it


def within_budget(spec: ModelSpec, budget: int) -> ModelSpec:
    """A model's settings under a server's memory budget: an "auto" KV budget sized to a
    quarter of it (not of the machine's memory), its prompt store to at most a sixteenth."""
    c = spec.config
    kv = c.kv_memory_mb if c.kv_memory_mb is not None or c.max_kv_tokens != "auto" else \
        (budget // KV_BUDGET_SHARE) >> 20
    return replace(spec, config=replace(c, kv_memory_mb=kv, prompt_store_mb=min(
        c.prompt_store_mb, (budget // PROMPT_STORE_SHARE) >> 20)))


def kv_estimate(config: dict[str, Any], positions: int) -> int:
    """The bytes of `positions` KV positions of a model not loaded yet, from its config.json
    (its activations float32 on the CPU, else its dtype, as `models.load` makes them)."""
    from specdec.models import gpu_backend

    c = config.get("text_config") or config
    heads = int(c.get("num_attention_heads") or 1)
    kv_heads = int(c.get("num_key_value_heads") or heads)
    head_dim = int(c.get("head_dim") or int(c.get("hidden_size") or 0) // heads)
    size = 2 if gpu_backend() and str(config.get("torch_dtype")) in ("float16",
                                                                     "bfloat16") else 4
    return int(c.get("num_hidden_layers") or 0) * kv_heads * 2 * head_dim * size * positions


def describe(spec: ModelSpec) -> dict[str, Any]:
    """An unloaded model's config.json, or what a GGUF file's header says (it converts when
    it first loads, not at start)."""
    from specdec.convert import describe_gguf
    from specdec.errors import ConversionError, ModelConfigError
    from specdec.models import default_weight_format, resolve_model_path

    path = Path(spec.path).expanduser()
    if path.suffix.lower() == ".gguf" and path.is_file():
        try:
            return describe_gguf(path, default_weight_format())
        except ConversionError as e:
            raise ModelConfigError(f"model {spec.name!r}: {e}") from None
    return json.loads((resolve_model_path(spec.path) / "config.json").read_text())


def estimate_bytes(spec: ModelSpec) -> int:
    """What a model will hold before it loads: its (and its draft's) weight files, twice
    that where half-precision weights are widened to float32 (`models.load` on the CPU),
    its compiled-grammar cache's size, its KV budget (an "auto" one sized to
    `kv_memory_mb`, else estimated as a quarter of the machine's memory) and its prompt
    store's bound."""
    from specdec.engine import KV_MEMORY_SHARE
    from specdec.models import gpu_backend, resolve_model_path

    from specdec.request import kv_positions

    c = spec.config
    draft = c.draft_for(spec.path)
    total = kv = floor = 0
    for path in [spec.path] + ([draft] if draft not in (None, "self") else []):
        if str(path).lower().endswith(".gguf") and Path(path).expanduser().is_file():
            config = describe(replace(spec, path=path))
            total += config["specdec_bytes"]
        else:
            d = resolve_model_path(path)
            size = sum(f.stat().st_size for f in d.glob("*.safetensors"))
            config = json.loads((d / "config.json").read_text())
            half = str(config.get("torch_dtype", "")) in ("float16", "bfloat16")
            total += size * 2 if half and "quantization" not in config and not gpu_backend() \
                else size
        if isinstance(c.max_kv_tokens, int) and not isinstance(c.max_kv_tokens, bool):
            kv += kv_estimate(config, c.max_kv_tokens)
        if path == spec.path:  # an "auto" budget holds one full-context request at least
            ctx = int((config.get("text_config") or config).get("max_position_embeddings")
                      or config.get("max_position_embeddings") or 2048)
        floor += kv_estimate(config, kv_positions(ctx, 0))
    if c.max_kv_tokens == "auto":
        kv = max(floor, c.kv_memory_mb << 20 if c.kv_memory_mb is not None else
                 int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * KV_MEMORY_SHARE))
    return total + (c.grammar_cache_mb << 20) + kv + (c.prompt_store_mb << 20)


def trim_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc's `malloc_trim`; elsewhere
    nothing): without it an unloaded model's freed tokenizer and loading buffers stay in
    the process (measured: ~400 MB of the embedded model's first unload)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class Fleet:
    """The served models (`Seat`s) and their loading and unloading.

    Args:
        catalog: the models by name. loader: a spec's engine (loaded, not started).
        max_loaded: most models resident at once (None: no limit).
        memory_budget: most bytes resident at once (None: no limit): a model counts its
            grammar cache's size, its KV budget's and prompt store's bytes (an "auto" KV
            budget and the store sized within the budget: `within_budget`), and its weight
            files' size until loaded (twice that for half-precision weights the CPU backend
            widens), then its parameters' bytes.
        loaded: engines already loaded, by model name (a single-model server's).
    """

    def __init__(self, catalog: Catalog, loader: Callable[[ModelSpec], Engine],
                 max_loaded: int | None = None, loaded: dict[str, Engine] | None = None,
                 memory_budget: int | None = None, load_wait_s: float = LOAD_WAIT_S) -> None:
        if max_loaded is not None and max_loaded < 1:
            raise ValueError(f"--max-loaded {max_loaded}: at least 1")
        self.catalog, self.loader, self.max_loaded = catalog, loader, max_loaded
        self.memory_budget, self.load_wait_s = memory_budget, load_wait_s
        self._queue: collections.deque[object] = collections.deque()  # waiting requests
        self.waits = self.wait_timeouts = 0
        self.wait_s = 0.0
        loaded = loaded or {}
        self.seats = []
        for spec in catalog.models:
            engine = loaded.get(spec.name)
            if engine is None and memory_budget is not None:
                spec = within_budget(spec, memory_budget)
            config = (getattr(engine.target, "config", None) or {} if engine is not None
                      else describe(spec))
            card = card_of(config)
            if engine is not None:
                d = getattr(engine, "draft", None)
                card["draft"] = "none" if d is None else "self" if d is engine.target else d.name
            else:
                card["draft"] = spec.config.draft_for(spec.path) or "none"
            seat = Seat(spec, card, engine, bound_of(engine) if engine is not None else None)
            seat.bytes = footprint(engine) if engine is not None else estimate_bytes(spec)
            self.seats.append(seat)
        self.default = self.seat(catalog.default)
        self._start: Callable[[Engine], None] = lambda engine: None
        self._lock = threading.Lock()
        self._loads = ThreadPoolExecutor(1, thread_name_prefix="specdec-load")
        self._closed = threading.Event()
        self._reaper: threading.Thread | None = None

    @classmethod
    def single(cls, engine: Engine) -> "Fleet":
        """One engine, loaded already and never unloaded (a single-model server)."""
        name = engine.target.name
        spec = ModelSpec(name, str(getattr(engine.target, "path", name)),
                         getattr(engine, "config", None), pinned=True)  # type: ignore[arg-type]
        return cls(Catalog((spec,), name), lambda s: engine, loaded={name: engine})

    def start(self, start: Callable[[Engine], None]) -> None:
        """Start the loaded engines' schedulers with `start`, and every later load's; watch
        the TTLs."""
        self._start = start
        for s in self.seats:
            if s.engine is not None:
                start(s.engine)
        if any(s.spec.ttl_s is not None for s in self.seats):
            self._reaper = threading.Thread(target=self._reap, name="specdec-ttl", daemon=True)
            self._reaper.start()

    # -- routing ---------------------------------------------------------------------------
    def seat(self, name: str) -> Seat:
        """The seat of a configured name or alias."""
        spec = self.catalog.named(name)
        return next(s for s in self.seats if s.spec.name == spec.name)

    def route(self, name: str | None, param: str = "model") -> Seat:
        """The seat a request's `model` names (None or "default": the default).

        Raises:
            WireError: 404 naming the models there are.
        """
        spec = self.catalog.named(DEFAULT_NAME if name is None else name)
        if spec is None:
            names = ", ".join(repr(s.name) for s in self.seats)
            raise WireError(404, f"model {name!r} does not exist; this server serves {names}",
                            param=param, code="model_not_found")
        return next(s for s in self.seats if s.spec.name == spec.name)

    def loaded(self, name: Any) -> Seat | None:
        """The seat a body's `model` value names, if it is loaded (else None)."""
        spec = self.catalog.named(name) if isinstance(name, str) else \
            self.default.spec if name is None else None
        seat = next((s for s in self.seats if spec is not None and s.spec.name == spec.name),
                    None)
        return seat if seat is not None and seat.engine is not None else None

    # -- leases and loads ----------------------------------------------------------------
    @property
    def waiting(self) -> int:
        """Requests waiting for room for their model."""
        return len(self._queue)

    async def acquire(self, seat: Seat, timeout_s: float | None = None) -> Engine:
        """Lease `seat` for a request and return its engine, loading it first when it is not
        (one load however many requests wait on it, within `timeout_s`); where there is no
        room yet, wait in the queue (module docstring) at most `load_wait_s` and
        `timeout_s`.

        Raises:
            ModelLoadError: the load failed (the next request tries again). ModelsBusy:
                no room, and the wait ran out (or waiting cannot help: pinned models hold
                it). DeadlineExceeded: the load did not finish within `timeout_s`.
        """
        loop = asyncio.get_running_loop()
        start = loop.time()
        wait = self.load_wait_s if timeout_s is None else min(self.load_wait_s, timeout_s)
        ticket: object | None = None
        try:
            while True:
                with self._lock:
                    # (a pinned model's requests pass the line: it never makes room)
                    mine = (self._queue[0] is ticket) if self._queue else ticket is None
                    if mine or (seat.pinned and seat.engine is not None and ticket is None):
                        try:
                            engine, job = self._lease(seat)
                            break
                        except NoRoom as e:
                            if not e.waitable:
                                raise
                            if loop.time() - start >= wait:
                                self.wait_timeouts += 1
                                raise ModelsBusy(f"{e} (waited {loop.time() - start:.3g}s "
                                                 "for room)") from None
                    if ticket is None:
                        ticket = object()
                        self._queue.append(ticket)
                        self.waits += 1
                    elif loop.time() - start >= wait:  # behind others, out of time
                        self.wait_timeouts += 1
                        raise ModelsBusy(f"model {seat.name!r} waited {wait:g}s behind "
                                         f"{self._queue.index(ticket)} requests for room")
                await asyncio.sleep(WAIT_POLL_S)
        finally:
            if ticket is not None:
                with self._lock:
                    self._queue.remove(ticket)
                    self.wait_s += loop.time() - start
        if job is None:
            return engine
        left = None if timeout_s is None else max(0.0, timeout_s - (loop.time() - start))
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(job)), left)
        except asyncio.TimeoutError:
            self.release(seat)
            raise DeadlineExceeded(f"model {seat.name!r} did not load within the request's "
                                   f"time limit ({timeout_s:g}s)") from None
        except BaseException:
            self.release(seat)
            raise

    def _lease(self, seat: Seat) -> tuple[Engine | None, Future[Engine] | None]:
        """A lease on `seat` (the caller holds `_lock`): its engine, or its load's job."""
        seat.leases += 1
        seat.last_used = time.monotonic()
        try:
            return seat.engine, None if seat.engine is not None else self._load_job(seat)
        except BaseException:
            seat.leases -= 1
            raise

    def release(self, seat: Seat) -> None:
        with self._lock:
            seat.leases -= 1
            seat.last_used = time.monotonic()

    def _load_job(self, seat: Seat) -> Future[Engine]:
        """The seat's load (the caller holds `_lock`): the one under way, else a new one,
        after making room."""
        if seat.loading is not None:
            return seat.loading
        budget, most = self.memory_budget, self.max_loaded
        if budget is not None and seat.bytes > budget:
            raise ModelLoadError(f"model {seat.name!r} needs {seat.bytes >> 20} MB (weights, "
                                 "grammar cache, KV budget and prompt store), over the memory "
                                 "budget "
                                 f"({budget >> 20} MB)")
        resident = [s for s in self.seats if s.engine is not None or s.loading is not None]

        def full() -> str | None:
            if most is not None and len(resident) >= most:
                return f"{len(resident)} models are loaded (--max-loaded {most})"
            used = sum(s.bytes for s in resident)
            if budget is not None and used + seat.bytes > budget:
                return (f"it needs {seat.bytes >> 20} MB and the loaded models hold "
                        f"{used >> 20} MB of the {budget >> 20} MB memory budget")
            return None

        def room_without(gone: list[Seat]) -> bool:
            left = [s for s in resident if s not in gone]
            return (most is None or len(left) < most) and (
                budget is None or sum(s.bytes for s in left) + seat.bytes <= budget)

        why = full()
        idle = [s for s in resident if s.engine is not None and self._idle(s)]
        if why is not None and not room_without(idle):  # (then unload nothing)
            later = [s for s in resident if not s.pinned]  # idle once their requests end
            raise NoRoom(f"model {seat.name!r} cannot load: {why}, and every loaded model "
                         "that would make room is in use or pinned",
                         waitable=room_without(later))
        while (why := full()) is not None:
            idle = [s for s in resident if s.engine is not None and self._idle(s)]
            victim = min(idle, key=lambda s: s.last_used)
            self._unload(victim, "to make room for " + repr(seat.name))
            resident.remove(victim)
        seat.loading = self._loads.submit(self._load, seat)
        return seat.loading

    def _idle(self, seat: Seat) -> bool:
        """Unloadable now: not pinned, no lease, nothing in its scheduler (holds `_lock`)."""
        return not seat.pinned and not self._busy(seat)

    def _busy(self, seat: Seat) -> bool:
        """A request of it routed, queued or decoding (the caller holds `_lock`)."""
        if seat.leases:
            return True
        st = seat.engine.status()
        return bool(st.active or st.queue_depth)

    # -- what an administrator asks ------------------------------------------------------
    async def load(self, seat: Seat, timeout_s: float | None = None) -> None:
        """Load `seat` now (as its first request would: one load, room made)."""
        await self.acquire(seat, timeout_s)
        self.release(seat)

    def unload(self, seat: Seat) -> None:
        """Unload `seat` now, pinned or not, unless a request of it is in hand.

        Raises:
            ModelsBusy: it has requests routed, queued or decoding.
        """
        with self._lock:
            if seat.engine is None:
                return
            if self._busy(seat):
                raise ModelsBusy(f"model {seat.name!r} has requests in hand; unload it once "
                                 "they end")
            self._unload(seat, "asked to")

    def pin(self, seat: Seat, pinned: bool) -> None:
        with self._lock:
            seat.pinned = pinned

    def _load(self, seat: Seat) -> Engine:
        """Load and start a seat's engine (on the load thread)."""
        t0 = time.perf_counter()
        try:
            engine, bound = self._make(seat)
        except BaseException:
            with self._lock:  # a later request tries again
                seat.loading = None
            raise
        with self._lock:
            seat.engine, seat.bound, seat.loading = engine, bound, None
            seat.bytes = footprint(engine)
            seat.loads += 1
            seat.load_s += time.perf_counter() - t0
        log.info("loaded model %r in %.2fs", seat.name, time.perf_counter() - t0)
        return engine

    def _make(self, seat: Seat) -> tuple[Engine, PromptBound | None]:
        """A seat's engine, started, and its prompt bound.

        Raises:
            ModelLoadError: naming the model and the cause.
        """
        log.info("loading model %r (%s)", seat.name, seat.spec.path)
        try:
            engine = self.loader(seat.spec)
            self._start(engine)
            return engine, bound_of(engine)
        except SpecdecError as e:
            raise ModelLoadError(f"model {seat.name!r} failed to load: {e}") from e
        except Exception as e:  # a broken model directory: its own exception, named
            log.exception("model %r failed to load", seat.name)
            raise ModelLoadError(f"model {seat.name!r} failed to load: "
                                 f"{type(e).__name__}: {e}") from e

    def _unload(self, seat: Seat, why: str) -> None:
        """Stop and drop a seat's engine (the caller holds `_lock`; the seat is idle)."""
        import mlx.core as mx

        engine, seat.engine, seat.bound = seat.engine, None, None
        seat.evictions += 1
        log.info("unloading model %r (%s)", seat.name, why)
        engine.close()
        del engine
        gc.collect()
        mx.clear_cache()
        trim_heap()

    def _reap(self) -> None:
        while not self._closed.wait(REAP_EVERY_S):
            now = time.monotonic()
            with self._lock:
                for s in self.seats:
                    ttl = s.spec.ttl_s
                    if s.engine is not None and ttl is not None and \
                            now - s.last_used >= ttl and self._idle(s):
                        self._unload(s, f"idle for {ttl:g}s")

    def close(self) -> None:
        self._closed.set()
        self._loads.shutdown(wait=False, cancel_futures=True)
        for s in self.seats:
            if s.engine is not None:
                s.engine.close()
