"""The library surface and the only door: the loaded models and the scheduler that decodes
every request.

`Engine.load()` loads a model with the shipped settings (`config.EngineConfig`).
`Engine.prepare` hands a request to the engine's `prepare.Preparer` (validate, render,
compile: a `prepare.Request`); `Engine.submit`, the one way in, queues it on the scheduler
and returns its typed event stream (`events.RequestStream`); `Engine.generate` drains that
stream. The CLI, the benchmarks, the server and a sharded target's followers all go through
it, so stops, logprobs, usage and stats are computed once (`output.Output`). It holds no
HTTP; `server/` adapts it.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import mlx.core as mx

from .chat import NO_TEMPLATE
from .config import (GRAMMAR_CACHE_MB, LIMITS, PROMPT_STORE_MB, EngineConfig, EngineDefaults,
                     MaskBudget, SpecConfig)
from .core import DecodeState, Models, new_state
from .decode import PREFILL_CHUNK, PromptKVCache
from .errors import CompileTimeout, DraftConfigError, RequestError, SpecdecError
from .events import Event, Failed, Finished, GenerationStats, RequestStream
from .grammar import CompiledGrammar, GrammarCompiler
from .lookup import SuffixStore, grammar_key
from .models import LoadedModel, gpu_backend
from .reasoning import Thinking
from .output import Output
from .prepare import Preparer, Request
from .request import GenerateRequest, Message, kv_positions
from .scheduler import Decisions, Scheduler, SchedulerStats, Ticket, follower
from .speculative import TreeCosts
from .tools import ToolFormat
from .types import GrammarState, TokenId

__all__ = ["CompileTimeout", "Engine", "EngineDefaults", "Finished", "GenerateRequest",
           "GenerationStats", "Request", "RequestError"]

# Batched rounds on the CPU backend run the draft model up to this many drafting requests.
# Measured with the embedded model and its draft on 2 cores (the six JSON workloads decoded
# together in-process), the draft model pays +2% at 2-4 requests and costs 3% at 6, 6% at 8
# and 10% at 16, where the fp32 forward is compute-bound and forced and looked-up proposals
# already fill the verify rows; bench row `draft_left_out_over_kept_c8` checks it at 8.
CPU_DRAFT_MAX_BATCH = 4
SCOPES = 64  # the cache scopes whose earlier answers are kept (`Engine.suffixes_of`)


def check_draft(target: LoadedModel, draft: LoadedModel) -> None:
    """Refuse a draft that cannot propose in the target's token space.

    Raises:
        DraftConfigError: different tokenizers, or draft logits wider than the target's.
    """
    if draft.vocab_size > target.vocab_size:
        raise DraftConfigError(f"draft {draft.name!r} has {draft.vocab_size} logits, more than "
                               f"the target's {target.vocab_size}")
    if draft.tokenizer is target.tokenizer:
        return
    tv, dv = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    if tv != dv:
        diff = sorted(set(tv.items()) ^ set(dv.items()))[:3]
        raise DraftConfigError(f"draft {draft.name!r} uses a different tokenizer than the target "
                               f"{target.name!r} (e.g. {diff}); speculation needs the same ids")


class Engine:
    """A target model with its grammar compiler, optionally a draft model, and the scheduler
    that decodes every request submitted to it (started on first use). Its `preparer`
    (`prepare.Preparer`) prepares requests; the request settings and prompt helpers are read
    through from it (`PREPARER_SETTINGS`, `PREPARER_HELPERS`: `engine.defaults`,
    `engine.encode(text)`, ...).

    Args:
        target: the loaded target model.
        draft: a draft with the target's tokenizer (may be the target itself), or None.
        spec: default speculative settings for requests.
        jump_forward: with no draft, run constrained requests through the speculative loop
            proposing grammar-forced tokens only (a run of forced tokens costs one forward).
        draft_max_batch: batched rounds run the draft model only while at most this many
            requests would draft (`core.Models.draft_max_batch`); "auto": 4 on the CPU
            backend (measured crossover there), no limit on a GPU; None: no limit.
        defaults: what requests get for the fields they leave out (`EngineDefaults`).
        masks: what one request's grammar may cost (`config.MaskBudget`).
        parser_limits: llguidance's parser limits, by name, over `grammar.PARSER_LIMITS`.
        max_kv_tokens: most KV positions the decoding requests hold together (the
            scheduler's admission: `request.kv_positions`); a request that cannot fit even
            alone is a 400. "auto": a quarter of the machine's memory (`kv_budget`); None:
            no bound.
        grammar_cache_mb: megabytes of compiled grammars kept for reuse
            (`grammar.GrammarCompiler`).
    Raises:
        DraftConfigError: an incompatible draft.
    """

    def __init__(self, target: LoadedModel, draft: LoadedModel | None = None,
                 spec: SpecConfig = SpecConfig(), jump_forward: bool = True,
                 draft_max_batch: int | None | Literal["auto"] = "auto",
                 defaults: EngineDefaults = EngineDefaults(),
                 masks: MaskBudget = MaskBudget(),
                 parser_limits: dict[str, int] | None = None,
                 max_kv_tokens: int | None | Literal["auto"] = "auto",
                 grammar_cache_mb: int = GRAMMAR_CACHE_MB, kv_memory_mb: int | None = None,
                 prompt_store_mb: int = PROMPT_STORE_MB) -> None:
        # what it was built with (`Engine.load` sets the config it was given)
        self.config = EngineConfig(draft="none" if draft is None else
                                   "self" if draft is target else draft.name,
                                   spec=spec, jump_forward=jump_forward,
                                   draft_max_batch=draft_max_batch, defaults=defaults,
                                   masks=masks, max_kv_tokens=max_kv_tokens,
                                   parser_limits=parser_limits,
                                   grammar_cache_mb=grammar_cache_mb,
                                   kv_memory_mb=kv_memory_mb, prompt_store_mb=prompt_store_mb)
        if draft is not None:
            check_draft(target, draft)
        if draft_max_batch == "auto":
            draft_max_batch = None if gpu_backend() else CPU_DRAFT_MAX_BATCH
        if draft_max_batch is not None and (not isinstance(draft_max_batch, int)
                                            or draft_max_batch < 0):
            raise DraftConfigError(f"draft_max_batch={draft_max_batch!r}: must be an integer "
                                   ">= 0 or None")
        self.draft_max_batch = draft_max_batch
        self.target = target
        self.draft = draft
        self.masks = masks
        for name, mb in (("kv_memory_mb", kv_memory_mb), ("prompt_store_mb", prompt_store_mb)):
            if mb is not None and (isinstance(mb, bool) or not isinstance(mb, int) or mb < 0):
                raise RequestError(f"{name}={mb!r}: must be an integer >= 0", param=name)
        self.kv_store = PromptKVCache(max_bytes=prompt_store_mb << 20)
        self.suffixes = SuffixStore()  # earlier answers, for `SpecConfig.suffix` (scope "")
        self._scoped: OrderedDict[str, SuffixStore] = OrderedDict()  # other scopes' (LRU)
        self.tree_costs = TreeCosts()  # what branch rows cost on this machine now
        if isinstance(grammar_cache_mb, bool) or not isinstance(grammar_cache_mb, int) \
                or grammar_cache_mb < 0:
            raise RequestError(f"grammar_cache_mb={grammar_cache_mb!r}: must be an integer "
                               ">= 0", param="grammar_cache_mb")
        compiler = GrammarCompiler.for_hf_tokenizer(
            target.tokenizer, n_vocab=target.vocab_size,
            eos_token_ids=list(target.eos_token_ids), limits=parser_limits,
            cache_bytes=grammar_cache_mb << 20)
        context_length = int(target.config.get("max_position_embeddings") or 2048)
        if max_kv_tokens == "auto":
            max_kv_tokens = kv_budget(target, draft, context_length,
                                      None if kv_memory_mb is None else kv_memory_mb << 20)
        if max_kv_tokens is not None and (not isinstance(max_kv_tokens, int)
                                          or max_kv_tokens < 1):
            raise RequestError(f"max_kv_tokens={max_kv_tokens!r}: must be an integer >= 1 "
                               "or None", param="max_kv_tokens")
        # (the request settings live in the Preparer alone: `defaults`, `default_spec`, ...)
        self.preparer = Preparer(target, compiler, defaults, context_length,
                                 max_kv_tokens, spec, draft is not None, jump_forward)
        if not (defaults.chat_template or getattr(target.tokenizer, "chat_template", None)):
            logging.getLogger("specdec").warning("model %r: %s", target.name, NO_TEMPLATE)
        self._scheduler: Scheduler | None = None  # a thread of its own (`start`)
        self._last: Scheduler | None = None  # the last one started: `close` may still wait on it
        self._inline: Scheduler | None = None  # driven by whoever iterates its streams
        self._lock = threading.Lock()
        self._pumping = threading.Lock()
        self.request_timeout_s: float | None = None
        self._replicas = False

    @classmethod
    def load(cls, model: str = "default", config: EngineConfig = EngineConfig(), *,
             shard_group: Any = None) -> "Engine":
        """A model served as `specdec serve` serves it: `Engine.load()` is the embedded
        default model with its distilled draft and the shipped settings (`EngineConfig()`),
        so a library user decodes exactly as the server and the CLI do.

        Args:
            model: "default" (the embedded model), a local mlx-lm directory, or a repo id in
                the local Hugging Face cache (`models.load`).
            config: the settings (`dataclasses.replace(EngineConfig(), ...)` to change some).
            shard_group: MLX's distributed group to shard the target over (`distributed`).
        Raises:
            ModelNotFoundError: the model (or the draft) is not here. DraftConfigError: a
                draft that cannot serve the target.
        """
        from .models import load

        target = load(model, shard_group=shard_group)
        name = config.draft_for(model)
        draft = None if name is None else target if name == "self" else load(name)
        engine = cls(target, draft, config.spec, jump_forward=config.jump_forward,
                     draft_max_batch=config.draft_max_batch, defaults=config.defaults,
                     masks=config.masks, parser_limits=config.parser_limits,
                     max_kv_tokens=config.max_kv_tokens,
                     grammar_cache_mb=config.grammar_cache_mb,
                     kv_memory_mb=config.kv_memory_mb, prompt_store_mb=config.prompt_store_mb)
        engine.config = config
        return engine

    # -- the scheduler -------------------------------------------------------------------
    def start(self, *, max_batch: int = LIMITS.max_batch, max_queue: int = LIMITS.max_queue,
              request_timeout_s: float | None = None,
              publish: Callable[[Decisions], None] | None = None,
              on_fatal: Callable[[Exception], None] | None = None) -> Scheduler:
        """Start the scheduler thread with these settings (else `submit` starts one with
        the defaults): up to `max_batch` requests decoded together, `max_queue` more waiting
        (then `QueueFull`), each stopped past `request_timeout_s` from submission;
        `publish` / `on_fatal`: a sharded target's rounds (`distributed`). An idle
        scheduler already running is replaced.

        Raises:
            RuntimeError: the running scheduler has requests in hand, or requests submitted
                before it are still decoding.
        """
        with self._lock:
            old = self._scheduler
            if old is not None:
                if old.active or old.queue_depth:
                    raise RuntimeError("the engine's scheduler is busy; it cannot be "
                                       "restarted with new settings")
                old.stop(wait_s=10)
            return self._start(max_batch, max_queue, request_timeout_s, publish, on_fatal)

    def _start(self, max_batch: int = LIMITS.max_batch, max_queue: int = LIMITS.max_queue,
               request_timeout_s: float | None = None,
               publish: Callable[[Decisions], None] | None = None,
               on_fatal: Callable[[Exception], None] | None = None) -> Scheduler:
        """Start the scheduler (the caller holds `_lock`)."""
        inline = self._inline
        if inline is not None and (inline.active or inline.queue_depth):
            raise RuntimeError("requests submitted before start() are still decoding on "
                               "the threads that iterate them; finish them first")
        self.request_timeout_s = request_timeout_s
        self._replicas = publish is not None
        if self._replicas:  # ranks propose alike: no in-round use of the clock
            self.masks = dataclasses.replace(self.masks, in_round=False)
        self._scheduler = self._last = Scheduler(self.models, self.new_state,
                                                 max_batch=max_batch,
                                    max_queue=max_queue, kv_store=self.kv_store,
                                    publish=publish, on_fatal=on_fatal,
                                    max_kv_tokens=self.max_kv_tokens)
        ref = weakref.ref(self)
        atexit.register(lambda: (e := ref()) is not None and e.close())
        return self._scheduler

    @property
    def scheduler(self) -> Scheduler:
        with self._lock:
            if self._scheduler is None:
                self._start()
            return self._scheduler

    def close(self, wait_s: float = 10.0) -> None:
        """Stop the scheduler thread after its current round (requests it still holds end
        with `Failed`); later requests decode on the threads that iterate them again."""
        with self._lock:
            sched, self._scheduler = self._scheduler, None
        if sched is not None:
            sched.stop(wait_s=wait_s)

    def output(self, req: Request, sink: Callable[[Event], None]) -> Output:
        """The request's output router (`output.Output`), putting its events into `sink`."""
        return Output(self.decode_text, sink, stop=req.stop, thinking=req.thinking,
                      calls=dataclasses.replace(req.calls) if req.calls else None,  # its own ids
                      reasoning_tokens=self.reasoning_tokens,
                      prompt_tokens=len(req.prompt_ids), seed=req.sampling.seed,
                      k=req.spec.k if req.spec else 0, warnings=req.warnings)

    def submit(self, req: Request, stream: RequestStream | None = None) -> RequestStream:
        """Queue a prepared request; returns its event stream (pass one bound to an event
        loop to `async for` it there).

        With the scheduler thread started (`start`; a stream bound to an event loop starts
        it), that thread decodes. Before that, the thread that iterates a stream decodes:
        every request submitted so far, batched, in rounds, until that stream's next event
        is in — the same scheduler and output code, with MLX work on the thread that made
        the models (an array made lazily on one thread cannot be evaluated on another).

        Raises:
            QueueFull: `max_queue` requests already wait. SchedulerStopped: after a fatal
            error.
        """
        from .distributed import for_replicas

        stream = stream if stream is not None else RequestStream()
        with self._lock:  # no start() between choosing a scheduler and queueing on it
            if stream._loop is not None or self._scheduler is not None:
                if self._scheduler is None:
                    self._start()
                sched = self._scheduler
            else:
                if self._inline is None:
                    self._inline = Scheduler(self.models, self.new_state, max_queue=1 << 30,
                                             kv_store=self.kv_store, thread=False)
                sched = self._inline
                stream.pump = self._pump
            assert sched is not None
            sched.submit(Ticket(req, self.output(req, stream.put), stream.cancelled,
                                timeout_s=self.request_timeout_s,
                                replica=for_replicas(req) if self._replicas else None))
        return stream

    def keep_history(self, request: GenerateRequest, answer: Message,
                     prepared: Request | None = None) -> int:
        """After `request` (prepared as `prepared`) finished with `answer` (as its API gives
        it back): queue the prefill of the history its conversation's next request starts
        with (`Preparer.history_ids`) into the prompt store, target and draft, restored from
        the answer's own kept state up to where they part (reasoning the template drops,
        calls it re-serializes); that kept state is then superseded. Returns the positions of
        the history queued (0: none: no scheduler thread, no history, a prompt store that
        could not hold it, or no room now)."""
        from .distributed import for_replicas

        sched, store = self._scheduler, self.kv_store
        if sched is None or store is None:
            return 0
        kept = sched.kept_for(prepared) if prepared is not None else ()
        try:
            req = self.preparer.history_request(request, answer, kept)
            if req is None or store.capacity == 0 or (
                    len(req.prompt_ids) * kv_position_bytes(self.target, self.draft)
                    > store.max_bytes):
                return 0
            sched.submit(Ticket(req, Output(self.decode_text, drop),
                                timeout_s=self.request_timeout_s,
                                replica=for_replicas(req) if self._replicas else None))
        except SpecdecError:  # no room now (queue full, stopped): the next turn computes it
            return 0
        return len(req.prompt_ids) - 1

    def _pump(self) -> bool:
        """One round of the threadless scheduler, on the calling thread."""
        assert self._inline is not None
        with self._pumping:
            return self._inline.pump()

    def generate(self, req: Request) -> Finished:
        """Run one request to completion (through the scheduler, like every request).

        Raises:
            SpecdecError: the request failed (`events.Failed`).
        """
        for ev in self.submit(req):
            if isinstance(ev, Failed):
                raise ev.error
            if isinstance(ev, Finished):
                return ev
        raise AssertionError("a request stream ended without Finished or Failed")

    # -- preparation (`prepare.Preparer`) -------------------------------------------------
    def prepare(self, request: GenerateRequest | Sequence[TokenId], **fields: Any) -> Request:
        """Validate, render and compile a request (`Preparer.prepare`)."""
        return self.preparer.prepare(request, **fields)

    @property
    def compiler(self) -> GrammarCompiler:
        return self.preparer.compiler

    @compiler.setter
    def compiler(self, compiler: GrammarCompiler) -> None:  # engines sharing one compiler
        self.preparer.compiler = compiler

    # -- the state the server and a sharded target's followers read ------------------------
    def status(self) -> "EngineStatus":
        """The scheduler thread's state now (for /health, /metrics and a sharded target's
        watchdog), also while `close` waits for its last round; starts nothing. Before any
        scheduler thread ran: alive and idle (`submit` starts one)."""
        with self._lock:
            sched = self._scheduler or self._last
        if sched is None:
            return EngineStatus(True, False, 0, 0, SchedulerStats(), None)
        started = sched.round_started
        return EngineStatus(sched.alive and sched is self._scheduler, sched.fatal is not None,
                            sched.queue_depth, sched.active, sched.stats,
                            None if started is None else time.perf_counter() - started)

    def check_room(self) -> None:
        """Raise what `submit` would raise now for want of room (`QueueFull`, or
        `SchedulerStopped`), before a caller spends work preparing a request."""
        with self._lock:
            sched = self._scheduler
        if sched is not None:
            sched.check_room()

    def abort(self, error: Exception) -> None:
        """From any thread, while a round is stuck (a sharded target's collective that never
        returns, also while `close` waits for it): every request fails with `error` now, and
        no more are taken."""
        with self._lock:
            sched = self._scheduler or self._last
        if sched is not None:
            sched.abort(error)

    def follower(self, max_batch: int, chunk: int = PREFILL_CHUNK
                 ) -> Callable[[Decisions], None]:
        """A sharded target's follower rank: a function that replays one round from the
        decisions rank 0 published (`Scheduler.follow`), on the calling thread. Proposals
        use no clock (`MaskBudget.in_round` off), so every rank proposes alike."""
        self.masks = dataclasses.replace(self.masks, in_round=False)
        return follower(self.models, self.new_state, lambda req: self.output(req, drop),
                        max_batch, chunk, self.kv_store)

    # -- batching ------------------------------------------------------------------------
    @property
    def models(self) -> Models:
        """The models requests decode with (for `core` and the scheduler)."""
        d = self.draft
        return Models(self.target.model, self.target.vocab_size, d.model if d else None,
                      d.vocab_size if d else 0, self.draft_max_batch, self.masks,
                      self.tree_costs)

    # -- the Preparer's settings and prompt helpers, read through the Engine -----------------
    # (held once, in `preparer`; a setting is set there; a helper may be replaced on one
    # engine, as a method can: tests wrap `matcher` so)
    @property
    def defaults(self) -> EngineDefaults:
        return self.preparer.defaults

    @property
    def default_spec(self) -> SpecConfig | None:
        return self.preparer.default_spec

    @property
    def jump_forward(self) -> bool:
        return self.preparer.jump_forward

    @property
    def context_length(self) -> int:
        return self.preparer.context_length

    @property
    def max_kv_tokens(self) -> int | None:
        return self.preparer.max_kv_tokens

    @property
    def kv_bytes(self) -> int:
        """The bytes its KV budget may hold (0: no budget, `max_kv_tokens` None)."""
        n = self.max_kv_tokens
        return 0 if n is None else n * kv_position_bytes(self.target, self.draft)

    def encode(self, text: str, *, raw: bool = False) -> list[TokenId]:
        """`Preparer.encode`"""
        return self.preparer.encode(text, raw=raw)

    def decode_text(self, tokens: Sequence[TokenId]) -> str:
        """`Preparer.decode_text`"""
        return self.preparer.decode_text(tokens)

    def chat_prompt(self, messages: list[dict[str, Any]], **kw: Any) -> list[TokenId]:
        """`Preparer.chat_prompt`"""
        return self.preparer.chat_prompt(messages, **kw)

    def chat_prompt_thinking(self, messages: list[dict[str, Any]], **kw: Any
                             ) -> tuple[list[TokenId], Thinking]:
        """`Preparer.chat_prompt_thinking`"""
        return self.preparer.chat_prompt_thinking(messages, **kw)

    def tool_format(self, template: str | None = None) -> ToolFormat:
        """`Preparer.tool_format`"""
        return self.preparer.tool_format(template)

    def reasoning_tokens(self, tokens: Sequence[TokenId], thinking: Thinking) -> int:
        """`Preparer.reasoning_tokens`"""
        return self.preparer.reasoning_tokens(tokens, thinking)

    def compiled(self, req: Request) -> CompiledGrammar | None:
        """`Preparer.compiled`"""
        return self.preparer.compiled(req)

    def matcher(self, req: Request) -> GrammarState | None:
        """`Preparer.matcher`"""
        return self.preparer.matcher(req)

    def new_state(self, req: Request) -> DecodeState:
        """The request's decode state (caches empty: the scheduler prefills in chunks)."""
        if req.closing is not None and req.closing.order is None:  # a replica's request
            req = dataclasses.replace(req, closing=dataclasses.replace(
                req.closing, order=self.compiler.closing_order(self.target.vocab_size)))
        return new_state(self.models, req, self.target.eos_token_ids,
                         matcher=self.matcher(req), suffixes=self.suffixes_of(req.scope),
                         suffix_key=(grammar_key(req.grammar.text)
                                     if req.grammar is not None else None))


    def suffixes_of(self, scope: str) -> SuffixStore:
        """The earlier answers a request of `scope` proposes from and adds to
        (`GenerateRequest.cache_scope`): one store per scope, the `SCOPES` used last kept."""
        if not scope:
            return self.suffixes
        store = self._scoped.pop(scope, None) or SuffixStore()
        self._scoped[scope] = store
        while len(self._scoped) > SCOPES:
            self._scoped.popitem(last=False)
        return store


def drop(_event: Event) -> None:
    """The sink of a follower rank's outputs: rank 0 answers the clients."""


@dataclass(frozen=True)
class EngineStatus:
    """The scheduler's state (`Engine.status`).

    Attributes:
        alive: it can serve (no fatal error; its thread runs). failed: a fatal error
            stopped it. queue_depth, active: requests waiting, decoding. stats: its
            counters. round_s: how long the current round has run (None: between rounds).
    """

    alive: bool
    failed: bool
    queue_depth: int
    active: int
    stats: SchedulerStats
    round_s: float | None


KV_MEMORY_SHARE = 0.25  # of the machine's memory (a GPU's working set), for "auto"


def kv_position_bytes(target: LoadedModel, draft: LoadedModel | None) -> int:
    """The bytes one position of a request's KV takes: the target's and its draft's."""
    from .ragged import kv_bytes_per_position

    return kv_bytes_per_position(target.model) + (
        kv_bytes_per_position(draft.model) if draft is not None and draft is not target else 0)


def kv_budget(target: LoadedModel, draft: LoadedModel | None, context_length: int,
              memory: int | None = None) -> int:
    """The default KV budget (positions): `memory` bytes (None: a quarter of the memory MLX
    may use) over the target's (and the draft's) KV bytes per position; at least one
    full-context request."""
    per = kv_position_bytes(target, draft)
    if memory is not None:
        return max(memory // max(1, per), kv_positions(context_length, 0))
    try:
        memory = int(mx.metal.device_info()["max_recommended_working_set_size"]) \
            if gpu_backend() and mx.metal.is_available() else \
            os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, KeyError, OSError, ValueError):
        memory = 16 << 30
    return max(int(memory * KV_MEMORY_SHARE) // max(1, per),
               kv_positions(context_length, 0))
