"""The library surface: a loaded target + its grammar compiler, generating text for requests.

`Engine.generate` wraps the round-based core (`core.decode_rounds`) with tokenization, stop
strings, request validation and statistics; `Engine.new_state` and `TextStream` give the
scheduler the same pieces for batched serving. It holds no HTTP; `server/` adapts it.
"""

from __future__ import annotations

import dataclasses

import concurrent.futures
import secrets
import time
from collections.abc import Generator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from .chat import render_chat, render_thinking
from .core import DecodeState, Models, decode_rounds, new_state
from .decode import FinishReason, PromptKVCache, StepTimings, TokenId
from .grammar import CompiledGrammar, Constraint, GrammarCompiler, GrammarError
from .models import LoadedModel, gpu_backend
from .reasoning import SEPARATOR, Thinking, ThinkingMatcher, marker_ids
from .sampling import SamplingParams
from .speculative import DraftConfigError, SpecConfig, SpecStats

DEFAULT_MAX_TOKENS = 256
# Batched rounds on the CPU backend run the draft model up to this many drafting requests.
# Measured with the embedded model and its draft on 2 cores (the six JSON workloads decoded
# together in-process), the draft model pays +2% at 2-4 requests and costs 3% at 6, 6% at 8
# and 10% at 16, where the fp32 forward is compute-bound and forced and looked-up proposals
# already fill the verify rows; bench row `draft_left_out_over_kept_c8` checks it at 8.
CPU_DRAFT_MAX_BATCH = 4


class RequestError(ValueError):
    """A request parameter outside its valid range; the message names value and range."""


class CompileTimeout(GrammarError):
    """A constraint that did not compile within the request's time limit."""


@dataclass(frozen=True)
class GenerationStats:
    """What one request cost. Times in seconds.

    The decode loop's timings and speculative counters (`prefill_s`, `mask_s`, `rounds`,
    `accepted`, `grammar_cuts`, ...; zero for plain decoding) are read through from
    `counters`.
    """

    prompt_tokens: int
    completion_tokens: int
    decode_s: float
    seed: int | None
    k: int
    counters: SpecStats

    def __getattr__(self, name: str) -> Any:
        return getattr(self.counters, name)

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.decode_s if self.decode_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k != "counters"}
        d.update(asdict(self.counters))
        d["tokens_per_s"] = round(self.tokens_per_s, 3)
        d["acceptance_rate"] = round(self.counters.acceptance_rate, 4)
        return d


@dataclass(frozen=True)
class GenerationResult:
    """The output of one request: text, token ids (no EOS), why it ended, and its stats."""

    text: str
    tokens: tuple[TokenId, ...]
    finish_reason: FinishReason
    stats: GenerationStats
    warnings: tuple[str, ...] = field(default=())


