"""Preparation: what turns a request into one the scheduler can run, for one target model.

`Preparer.prepare` validates a request (`request.GenerateRequest`: its fields against their
ranges and the model's context and vocabulary), renders its conversation through the chat
template (tools in the model's own format, a think block where asked), compiles one grammar
for its whole output (`grammar.GrammarCompiler`: the reasoning block, text or calls, the
constraint) and fills in the engine's defaults and a seed: the `Request` the
scheduler decodes. It holds no model weights and no scheduler; the Engine owns one.

Error contract: bad input raises a `RequestError` (`param` naming the field), a template
that cannot render `ChatTemplateError`, a constraint that does not compile `GrammarError`
(`CompileTimeout` past the compile limit).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import reprlib
import secrets
import time
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from .chat import NO_THINK_KWARGS, render_chat, render_thinking
from .config import DEFAULT_MAX_TOKENS, EngineDefaults, SpecConfig
from .errors import (ChatTemplateError, CompileTimeout, RequestError, SpecdecError,
                     TemplateThinksError)
from .grammar import CompiledGrammar, GrammarCompiler, schema_dict, to_grammar
from .models import LoadedModel
from .reasoning import Thinking, ThinkingCursor, marker_ids
from .budget import Closing
from .request import (UNGUARANTEED, Constraint, GenerateRequest, Message, NamedTool,
                      SamplingParams, Tool, kv_positions)
from .tools import (GENERIC, CallParser, ToolFormat, ToolSpec, detect, generic_messages,
                    json_calls_schema, tools_grammar)
from .types import GrammarState, TokenId


@dataclass(frozen=True)
class Request:
    """One prepared request, as the scheduler runs it (`Engine.prepare` builds it).

    Attributes:
        prompt_ids: prompt token ids.
        constraint: what the output must match, or None.
        sampling: how tokens are picked (seed filled in when sampling).
        max_tokens: most tokens to generate.
        stop: strings that end the output (not included in it).
        spec: speculative settings, or None for plain decoding.
        grammar: the constraint compiled once by `Engine.prepare` (None when unconstrained).
        logprobs: None, or report each token's logprob and its top `logprobs` (0..20)
            alternatives (`events.TokenLogprob`).
        token_sources: None, or report each token's source and allowed-set size
            (`events.TokenSource`), and its logprob with the top `token_sources` (0..20).
        compile_s: seconds its constraint took to compile (near 0: the cache had it).
        thinking: think before the constrained answer (`reasoning.Thinking`), or None.
        tools: the tools the output may call (its grammar holds them).
        calls: how the output's calls are read back (None: the output is text).
        closing: the budget rule's closing order and the constraint's minimum budget
            (`budget.Closing`); None: the output is not steered to close in time.
        unguaranteed: why a constrained output is served without the budget rule (no
            closing was found within its bound), or None; reported as a warning
            (`budget_unguaranteed`).
        prefill_only: a history prefill (`Engine.keep_history`): the prompt but its last
            token is prefilled into the prompt store, target and draft, and the request ends
            there, generating nothing.
        supersedes: a history prefill's: the stored states it replaces once its own is
            stored (the finished answer's, `core.keep_answer`): ("target" or "draft", key).
        keep: keep its prompt and answer in the prompt store when it finishes
            (`core.keep_answer`) for a next turn; a request prepared from a
            `GenerateRequest` keeps them only where a next turn is likely
            (`GenerateRequest.next_turn_likely`), one prepared from token ids always.
        scope: the prompt store and earlier answers it may reuse and adds to
            (`GenerateRequest.cache_scope`).
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
    tools: tuple[Tool, ...] = ()
    token_sources: int | None = None
    compile_s: float = field(default=0.0, compare=False)  # compiling its constraint (or
    # finding it in the compiler's cache)
    calls: CallParser | None = field(default=None, repr=False, compare=False)
    closing: Closing | None = field(default=None, repr=False, compare=False)
    unguaranteed: str | None = None
    prefill_only: bool = False
    supersedes: tuple[tuple[str, tuple[TokenId, ...]], ...] = field(default=(), repr=False,
                                                                    compare=False)
    keep: bool = field(default=True, compare=False)
    scope: str = field(default="", compare=False)

    @property
    def warnings(self) -> tuple[str, ...]:
        """What the constraint does not enforce: the grammar's warnings, and
        `budget_unguaranteed: <why>` where the budget rule is off."""
        own = self.grammar.warnings if self.grammar is not None else ()
        return own + ((f"{UNGUARANTEED}: {self.unguaranteed}",) if self.unguaranteed else ())

    @property
    def kv_positions(self) -> int:
        """The most KV positions it can hold (`request.kv_positions`)."""
        return kv_positions(len(self.prompt_ids), self.max_tokens)


class Preparer:
    """Validates, renders and compiles requests for one target (`prepare`).

    Args:
        target: the loaded target (its tokenizer, chat template, vocabulary, context).
        compiler: its grammar compiler.
        defaults: what requests get for the fields they leave out.
        context_length: the most positions a prompt and its output may take.
        max_kv_tokens: the most KV positions one request may hold (None: no bound).
        spec: requests' speculative settings when they leave them to the engine.
        speculates: a draft model is there (requests speculate by default).
        jump_forward: with no draft, constrained requests still propose forced tokens.
    """

    def __init__(self, target: LoadedModel, compiler: GrammarCompiler,
                 defaults: EngineDefaults, context_length: int, max_kv_tokens: int | None,
                 spec: SpecConfig, speculates: bool, jump_forward: bool) -> None:
        self.target, self.compiler, self.defaults = target, compiler, defaults
        self.context_length, self.max_kv_tokens = context_length, max_kv_tokens
        self.default_spec, self.speculates, self.jump_forward = spec, speculates, jump_forward
        self._compile_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=2, thread_name_prefix="specdec-compile")
        self._lock = threading.Lock()
        self._formats: dict[str, ToolFormat] = {}

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
                    template_kwargs: dict[str, Any] | None = None,
                    answer_header: bool = True) -> list[TokenId]:
        """Render chat messages with the model's template and tokenize them
        (`chat.render_chat`)."""
        text = render_chat(self.target.tokenizer, messages, constrained=constrained,
                           template=template or self.defaults.chat_template,
                           template_kwargs=template_kwargs, answer_header=answer_header)
        return self.encode(text)

    def chat_prompt_thinking(self, messages: list[dict[str, Any]], *,
                             template: str | None = None,
                             template_kwargs: dict[str, Any] | None = None,
                             budget: int | None = None, optional: bool = False
                             ) -> tuple[list[TokenId], Thinking]:
        """Render for a request that thinks before answering (`chat.render_thinking`) and
        tokenize; returns the ids and the think block to pass to `prepare`. `optional`: the
        output may answer without reasoning where it opens the block itself."""
        text, thinking = render_thinking(self.target.tokenizer, messages,
                                         template=template or self.defaults.chat_template,
                                         template_kwargs=template_kwargs, budget=budget,
                                         protocol=self.defaults.reasoning_format,
                                         optional=optional)
        return self.encode(text), thinking

    def reasoning_tokens(self, tokens: Sequence[TokenId], thinking: Thinking) -> int:
        """How many of an output's tokens belong to its think block (through the end
        marker; all of them while it has not ended; none on the branch that answers at
        once)."""
        if thinking.open is not None and thinking.direct is not None:
            text = self.decode_text(tokens)
            if not text.startswith(thinking.open) and not thinking.open.startswith(text):
                return 0
        ids, special = marker_ids(self.compiler.markup, thinking.close)
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
    def prepare(self, request: GenerateRequest | Sequence[TokenId], **fields: Any) -> Request:
        """Validate a request, render it, compile its constraint and fill in its defaults
        and seed (`Engine.prepare`, for the CLI, the server and the benchmarks alike).

        `request` is a `GenerateRequest`; or prompt token ids with the low-level fields as
        keywords (`constraint`, `sampling`, `max_tokens`, `stop`, `spec` (a `SpecConfig`,
        None or "default"), `compile_timeout_s`, `logprobs`, `token_sources`, `thinking` (a
        `reasoning.Thinking`)), for callers that render prompts themselves.

        Raises:
            RequestError (a `SpecdecError`, `param` naming the field): empty or over-long
                prompt, bad max_tokens, token ids or stops; a chat template that fails
                (`ChatTemplateError`), thinking it cannot do (`ThinkingUnsupportedError`);
                tool settings not implemented.
            CompileTimeout: the constraint took longer than the compile limit.
            GrammarError: the constraint does not compile (compiled and cached here).
        """
        if isinstance(request, GenerateRequest):
            if fields:
                raise TypeError("give a GenerateRequest or prompt ids with fields, not both")
            return self._prepare_request(request)
        return self._prepare_ids(request, **fields)

    def _prepare_request(self, r: GenerateRequest) -> Request:
        tools = self._tools(r)
        if (r.messages == ()) == (r.prompt is None):
            raise RequestError("give either messages or a prompt", param="messages")
        if tools and r.prompt is not None:
            raise RequestError("tools need chat messages, not a raw prompt", param="tools")
        if r.prompt is not None:
            if r.thinking:
                raise RequestError("thinking needs chat messages, not a raw prompt",
                                   param="thinking")
            ids = (self.encode(r.prompt, raw=True) if isinstance(r.prompt, str)
                   else list(r.prompt))
            thinking, fmt = None, None
        else:
            ids, thinking, fmt = self._render(r, tools)
        constraint = r.constraint
        calls = None
        if tools:
            assert fmt is not None
            constraint, calls = self._tools_constraint(r, tools, fmt)
            if thinking is not None:
                thinking = _thinking_before_calls(thinking, fmt)
        max_tokens = r.max_tokens
        if max_tokens is None:
            room = self.context_length - len(ids)
            if self.max_kv_tokens is not None:
                room = min(room, self.max_kv_tokens - kv_positions(len(ids), 0))
            max_tokens = max(1, min(self.defaults.max_tokens, room))
        if thinking is not None:
            budget = r.thinking_budget
            if budget is None:
                budget = min(self.defaults.max_thinking_tokens, max_tokens // 2)
            thinking = dataclasses.replace(thinking, budget=budget)
        spec: SpecConfig | None | str = "default"
        if r.spec is None:
            spec = None
        elif isinstance(r.spec, Mapping):
            try:
                spec = dataclasses.replace(self.default_spec, **r.spec)
            except TypeError as e:
                raise RequestError(f"unknown speculative setting: {e}", param="spec") from e
        req = self._prepare_ids(ids, constraint=constraint, sampling=r.sampling,
                                max_tokens=max_tokens, stop=r.stop, spec=spec,
                                compile_timeout_s=self.defaults.compile_timeout_s,
                                logprobs=r.logprobs, token_sources=r.token_sources,
                                thinking=thinking,
                                close_at_budget=r.close_at_budget,
                                closing_hints=self._closing_hints(fmt) if tools else ())
        return dataclasses.replace(req, tools=tools, calls=calls, keep=r.next_turn_likely,
                                   scope=r.cache_scope)

    def history_ids(self, r: GenerateRequest, answer: Message) -> list[TokenId] | None:
        """The prompt ids a conversation's next request starts with once `answer` (this
        request's, as its API gives it back: text, reasoning, calls) is in its history.

        The longest common prefix of the request rendered with the answer and either of two
        next turns that differ only in their text (a result for each call, else a user
        turn): what the template writes for the answer (reasoning it drops, calls it
        re-serializes) and the next turn's opening are in it, the next turn's own text is
        not. None: a raw prompt, or a history the template refuses."""
        if r.prompt is not None or not r.messages:
            return None
        tools = self._tools(r)

        def rendered(text: str) -> list[TokenId]:
            nxt = tuple(Message("tool", text, tool_call_id=c.id, name=c.name)
                        for c in answer.tool_calls) or (Message("user", text),)
            return self._render(dataclasses.replace(r, messages=(*r.messages, answer, *nxt)),
                                tools)[0]

        try:
            a, b = rendered("0"), rendered("1")
        except SpecdecError:
            return None
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return a[:n]

    def history_request(self, r: GenerateRequest, answer: Message,
                        supersedes: tuple[tuple[str, tuple[TokenId, ...]], ...] = ()
                        ) -> Request | None:
        """A history prefill (`Request.prefill_only`) of `history_ids(r, answer)`, with the
        draft where requests speculate; None where there is no history to prefill or it
        does not fit the context or the KV bound. Its prompt is the history and a
        placeholder last token (a prompt's last token is the first one decoding feeds,
        never prefilled)."""
        ids = self.history_ids(r, answer)
        if not ids:
            return None
        n = len(ids) + 1
        if n + 1 > self.context_length or (self.max_kv_tokens is not None
                                           and kv_positions(n, 1) > self.max_kv_tokens):
            return None
        spec = (dataclasses.replace(self.default_spec, lookup=False, suffix=False)
                if self.speculates and self.default_spec is not None else None)
        return Request((*ids, ids[-1]), max_tokens=1, spec=spec, prefill_only=True,
                       supersedes=supersedes, scope=r.cache_scope)

    def _render(self, r: GenerateRequest, tools: tuple[Tool, ...]
                ) -> tuple[list[TokenId], Thinking | None, ToolFormat | None]:
        """A chat request's prompt ids, its reasoning protocol (None: it does not think)
        and its tool format (None: no tools and no calls in its history)."""
        thinking = None
        fmt: ToolFormat | None = None
        history = any(m.tool_calls or m.role == "tool" for m in r.messages)
        if tools or history:
            fmt = self.tool_format()
        msgs = [template_message(m, i, fmt) for i, m in enumerate(r.messages)]
        kwargs = dict(r.template_kwargs)
        if r.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", r.reasoning_effort)
        if r.thinking and r.thinking_budget is not None:  # Seed-OSS reads it
            kwargs.setdefault("thinking_budget", r.thinking_budget)
        schemas = [tool_schema(t) for t in tools]
        turns = [msgs]
        if fmt is not None and fmt.source == "generic":
            turns = [generic_messages(msgs, schemas)]
            if schemas and msgs[0]["role"] != "system":  # a template may refuse one
                turns.append(generic_messages(msgs, schemas, system=False))
        elif tools:  # the template shows the model its tools
            kwargs["tools"] = schemas
        constrained = bool(tools) or r.constraint is not None
        for n, msgs in enumerate(turns):
            try:
                if r.thinking:
                    ids, thinking = self.chat_prompt_thinking(msgs, template_kwargs=kwargs)
                else:
                    try:
                        ids = self.chat_prompt(msgs, constrained=constrained,
                                               template_kwargs=kwargs,
                                               answer_header=not tools)
                    except TemplateThinksError:  # it always thinks: think, then answer
                        ids, thinking = self.chat_prompt_thinking(
                            msgs, template_kwargs=kwargs)
                break
            except ChatTemplateError:
                if n == len(turns) - 1:
                    raise
        return ids, thinking, fmt

    def _tools(self, r: GenerateRequest) -> tuple[Tool, ...]:
        """The tools the output may call (none with tool_choice "none")."""
        choice = r.tool_choice
        if not r.tools:
            if isinstance(choice, NamedTool) or choice == "required":
                raise RequestError("tool_choice needs a non-empty list of tools",
                                   param="tools")
            return ()
        names = [t.name for t in r.tools]
        if len(set(names)) != len(names):
            raise RequestError("tool names must be unique", param="tools")
        bad = next((n for n in names if not n or any(c in n for c in "\"\\\n<>")), None)
        if bad is not None:
            raise RequestError(f"tool name {bad!r}: use letters, digits, '_', '-' and '.'",
                               param="tools")
        for t in r.tools:
            p = t.parameters
            props, req = p.get("properties", {}), p.get("required", [])
            if not isinstance(props, Mapping) or not isinstance(req, list) or \
                    not all(isinstance(x, str) for x in req):
                raise RequestError(f"tool {t.name!r}: parameters need 'properties' as an "
                                   "object and 'required' as a list of names",
                                   param="tools")
        if isinstance(choice, NamedTool) and choice.name not in names:
            raise RequestError(f"tool_choice names {choice.name!r}, which is not in tools",
                               param="tool_choice")
        return () if choice == "none" else r.tools

    def _tools_constraint(self, r: GenerateRequest, tools: tuple[Tool, ...], fmt: ToolFormat
                          ) -> tuple[Constraint, CallParser]:
        """The answer's grammar: text (or the response format) or calls of `tools` in the
        model's format (`tools.tools_grammar`), and the parser that reads the calls back."""
        choice = r.tool_choice
        if isinstance(choice, NamedTool):
            tools = tuple(t for t in tools if t.name == choice.name)
        text = choice == "auto"
        if not text and r.constraint is not None:
            raise RequestError("a forced tool call and an output format cannot both "
                               "constrain the output", param="tool_choice")
        specs = [ToolSpec(t.name, dict(t.parameters), t.strict) for t in tools]
        parallel = r.parallel_tool_calls and not isinstance(choice, NamedTool)
        strings = {t.name: frozenset(k for k, v in props.items()
                                     if isinstance(v, Mapping) and v.get("type") == "string")
                   for t in tools
                   if isinstance(props := t.parameters.get("properties"), Mapping) and props}
        parser = CallParser(fmt, strings, tuple(t.name for t in tools))
        c = r.constraint
        if c is not None and c.kind in ("json_schema", "json_object"):
            calls = json_calls_schema(fmt, specs, parallel)
            if calls is not None:  # a JSON answer or JSON calls: one schema holds both
                answer = {"type": "object"} if c.kind == "json_object" else \
                    schema_dict(c.value)
                lenient = c.lenient or not all(t.strict for t in tools)
                answer = dict(answer) if isinstance(answer, Mapping) else answer
                both: dict[str, Any] = {"anyOf": [answer, calls]}
                for key in ("$defs", "definitions"):  # refs point from the root
                    if isinstance(answer, dict) and key in answer:
                        both[key] = answer.pop(key)
                return dataclasses.replace(c, kind="json_schema", lenient=lenient,
                                           value=both), parser
        answer = to_grammar(c) if c is not None else None
        grammar = tools_grammar(fmt, specs, text=text, answer=answer, parallel=parallel,
                                markup=self.compiler.markup)
        return Constraint.tools(grammar), parser

    def tool_format(self, template: str | None = None) -> ToolFormat:
        """The tool-call format of the chat template (`tools.detect`; cached)."""
        source = template or self.defaults.chat_template or getattr(
            self.target.tokenizer, "chat_template", None) or ""
        key = source if isinstance(source, str) else str(source)
        with self._lock:
            hit = self._formats.get(key)
        if hit is not None:
            return hit
        if not key:
            fmt = GENERIC
        else:
            tok = self.target.tokenizer

            def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                       gen: bool) -> str:
                return str(tok.apply_chat_template(
                    messages, tools=tools, tokenize=False, add_generation_prompt=gen,
                    chat_template=template or self.defaults.chat_template,
                    **NO_THINK_KWARGS))

            ends = [self.decode_text([t]) for t in self.target.eos_token_ids]
            fmt = detect(render, ends)
        with self._lock:
            self._formats[key] = fmt
        return fmt

    def _prepare_ids(self, prompt_ids: Sequence[TokenId], *,
                     constraint: Constraint | None = None,
                     sampling: SamplingParams = SamplingParams(),
                     max_tokens: int = DEFAULT_MAX_TOKENS, stop: Sequence[str] = (),
                     spec: SpecConfig | None | Literal["default"] = "default",
                     compile_timeout_s: float | None = None, logprobs: int | None = None,
                     token_sources: int | None = None,
                     thinking: Thinking | None = None, close_at_budget: bool = True,
                     closing_hints: tuple[tuple[TokenId, ...], ...] = ()) -> Request:
        if spec == "default":
            if self.speculates or (constraint is not None and self.jump_forward):
                spec = self.default_spec
            else:
                spec = None
        n = len(prompt_ids)
        if n == 0:
            raise RequestError("prompt is empty: it must contain at least one token",
                               param="messages")
        if n >= self.context_length:
            raise RequestError(f"prompt has {n} tokens; the context length is "
                               f"{self.context_length}", param="messages",
                               code="context_length_exceeded")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise RequestError(f"max_tokens={max_tokens!r}: must be an integer >= 1",
                               param="max_tokens")
        if n + max_tokens > self.context_length:
            raise RequestError(f"max_tokens={max_tokens} with a {n}-token prompt exceeds the "
                               f"context length {self.context_length} (at most "
                               f"{self.context_length - n})", param="max_tokens",
                               code="context_length_exceeded")
        need = kv_positions(n, max_tokens)
        if self.max_kv_tokens is not None and need > self.max_kv_tokens:
            raise RequestError(f"a {n}-token prompt with max_tokens={max_tokens} needs {need} "
                               f"KV positions; this server holds at most {self.max_kv_tokens} "
                               "(--max-kv-tokens)", param="max_tokens",
                               code="kv_budget_exceeded")
        bad = [t for t in prompt_ids if not (0 <= int(t) < self.target.vocab_size)]
        if bad:
            raise RequestError(f"prompt token id {reprlib.repr(int(bad[0]))} is outside [0, "
                               f"{self.target.vocab_size})", param="messages")
        bad = [t for t, _ in sampling.logit_bias if t >= self.target.vocab_size]
        if bad:
            raise RequestError(f"logit_bias token id {reprlib.repr(int(bad[0]))} is outside [0, "
                               f"{self.target.vocab_size})", param="sampling.logit_bias")
        if any(not isinstance(s, str) or not s for s in stop):
            raise RequestError("stop strings must be non-empty strings", param="stop")
        _top_count(logprobs, "logprobs")
        _top_count(token_sources, "token_sources")
        if thinking is not None and constraint is None:
            constraint = Constraint.grammar(ANY_TEXT)
        t0 = time.perf_counter()
        grammar = (self.compile(constraint, compile_timeout_s, thinking)
                   if constraint is not None else None)
        compile_s = time.perf_counter() - t0
        if not sampling.greedy and sampling.seed is None:
            sampling = dataclasses.replace(sampling, seed=secrets.randbits(63))
        req = Request(tuple(int(t) for t in prompt_ids), constraint, sampling, max_tokens,
                      tuple(stop), spec, grammar, logprobs, thinking,
                      token_sources=token_sources, compile_s=compile_s)
        if close_at_budget and grammar is not None:
            return self._closing(req, closing_hints)
        return req

    def _closing_hints(self, fmt: ToolFormat | None) -> tuple[tuple[TokenId, ...], ...]:
        """Where a tool format writes string arguments raw (Qwen3-Coder's
        `<parameter=k>\nv\n</parameter>`), the tokens of the text that ends a value (its
        special tokens by id: GLM's `</arg_value>`): the budget's closing walk ends a raw
        value with them (`budget`)."""
        if fmt is None or fmt.xml is None or not fmt.xml.value_end:
            return ()
        return (tuple(self.compiler.markup.ids(fmt.xml.value_end)),)

    def _closing(self, req: Request, hints: tuple[tuple[TokenId, ...], ...] = ()) -> Request:
        """`req` with its budget rule (`budget`): its constraint's minimum budget, a 400
        naming max_tokens when the budget is below it. A constraint whose closing is not
        found within its bound is not steered, and the request says why (`unguaranteed`)."""
        assert req.grammar is not None
        minimum, why = self.compiler.minimum(req.grammar, self.matcher(req),
                                             self.target.vocab_size, hints)
        if minimum is None:
            return dataclasses.replace(req, unguaranteed=why)
        if req.max_tokens < minimum:
            raise RequestError(f"the token budget ({req.max_tokens}) is below what the "
                               f"constraint needs: its shortest complete answer takes "
                               f"{minimum} tokens; give at least {minimum}", param="max_tokens",
                               code="max_tokens_too_small")
        order = self.compiler.closing_order(self.target.vocab_size)
        return dataclasses.replace(req, closing=Closing(order, minimum, hints))

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

    def matcher(self, req: Request) -> GrammarState | None:
        """A fresh state of the request's grammar (None when unconstrained); one that thinks
        first has a thinking gate, so a thinking budget (or the budget rule's walk) forces
        the end marker (`reasoning.ThinkingCursor`)."""
        grammar = self.compiled(req)
        if grammar is None:
            return None
        if req.thinking is not None:  # (without a budget: the budget rule's walk)
            return ThinkingCursor.of(grammar.state(), self.compiler.markup,  # type: ignore
                                     req.thinking, self.target.vocab_size)
        return grammar.state()


