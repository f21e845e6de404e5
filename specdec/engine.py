"""The library surface: a loaded target + its grammar compiler, generating text for requests.

`Engine.generate` wraps the pure `decode_steps` generator with tokenization, stop strings,
request validation and statistics. It holds no HTTP; `server/` adapts it.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from .chat import render_chat
from .decode import FinishReason, StepTimings, TokenId, decode_steps
from .grammar import CompiledGrammar, Constraint, GrammarCompiler
from .models import LoadedModel
from .sampling import SamplingParams

DEFAULT_MAX_TOKENS = 256


class RequestError(ValueError):
    """A request parameter outside its valid range; the message names value and range."""


@dataclass(frozen=True)
class GenerationStats:
    """What one request cost. Times in seconds; `mask_s` is host llguidance fill time."""

    prompt_tokens: int
    completion_tokens: int
    prefill_s: float
    decode_s: float
    mask_s: float
    wait_s: float
    steps: int
    seed: int | None

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.decode_s if self.decode_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["tokens_per_s"] = round(self.tokens_per_s, 3)
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
    """

    prompt_ids: tuple[TokenId, ...]
    constraint: Constraint | None = None
    sampling: SamplingParams = SamplingParams()
    max_tokens: int = DEFAULT_MAX_TOKENS
    stop: tuple[str, ...] = ()


class Engine:
    """A target model with its grammar compiler.

    Args:
        target: the loaded target model.
    """

    def __init__(self, target: LoadedModel) -> None:
        self.target = target
        self.compiler = GrammarCompiler.for_hf_tokenizer(
            target.tokenizer, n_vocab=target.vocab_size,
            eos_token_ids=list(target.eos_token_ids))
        ctx = target.config.get("max_position_embeddings") or 2048
        self.context_length = int(ctx)

    # -- prompts -------------------------------------------------------------------------
    def encode(self, text: str) -> list[TokenId]:
        """Tokenize prompt text (special tokens in the text are honoured, no BOS added)."""
        return list(self.target.tokenizer.encode(text, add_special_tokens=False))

    def chat_prompt(self, messages: list[dict[str, Any]], *, constrained: bool,
                    template: str | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> list[TokenId]:
        """Render chat messages with the model's template and tokenize them."""
        text = render_chat(self.target.tokenizer, messages, constrained=constrained,
                           template=template, template_kwargs=template_kwargs)
        return self.encode(text)

    def decode_text(self, tokens: Sequence[TokenId]) -> str:
        return str(self.target.tokenizer.decode(list(tokens), skip_special_tokens=False))

    # -- requests ------------------------------------------------------------------------
    def prepare(self, prompt_ids: Sequence[TokenId], *, constraint: Constraint | None = None,
                sampling: SamplingParams = SamplingParams(),
                max_tokens: int = DEFAULT_MAX_TOKENS, stop: Sequence[str] = ()) -> Request:
        """Validate a request and fill in its seed.

        Raises:
            RequestError: empty or over-long prompt, bad max_tokens, bad token ids, empty stop.
            GrammarError: the constraint does not compile (compiled and cached here).
        """
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
        if any(not isinstance(s, str) or not s for s in stop):
            raise RequestError("stop strings must be non-empty strings")
        if constraint is not None:
            self.compiler.compile(constraint)
        if not sampling.greedy and sampling.seed is None:
            sampling = SamplingParams(sampling.temperature, sampling.top_p, sampling.top_k,
                                      secrets.randbits(63))
        return Request(tuple(int(t) for t in prompt_ids), constraint, sampling, max_tokens,
                       tuple(stop))

    def compiled(self, req: Request) -> CompiledGrammar | None:
        return None if req.constraint is None else self.compiler.compile(req.constraint)

    def stream(self, req: Request, timings: StepTimings | None = None
               ) -> Iterator[tuple[TokenId, str]]:
        """Yield (token, text delta) pairs; see `generate` for the finished result.

        Stop strings are cut here; the caller reads `self.last_finish` for why it ended.
        """
        result = self._run(req, timings, streaming=True)
        yield from result  # type: ignore[misc]

    def generate(self, req: Request) -> GenerationResult:
        """Run one request to completion."""
        timings = StepTimings()
        t0 = time.perf_counter()
        tokens: list[TokenId] = []
        gen = self._run(req, timings, streaming=False)
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
            prefill_s=timings.prefill_s, decode_s=max(total - timings.prefill_s, 0.0),
            mask_s=timings.mask_s, wait_s=timings.wait_s, steps=timings.steps,
            seed=req.sampling.seed)
        return GenerationResult(text, tuple(tokens), finish, stats,
                                grammar.warnings if grammar else ())

    def _run(self, req: Request, timings: StepTimings | None, streaming: bool):
        """Drive decode_steps, applying stop strings. Yields (token, delta); returns
        (finish_reason, full text)."""
        grammar = self.compiled(req)
        steps = decode_steps(self.target.model, req.prompt_ids,
                             vocab_size=self.target.vocab_size,
                             eos_token_ids=self.target.eos_token_ids, max_tokens=req.max_tokens,
                             matcher=grammar.matcher() if grammar else None,
                             params=req.sampling, timings=timings)
        tokens: list[TokenId] = []
        emitted = ""
        hold = max((len(s) for s in req.stop), default=0)
        while True:
            try:
                tok = next(steps)
            except StopIteration as end:
                text = self.decode_text(tokens)
                return end.value, text
            tokens.append(tok)
            text = self.decode_text(tokens)
            if req.stop:
                cut = min((i for i in (text.find(s) for s in req.stop) if i >= 0), default=-1)
                if cut >= 0:
                    steps.close()
                    return "stop", text[:cut]
            # Hold back a possibly incomplete UTF-8 char and a possible stop-string prefix.
            safe = len(text) - (hold - 1 if hold else 0)
            if text.endswith("\ufffd"):
                safe = min(safe, len(text) - 1)
            delta = text[len(emitted):max(safe, len(emitted))]
            emitted += delta
            yield tok, delta