@dataclass(frozen=True)
class Request:
    """One generation request, validated by `Engine.prepare`.

    Attributes:
        prompt_ids: prompt token ids.
        constraint: what the output must match, or None.
        sampling: how tokens are picked (seed filled in when sampling).
        max_tokens: most tokens to generate.
        stop: strings that end the output (not included in it).
        spec: speculative settings, or None for plain decoding.
        grammar: the constraint compiled once by `Engine.prepare` (None when unconstrained).
        logprobs: None, or report each token's logprob and its top `logprobs` (0..20)
            alternatives (`core.TokenLogprob`; the scheduler's events carry them).
        thinking: think before the constrained answer (`reasoning.Thinking`), or None.
    """

    prompt_ids: tuple[TokenId, ...]
    constraint: Constraint | None = None
    sampling: SamplingParams = SamplingParams()
    max_tokens: int = DEFAULT_MAX_TOKENS
    stop: tuple[str, ...] = ()
    spec: SpecConfig | None = None
    grammar: CompiledGrammar | None = field(default=None, repr=False, compare=False)
    logprobs: int | None = None
    thinking: Thinking | None = None


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
    """A target model with its grammar compiler and, optionally, a draft model.

    Args:
        target: the loaded target model.
        draft: a draft with the target's tokenizer (may be the target itself), or None.
        spec: default speculative settings for requests.
        jump_forward: with no draft, run constrained requests through the speculative loop
            proposing grammar-forced tokens only (a run of forced tokens costs one forward).
        draft_max_batch: batched rounds run the draft model only while at most this many
            requests would draft (`core.Models.draft_max_batch`); "auto": 4 on the CPU
            backend (measured crossover there), no limit on a GPU; None: no limit.
    Raises:
        DraftConfigError: an incompatible draft.
    """

    def __init__(self, target: LoadedModel, draft: LoadedModel | None = None,
                 spec: SpecConfig = SpecConfig(), jump_forward: bool = True,
                 draft_max_batch: int | None | Literal["auto"] = "auto") -> None:
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
        self.default_spec = spec
        self.jump_forward = jump_forward
        self.kv_store = PromptKVCache()
        self._compile_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=2, thread_name_prefix="specdec-compile")
        self.compiler = GrammarCompiler.for_hf_tokenizer(
            target.tokenizer, n_vocab=target.vocab_size,
            eos_token_ids=list(target.eos_token_ids))
        ctx = target.config.get("max_position_embeddings") or 2048
        self.context_length = int(ctx)

    # -- prompts -------------------------------------------------------------------------
    def encode(self, text: str, *, raw: bool = False) -> list[TokenId]:
        """Tokenize prompt text; special tokens written in the text are honoured.

        Args:
            raw: a prompt given as text (`/v1/completions`, `--raw-prompt`) rather than a
                rendered chat template: the tokenizer adds what its own configuration adds
                (Llama 3's `<|begin_of_text|>`, Gemma's `<bos>`; nothing for Qwen), unless
                the text already starts with that BOS. Chat templates write their BOS
                themselves, so rendered chats are encoded without it.
        """
        tok = self.target.tokenizer
        if not raw:
            return list(tok.encode(text, add_special_tokens=False))
        ids = list(tok.encode(text, add_special_tokens=True))
        bos = getattr(tok, "bos_token_id", None)
        if bos is not None and len(ids) > 1 and ids[0] == bos and ids[1] == bos:
            ids = ids[1:]  # the text carried its own BOS: keep one
        return ids

    def chat_prompt(self, messages: list[dict[str, Any]], *, constrained: bool,
                    template: str | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> list[TokenId]:
        """Render chat messages with the model's template and tokenize them."""
        text = render_chat(self.target.tokenizer, messages, constrained=constrained,
                           template=template, template_kwargs=template_kwargs)
        return self.encode(text)

    def chat_prompt_thinking(self, messages: list[dict[str, Any]], *,
                             template: str | None = None,
                             template_kwargs: dict[str, Any] | None = None,
                             budget: int | None = None) -> tuple[list[TokenId], Thinking]:
        """Render for a request that thinks before answering (`chat.render_thinking`) and
        tokenize; returns the ids and the think block to pass to `prepare`."""
        text, thinking = render_thinking(self.target.tokenizer, messages, template=template,
                                         template_kwargs=template_kwargs, budget=budget)
        return self.encode(text), thinking

    def reasoning_tokens(self, tokens: Sequence[TokenId], thinking: Thinking) -> int:
        """How many of an output's tokens belong to its think block (through the end
        marker; all of them while it has not ended)."""
        ids, special = marker_ids(self.compiler.tokenizer, thinking.close)
        if special:
            return next((i + 1 for i, t in enumerate(tokens) if t == ids[0]), len(tokens))
        lo, hi = 0, len(tokens)  # the shortest prefix holding the marker (once held, kept)
        if thinking.close not in self.decode_text(tokens):
            return hi
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if thinking.close in self.decode_text(tokens[:mid]) else \
                (mid + 1, hi)
        return lo

    def decode_text(self, tokens: Sequence[TokenId]) -> str:
        return str(self.target.tokenizer.decode(list(tokens), skip_special_tokens=False))

    # -- requests ------------------------------------------------------------------------
    def prepare(self, prompt_ids: Sequence[TokenId], *, constraint: Constraint | None = None,
                sampling: SamplingParams = SamplingParams(),
                max_tokens: int = DEFAULT_MAX_TOKENS, stop: Sequence[str] = (),
                spec: SpecConfig | None | Literal["default"] = "default",
                compile_timeout_s: float | None = None, logprobs: int | None = None,
                thinking: Thinking | None = None) -> Request:
        """Validate a request, compile its constraint and fill in its seed: the one door for
        the CLI, the server and the benchmarks.

        Args:
            spec: speculative settings; "default" uses the engine's (with no draft: for
                constrained requests when jump-forward is on), None forces plain decoding.
                Without a draft model only grammar-forced tokens are proposed.
            compile_timeout_s: most seconds the compile may take (None: no limit). A compile
                that runs over finishes in the background and is cached.
            thinking: a think block before the answer (the constraint; any text without
                one), all under one grammar; its budget forces the end marker.
        Raises:
            RequestError: empty or over-long prompt, bad max_tokens, bad token ids, empty stop.
            CompileTimeout: the constraint took longer than compile_timeout_s to compile.
            GrammarError: the constraint does not compile (compiled and cached here).
        """
        if spec == "default":
            if self.draft is not None or (constraint is not None and self.jump_forward):
                spec = self.default_spec
            else:
                spec = None
        n = len(prompt_ids)
        if n == 0:
            raise RequestError("prompt is empty: it must contain at least one token")
        if n >= self.context_length:
            raise RequestError(f"prompt has {n} tokens; the context length is "
                               f"{self.context_length}")
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise RequestError(f"max_tokens={max_tokens!r}: must be an integer >= 1")
        if n + max_tokens > self.context_length:
            raise RequestError(f"max_tokens={max_tokens} with a {n}-token prompt exceeds the "
                               f"context length {self.context_length} (at most "
                               f"{self.context_length - n})")
        bad = [t for t in prompt_ids if not (0 <= int(t) < self.target.vocab_size)]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is outside [0, "
                               f"{self.target.vocab_size})")
        bad = [t for t, _ in sampling.logit_bias if t >= self.target.vocab_size]
        if bad:
            raise RequestError(f"logit_bias token id {bad[0]} is outside [0, "
                               f"{self.target.vocab_size})")
        if any(not isinstance(s, str) or not s for s in stop):
            raise RequestError("stop strings must be non-empty strings")
        if thinking is not None and constraint is None:
            constraint = Constraint.grammar(ANY_TEXT)
        grammar = (self.compile(constraint, compile_timeout_s, thinking)
                   if constraint is not None else None)
        if not sampling.greedy and sampling.seed is None:
            sampling = dataclasses.replace(sampling, seed=secrets.randbits(63))
        if logprobs is not None and not (isinstance(logprobs, int) and 0 <= logprobs <= 20):
            raise RequestError(f"top_logprobs={logprobs!r}: must be an integer in [0, 20]")
        return Request(tuple(int(t) for t in prompt_ids), constraint, sampling, max_tokens,
                       tuple(stop), spec, grammar, logprobs, thinking)

    def compile(self, constraint: Constraint, timeout_s: float | None = None,
                thinking: Thinking | None = None) -> CompiledGrammar:
        """Compile (or fetch) a constraint, within `timeout_s` seconds when given.

        Raises:
            CompileTimeout: over the limit (the compile goes on in the background, cached).
            GrammarError: the constraint does not compile.
        """
        if timeout_s is None:
            return self.compiler.compile(constraint, thinking)
        future = self._compile_pool.submit(self.compiler.compile, constraint, thinking)
        try:
            return future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError as e:
            raise CompileTimeout(constraint.kind, f"the constraint took longer than "
                                 f"{timeout_s:g}s to compile; simplify it") from e

    def compiled(self, req: Request) -> CompiledGrammar | None:
        """The request's compiled grammar (from `prepare`, else compiled now)."""
        if req.grammar is not None or req.constraint is None:
            return req.grammar
        return self.compiler.compile(req.constraint, req.thinking)

    def matcher(self, req: Request) -> Any:
        """A fresh matcher for the request (None when unconstrained); with a thinking budget,
        wrapped so the budget forces the end marker (`reasoning.ThinkingMatcher`)."""
        grammar = self.compiled(req)
        if grammar is None:
            return None
        if req.thinking is not None and req.thinking.budget is not None:
            return ThinkingMatcher(grammar.matcher(), self.compiler.tokenizer, req.thinking,
                                   self.target.vocab_size)
        return grammar.matcher()

    def generate(self, req: Request) -> GenerationResult:
        """Run one request to completion."""
        timings = SpecStats()
        t0 = time.perf_counter()
        tokens: list[TokenId] = []
        gen = self.run(req, timings)
        try:
            while True:
                tok, _ = next(gen)
                tokens.append(tok)
        except StopIteration as stop:
            finish, text = stop.value
        total = time.perf_counter() - t0
        grammar = self.compiled(req)
        stats = GenerationStats(
            prompt_tokens=len(req.prompt_ids), completion_tokens=len(tokens),
            decode_s=max(total - timings.prefill_s, 0.0), seed=req.sampling.seed,
            k=req.spec.k if req.spec else 0, counters=timings)
        return GenerationResult(text, tuple(tokens), finish, stats,
                                grammar.warnings if grammar else ())

    def run(self, req: Request, timings: StepTimings | None = None
            ) -> Generator[tuple[TokenId, str], None, tuple[FinishReason, str]]:
        """Decode a request, applying stop strings: the streaming primitive.

        Yields (token id, text delta); the deltas hold back a possibly incomplete UTF-8
        character and a possible stop-string prefix, so the final text (in the return value)
        may extend what was yielded. Returns (finish reason, full text). Pass a `SpecStats`
        as `timings` to collect speculative counters.
        """
        steps = decode_rounds(self.models, req.prompt_ids, max_tokens=req.max_tokens,
                              eos_token_ids=self.target.eos_token_ids, params=req.sampling,
                              matcher=self.matcher(req), spec=req.spec,
                              timings=timings, kv_store=self.kv_store)
        text = self.text_stream(req)
        while True:
            try:
                tok = next(steps)
            except StopIteration as end:
                return text.close(end.value)
            delta, stopped = text.feed(tok)
            if stopped:
                steps.close()
                return text.close("stop")
            yield tok, delta

    # -- batching ------------------------------------------------------------------------
    @property
    def models(self) -> Models:
        """The models requests decode with (for `core` and the scheduler)."""
        d = self.draft
        return Models(self.target.model, self.target.vocab_size, d.model if d else None,
                      d.vocab_size if d else 0, self.draft_max_batch)

    def new_state(self, req: Request, stats: SpecStats | None = None) -> DecodeState:
        """The request's decode state (caches empty: the scheduler prefills in chunks)."""
        return new_state(self.models, req.prompt_ids, max_tokens=req.max_tokens,
                         eos_token_ids=self.target.eos_token_ids, params=req.sampling,
                         spec=req.spec, matcher=self.matcher(req),
                         stats=stats, logprobs=req.logprobs)

    def text_stream(self, req: Request) -> "TextStream":
        return TextStream(self.decode_text, req.stop,
                          req.thinking.close + SEPARATOR if req.thinking else None)


ANY_TEXT = "start: /(?s:.*)/"  # the answer of a thinking request without a constraint


class TextStream:
    """Token ids → text deltas for one request, applying its stop strings.

    With `answer_after` (a thinking request: its end marker and separator), stop strings
    apply to the answer only, never to the thinking before it.

    Incremental: each token decodes a short window (the tokens since the last stable point
    plus the few before it, as their context), so a long output costs O(n), not O(n²). Text
    is stable once the window decodes to more than its context and does not end in U+FFFD
    (a byte-fallback or byte-level tokenizer's partial character: one U+FFFD per pending
    byte). Deltas also hold back a possible stop-string prefix. The final text is the stable
    text plus the flushed remainder, so a client that joins the deltas gets exactly it.
    """

    def __init__(self, decode: Any, stop: Sequence[str], answer_after: str | None = None
                 ) -> None:
        self._decode, self._stop = decode, tuple(stop)
        self._after = answer_after  # stop strings apply only after it (a think block's end)
        self._hold = max((len(x) for x in stop), default=0)
        self.tokens: list[TokenId] = []
        self._text = ""  # stable text
        self._prefix = self._read = 0  # token offsets: window context start, stable end
        self._sent = 0  # characters of _text sent
        self._cut: str | None = None

    def _advance(self, flush: bool = False) -> None:
        context = self._decode(self.tokens[self._prefix:self._read]) if self._read else ""
        window = self._decode(self.tokens[self._prefix:])
        if flush or (len(window) > len(context) and not window.endswith("\ufffd")):
            self._text += window[len(context):]
            self._prefix, self._read = self._read, len(self.tokens)

    def _find_stop(self, since: int) -> bool:
        if not self._stop:
            return False
        start = max(0, since - self._hold + 1)
        if self._after is not None:
            at = self._text.find(self._after)
            if at < 0:
                return False
            start = max(start, at + len(self._after))
        hits = [i for i in (self._text.find(x, start) for x in self._stop) if i >= 0]
        if hits:
            self._cut = self._text[:min(hits)]
        return bool(hits)

    def feed(self, tok: TokenId) -> tuple[str, bool]:
        """Add a token; returns (text delta, whether a stop string ended the output)."""
        self.tokens.append(tok)
        before = len(self._text)
        self._advance()
        if self._find_stop(before):
            return "", True
        safe = len(self._text) - (self._hold - 1 if self._hold else 0)
        delta = self._text[self._sent:max(safe, self._sent)]
        self._sent += len(delta)
        return delta, False

    def close(self, finish: FinishReason) -> tuple[FinishReason, str]:
        """The finish reason and the full text (a stop string's cut wins)."""
        if self._cut is None:
            before = len(self._text)
            self._advance(flush=True)
            self._find_stop(before)
        if self._cut is not None:
            return "stop", self._cut
        return finish, self._text