def _thinking_before_calls(thinking: Thinking, fmt: ToolFormat) -> Thinking:
    """The reasoning protocol in front of the tool grammar. Where the answer's header is the
    text turn's own opening (Harmony: after the analysis, `<|start|>assistant` then the
    final channel for text or a commentary channel for a call), the header stops before it
    and the tool grammar chooses the channel."""
    lead = fmt.text_open
    if not lead or not thinking.header.endswith(lead) or not (
            thinking.direct is None or thinking.direct.endswith(lead)):
        return thinking
    direct = None if thinking.direct is None else thinking.direct[:-len(lead)]
    return dataclasses.replace(thinking, header=thinking.header[:-len(lead)], direct=direct)


ANY_TEXT = "start: /(?s:.*)/"  # the answer of a thinking request without a constraint


def template_message(m: Message, i: int, fmt: ToolFormat | None = None) -> dict[str, Any]:
    """A conversation turn as chat templates take it (OpenAI's message shape): an
    assistant's reasoning (where the client sent it back) and its calls with their arguments
    as the format's template reads them (the JSON text as sent, or parsed), a tool result
    with the id of the call it answers.

    Raises:
        RequestError (param `messages[i]`): a call whose arguments are not a JSON object.
    """
    if m.role == "tool":
        out: dict[str, Any] = {"role": "tool", "content": m.content,
                               "tool_call_id": m.tool_call_id}
        if m.name:
            out["name"] = m.name
        return out
    msg: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.role == "assistant" and m.reasoning:  # under each name templates read it by
        msg.update(reasoning_content=m.reasoning, thinking=m.reasoning, reasoning=m.reasoning)
    if m.tool_calls:
        calls = []
        for c in m.tool_calls:
            try:
                args = json.loads(c.arguments) if c.arguments.strip() else {}
            except (ValueError, RecursionError) as e:
                raise RequestError(f"the arguments of call {c.id!r} are not JSON: {e}",
                                   param=f"messages[{i}]", code="invalid_tool_call") from e
            if not isinstance(args, dict):
                raise RequestError(f"the arguments of call {c.id!r} must be a JSON object",
                                   param=f"messages[{i}]", code="invalid_tool_call")
            text = c.arguments if c.arguments.strip() else "{}"
            use_text = fmt is not None and fmt.arguments == "string"
            calls.append({"id": c.id, "type": "function", "function": {
                "name": c.name, "arguments": text if use_text else args}})
        msg["tool_calls"] = calls
        if not m.content:
            msg["content"] = None if fmt is not None and fmt.source != "generic" else ""
    return msg


def tool_schema(t: Tool) -> dict[str, Any]:
    """A tool as chat templates take it (OpenAI's function-tool shape)."""
    fn: dict[str, Any] = {"name": t.name, "parameters": dict(t.parameters)}
    if t.description:
        fn["description"] = t.description
    return {"type": "function", "function": fn}


def _top_count(n: int | None, param: str) -> int | None:
    """A count of top alternatives per token (`logprobs`, `token_sources`): None or 0..20.

    Raises:
        RequestError: anything else.
    """
    if n is not None and not (isinstance(n, int) and 0 <= n <= 20) or (
            param == "token_sources" and isinstance(n, bool)):
        raise RequestError(f"{'top_logprobs' if param == 'logprobs' else param}={n!r}: must be "
                           "an integer in [0, 20]", param=param)
    return n
