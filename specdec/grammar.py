"""Request constraints → llguidance grammars, compiled once and handed out as matchers.

Two lifetimes, two types (as in vLLM's structured output): a `GrammarCompiler` per tokenizer
(owns the `LLTokenizer`, caches compiled grammars), and one `LLMatcher` per request (a
`deep_copy` of the cached template, ~2 µs).

Error contract: every invalid or unsupported constraint raises `GrammarError` with
llguidance's own message; nothing here returns a half-valid grammar.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import json
import re
import sys
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, get_args

import llguidance
import llguidance.hf
import llguidance.numpy as llnp
from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper
from tokenizers import Tokenizer

from .budget import MINIMUM_S, ClosingOrder, Spend, need, order_of, spending
from .config import GRAMMAR_CACHE_MB
from .errors import GrammarError, Overspent, RequestError  # noqa: F401
from .reasoning import Markup, Thinking, think_grammar
from .request import Constraint, ConstraintKind
from .schema_rewrite import rewrite
from .types import GrammarState
from .unique import MARK, UniqueRule, Vocab, mark
from .unique import state as unique_state

CONSTRAINT_KINDS: tuple[str, ...] = get_args(ConstraintKind)

# Compact JSON: no free whitespace, so a model cannot spin on spaces or newlines until
# max_tokens; ", " and ": " are the separators small models are trained on. A schema may
# override these through llguidance's own `x-guidance` key.
JSON_DEFAULTS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


# llguidance's parser limits, set here rather than left implicit (its defaults, measured
# enough for every schema in tests/corpus): they bound the work of one Earley step and one
# mask; the mask time a request may spend is bounded separately (`config.MaskBudget`).
PARSER_LIMITS = dict(max_items_in_row=2000, step_max_items=50_000, step_lexer_fuel=200_000,
                     initial_lexer_fuel=1_000_000, max_lexer_states=250_000,
                     max_grammar_size=500_000)


# llguidance's lenient warnings name the keyword they did not enforce (`Unimplemented keys:
# ["not"]`, `oneOf not fully supported, ...`), except an unknown format's, which names the
# format alone.
_UNKNOWN_FORMAT = "Unknown format: "


def _keyword_warning(message: str) -> str:
    """A compile warning that names the keyword it is about."""
    if message.startswith(_UNKNOWN_FORMAT):
        return f'{message} (keyword "format" not enforced)'
    return message


def schema_dict(value: Any) -> dict[str, Any]:
    """A JSON schema given as JSON text or a dict, as a dict (`true` as {}).

    Raises:
        GrammarError: not JSON, `false`, or not an object.
    """
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise GrammarError("json_schema", f"schema is not valid JSON: {e}") from e
    if isinstance(value, bool):
        # JSON Schema allows `true`/`false` schemas; only `true` can produce output.
        if value:
            return {}
        raise GrammarError("json_schema", "schema `false` matches nothing")
    if not isinstance(value, dict):
        raise GrammarError("json_schema",
                           f"schema must be a JSON object, got {type(value).__name__}")
    return value


def to_grammar(c: Constraint) -> str:
    """The llguidance grammar text for a constraint (not yet checked against a tokenizer).

    Raises:
        GrammarError: malformed input that can be detected without compiling.
    """
    if c.kind == "tools":
        return str(c.value)
    if c.kind not in CONSTRAINT_KINDS:
        raise GrammarError(str(c.kind), f"unknown constraint kind; expected one of "
                                        f"{', '.join(CONSTRAINT_KINDS)}")
    if c.kind in ("json_schema", "json_object"):
        if c.kind == "json_object":
            if c.value not in (None, True, {}, {"type": "object"}):
                raise GrammarError("json_object", "json_object takes no schema "
                                   f"(got {c.value!r}); use json_schema for a schema")
            return _json_grammar(c.kind, '{"type": "object"}', c.lenient, c.json_options)
        value = c.value
        if not isinstance(value, str):
            try:
                value = json.dumps(value)
            except (TypeError, ValueError) as e:
                raise GrammarError("json_schema", f"schema is not JSON: {e}") from e
        try:
            cacheable = hash(c.json_options) is not None and len(value) <= _JSON_GRAMMAR_TEXT_MAX
        except TypeError:  # options that cannot key the cache
            cacheable = False
        convert = _json_grammar if cacheable else _json_grammar.__wrapped__
        return convert(c.kind, value, c.lenient, c.json_options)
    if c.kind == "regex":
        if not isinstance(c.value, str) or not c.value:
            raise GrammarError("regex", f"pattern must be a non-empty string, got {c.value!r}")
        return LLMatcher.grammar_from_regex(c.value)
    if c.kind == "grammar":
        if not isinstance(c.value, str) or not c.value.strip():
            raise GrammarError("grammar", "grammar must be non-empty Lark or GBNF text")
        try:
            return llguidance.grammar_from("grammar", c.value)
        except ValueError as e:
            raise GrammarError("grammar", str(e)) from e
    options = c.value
    if not isinstance(options, (list, tuple)) or not options:
        raise GrammarError("choice", "choice needs a non-empty list of strings")
    bad = [o for o in options if not isinstance(o, str) or not o]
    if bad:
        raise GrammarError("choice", f"every choice must be a non-empty string, got {bad[0]!r}")
    return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(o) for o in options))


# The grammar text of the schemas seen last, by their JSON text: the keyword rewrite and
# llguidance's conversion run once per schema, not once per request (~0.1 ms of Python per
# request otherwise). A schema's text larger than this is converted every time.
_JSON_GRAMMAR_TEXT_MAX = 64 << 10


@functools.lru_cache(maxsize=256)
def _json_grammar(kind: str, text: str, lenient: bool,
                  options: tuple[tuple[str, Any], ...]) -> str:
    """The llguidance grammar of a JSON schema given as JSON text (raises `GrammarError`;
    errors are not cached)."""
    # keywords the compiler does not hold, rewritten exactly into ones it does
    schema = schema_dict(text)
    rewritten = rewrite(schema, text)
    # each uniqueItems the rule beside the grammar can follow, marked for it (`unique`)
    schema = mark(rewritten, text if rewritten is schema else None)
    opts = dict(JSON_DEFAULTS, **dict(options))
    if lenient:
        opts["lenient"] = True
        opts["coerce_one_of"] = True
    try:
        return LLMatcher.grammar_from_json_schema(schema, defaults=opts)  # type: ignore[arg-type]
    except (ValueError, TypeError) as e:
        raise GrammarError(kind, str(e)) from e


@dataclass(frozen=True)
class CompiledGrammar:
    """A validated grammar for one tokenizer; `matcher()` gives each request its own state.

    Attributes:
        text: the llguidance grammar text.
        warnings: what the compiler did not enforce (lenient JSON schemas).
        nbytes: the memory it holds, as its compile measured it (`GrammarCompiler`).
    """

    text: str
    warnings: tuple[str, ...]
    _template: LLMatcher = field(repr=False, compare=False)
    nbytes: int = 0
    # the closing walk's length by hints (`GrammarCompiler.minimum`): kept with the grammar,
    # so it goes when the grammar leaves the cache
    _needs: dict[tuple, tuple[int | None, str]] = field(default_factory=dict, repr=False,
                                                        compare=False)
    # the compiler whose cache holds it (a weak reference), for `evict`
    _owner: Any = field(default=None, repr=False, compare=False)
    # the uniqueness rule of a schema with `uniqueItems` (`unique.UniqueRule`), or None
    unique: UniqueRule | None = field(default=None, repr=False, compare=False)

    def evict(self) -> None:
        """Leave the compiler's cache (a grammar that failed at its first step: too costly
        to be worth keeping for the next request)."""
        owner = self._owner() if self._owner is not None else None
        if owner is not None:
            owner.forget(self)

    def matcher(self) -> LLMatcher:
        """A fresh matcher at the start of the grammar (the grammar alone)."""
        return self._template.deep_copy()

    def state(self) -> GrammarState:
        """A fresh state at the start of the grammar, with the rule beside it where the
        schema has one (`uniqueItems`): what a request decodes with."""
        return unique_state(self._template.deep_copy(), self.unique)


GRAMMAR_CACHE_BYTES = GRAMMAR_CACHE_MB << 20  # a compiler's cache of compiled grammars


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                               "usmblks", "fsmblks", "uordblks", "fordblks",
                                               "keepcost")]


class _MallocStatistics(ctypes.Structure):
    _fields_ = [("blocks_in_use", ctypes.c_uint), ("size_in_use", ctypes.c_size_t),
                ("max_size_in_use", ctypes.c_size_t), ("size_allocated", ctypes.c_size_t)]


def _heap_reader() -> "Callable[[], int] | None":
    """The C heap's bytes in use, read from the allocator: glibc's `mallinfo2` (every arena
    and the mapped chunks) or macOS's statistics of every malloc zone; None where neither
    is there.
    llguidance allocates through the C heap, and exposes no size of its own."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    if hasattr(libc, "mallinfo2"):
        libc.mallinfo2.restype = _MallInfo2

        def glibc() -> int:
            m = libc.mallinfo2()
            return int(m.uordblks + m.hblkhd)
        return glibc
    if hasattr(libc, "malloc_zone_statistics"):
        libc.malloc_zone_statistics.argtypes = [ctypes.c_void_p,
                                                ctypes.POINTER(_MallocStatistics)]

        def darwin() -> int:
            st = _MallocStatistics()
            libc.malloc_zone_statistics(None, ctypes.byref(st))  # every zone
            return int(st.size_in_use)
        return darwin
    return None


_HEAP = _heap_reader()


def heap_in_use() -> int | None:
    """The process's C heap bytes in use now (None: not measurable here)."""
    return None if _HEAP is None else _HEAP()


def _heap_but_arrays() -> int | None:
    """The C heap in use less MLX's arrays and its buffer cache: what a grammar's compile
    or closing walk adds, without what the scheduler's thread allocates and frees for
    decoding meanwhile (None: not measurable here)."""
    heap = heap_in_use()
    if heap is None:
        return None
    import mlx.core as mx

    return heap - mx.get_active_memory() - mx.get_cache_memory()


def grammar_bytes_estimate(text: str) -> int:
    """A grammar's memory where the heap cannot be measured: what compiles of the
    adversarial corpus and the schema corpus measured, at most (~0.1 MB plus ~55 bytes per
    character of grammar text), rounded up."""
    return (128 << 10) + 64 * len(text)


# Built LLTokenizers by Hugging Face tokenizer (engines over one model share one), then by
# (logits width, end tokens).
_TOKENIZERS: "weakref.WeakKeyDictionary[Any, dict[tuple[int, tuple[int, ...]], Any]]" = \
    weakref.WeakKeyDictionary()
_TOKENIZERS_LOCK = threading.Lock()
_UNNAMED = re.compile(r"<\[\d+\]>")
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _without_prepend(n: dict[str, Any] | None) -> dict[str, Any] | None:
    if n is None or n.get("type") == "Prepend":
        return None
    if n.get("type") == "Sequence":
        kept = [m for m in map(_without_prepend, n["normalizers"]) if m is not None]
        return {**n, "normalizers": kept} if kept else None
    return n


def _metaspace_never(p: dict[str, Any] | None) -> dict[str, Any] | None:
    if p is None:
        return None
    if p.get("type") == "Metaspace":
        return {**p, "prepend_scheme": "never", "add_prefix_space": False}
    if p.get("type") == "Sequence":
        return {**p, "pretokenizers": [_metaspace_never(q) for q in p["pretokenizers"]]}
    return p


def text_tokenizer(hf_tokenizer: Any, n_vocab: int, eos_token_ids: list[int]
                   ) -> tuple[LLTokenizer, dict[str, int]]:
    """An `LLTokenizer` whose text tokenization never yields a special token, and the special
    tokens by name.

    llguidance marks every added token special (its bytes are a 0xFF marker, then its name):
    text never matches it, a grammar names it by id. Built straight from the tokenizer, its
    text tokenization (where a grammar forces bytes, it tokenizes them and allows the first
    token) still splits added tokens out of text: bytes spelling `<think>` inside a JSON
    string were tokenized as the special token, which the mask allowed and consuming it
    failed. Here the same vocabulary, special ids and byte strings sit over a copy of the
    tokenizer without the tokens llguidance holds special (and, as llguidance's own copy,
    without a space prepended), so forced text is tokenized as text.
    """
    base = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=n_vocab,
                                        eos_token=list(eos_token_ids))
    tokens = [base.decode_bytes([i]) for i in range(n_vocab)]
    held = frozenset(i for i in range(n_vocab) if base.is_special_token(i))
    spec = json.loads(hf_tokenizer.backend_tokenizer.to_str())
    spec["added_tokens"] = [t for t in spec.get("added_tokens") or [] if t["id"] not in held]
    # Byte pieces (`<0x5F>`) registered as added tokens are still bytes where the model
    # decodes them so (a ByteFallback decoder), not markers.
    pieces: dict[int, bytes] = {}
    if "ByteFallback" in json.dumps(spec.get("decoder")):
        pieces = {i: bytes([int(m.group(1), 16)]) for i in held
                  if (m := _BYTE_PIECE.fullmatch(tokens[i].decode("latin-1")))}
    for i, b in pieces.items():
        tokens[i] = b
    special = sorted(held - pieces.keys())
    special_set = frozenset(special)
    # As llguidance's own copy: no space prepended to the text it tokenizes.
    spec["normalizer"] = _without_prepend(spec.get("normalizer"))
    spec["pre_tokenizer"] = _metaspace_never(spec.get("pre_tokenizer"))
    spec["padding"] = spec["truncation"] = None
    text = Tokenizer.from_str(json.dumps(spec))

    class _Greedy:
        eos_token_id = list(eos_token_ids)[0]
        bos_token_id = None
        special_token_ids = special

        def __init__(self) -> None:
            self.tokens = tokens

        def __call__(self, s: str) -> list[int]:
            return list(text.encode(s, add_special_tokens=False).ids)

    class _Text(_Greedy):
        def __call__(self, s: str) -> list[int]:
            return list(kept(s) if len(s) <= 256 else spelled(s))

    def spelled(s: str) -> tuple[int, ...]:
        ids = text.encode(s, add_special_tokens=False).ids
        # A model whose text pieces include a special id (an unknown-piece token, byte
        # pieces registered as special): spell it with text tokens instead.
        return tuple(ids if special_set.isdisjoint(ids) else greedy.greedy_tokenize(s))

    # A pure function of the text, asked again and again for the same few short strings (a
    # grammar's forced bytes, at each step of a closing walk): kept.
    kept = functools.lru_cache(maxsize=4096)(spelled)

    # The fallback spells text with a second LLTokenizer over the same tokens: were it `llt`
    # itself, `llt` would hold (in Rust, which Python's collector cannot see) a callback
    # that holds `llt`, and neither would ever be freed (~30 MB each time a model loads).
    # (`greedy` is only asked to tokenize greedily, which reads its tokens alone.)
    greedy = LLTokenizer(TokenizerWrapper(_Greedy()), n_vocab=n_vocab,
                         eos_token=list(eos_token_ids))
    llt = LLTokenizer(TokenizerWrapper(_Text()), n_vocab=n_vocab, eos_token=list(eos_token_ids))
    names = {tokens[i].decode("utf-8", "replace"): i for i in special if tokens[i]}
    return llt, {n: i for n, i in names.items() if not _UNNAMED.fullmatch(n)}


class GrammarCompiler:
    """Compiles constraints for one tokenizer, caching by canonical grammar text (LRU) up
    to `cache_bytes` of compiled grammars.

    A grammar's size is the C heap it added while it compiled and filled its first mask
    (`CompiledGrammar.nbytes`; llguidance builds a lexer's states as masks need them, and
    the first mask builds most of them: a counted regex builds ~170 MB there), at least its
    text's size. Later masks add states too; they are not counted (measured over the
    adversarial corpus: the sizes sum to within 3% of what clearing the cache frees). A
    grammar larger than the whole cache is compiled and used, not kept.

    Thread-safe: the cache is guarded; compilation itself runs outside the lock. A grammar
    that leaves the cache (evicted, forgotten) is let go only while no compile measures the
    heap and nothing else holds it (`_let_go`), so that its freed memory never hides a
    compiling grammar's bytes from that measurement.
    """

    def __init__(self, tokenizer: LLTokenizer, cache_bytes: int = GRAMMAR_CACHE_BYTES,
                 limits: dict[str, int] | None = None,
                 specials: dict[str, int] | None = None) -> None:
        if cache_bytes < 0:
            raise ValueError(f"cache_bytes={cache_bytes}: must be >= 0")
        self.tokenizer = tokenizer
        self.markup = Markup(tokenizer, specials or {})
        self.limits = dict(PARSER_LIMITS, **(limits or {}))
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._held = 0  # the cached grammars' bytes
        self._lock = threading.Lock()
        self._gone: list[CompiledGrammar] = []  # out of the cache, not let go yet
        self._measuring = 0  # compiles measuring the heap now
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self._orders: dict[int, ClosingOrder] = {}
        self._vocab: Vocab | None = None
        self._vocab_lock = threading.Lock()

    @property
    def cached_bytes(self) -> int:
        """The bytes of the grammars in the cache now."""
        with self._lock:
            return self._held

    @property
    def cached(self) -> int:
        """How many grammars the cache holds now."""
        with self._lock:
            return len(self._cache)

    def clear(self) -> None:
        """Empty the cache (requests holding a grammar keep it)."""
        with self._lock:
            self._gone += self._cache.values()
            self._cache.clear()
            self._held = 0
            self._let_go()

    def forget(self, grammar: CompiledGrammar) -> bool:
        """Drop `grammar` from the cache, where it is the one cached for its text."""
        with self._lock:
            if self._cache.get(grammar.text) is not grammar:
                return False
            del self._cache[grammar.text]
            self._held -= grammar.nbytes
            self.evictions += 1
            self._gone.append(grammar)
            self._let_go()
            return True

    def _let_go(self) -> None:
        """Free the grammars out of the cache that nothing else holds (a request's held one
        waits for a later call), unless a compile is measuring the heap (the caller holds
        `_lock`); past the cache's own size of them, even then (a measurement may then read
        low; memory is not held back without bound)."""
        over = sum(g.nbytes for g in self._gone) > self.cache_bytes
        if self._gone and (not self._measuring or over):
            # (a grammar held only here: this list, the loop's name, getrefcount's argument)
            self._gone = [g for g in self._gone if sys.getrefcount(g) > 3]

    def closing_order(self, vocab_size: int) -> ClosingOrder:
        """The tokenizer's closing order for logits `vocab_size` wide (`budget`), built once
        (~0.1 s)."""
        with self._lock:
            hit = self._orders.get(vocab_size)
        if hit is None:
            hit = order_of(self.tokenizer, vocab_size)
            with self._lock:
                self._orders[vocab_size] = hit
        return hit

    def minimum(self, grammar: "CompiledGrammar", matcher: GrammarState, vocab_size: int,
                hints: tuple[tuple[int, ...], ...] = ()) -> tuple[int | None, str]:
        """The closing's length from a fresh `matcher` of `grammar` (`budget.need`; None:
        none found within its bound, and why), cached with the grammar where `matcher` is
        the grammar's own (not a thinking state, whose budget differs per request)."""
        plain = type(matcher) is type(grammar._template)
        key = (vocab_size, hints)
        if plain:
            with self._lock:
                if key in grammar._needs:
                    return grammar._needs[key]
        why: list[str] = []
        order = self.closing_order(vocab_size)
        with self._lock:
            self._measuring += 1
        before = _heap_but_arrays()
        try:
            with spending(Spend(deadline=time.perf_counter() + MINIMUM_S)):
                n = need(matcher, order, hints=hints, why=why)
        except Overspent:  # (the clock's answer: not kept, a later request tries again)
            return None, f"finding the closing took over {MINIMUM_S:g}s"
        finally:
            after = _heap_but_arrays()
            with self._lock:
                self._measuring -= 1
                # The walk grows the grammar's lexer (its states are built as they are
                # reached): counted in its bytes, and in the cache's where it is held.
                if before is not None and after is not None and after > before:
                    self._grow(grammar, after - before)
        got = (n, "; ".join(why) or "no closing found")
        if plain:
            with self._lock:
                grammar._needs[key] = got
        return got

    def _grow(self, grammar: "CompiledGrammar", nbytes: int) -> None:
        """Count `nbytes` more in `grammar`'s bytes, and in the cache's where it holds it
        (evicting the oldest past its size); the caller holds `_lock`."""
        object.__setattr__(grammar, "nbytes", grammar.nbytes + nbytes)
        if self._cache.get(grammar.text) is not grammar:
            return
        self._held += nbytes
        while self._held > self.cache_bytes and len(self._cache) > 1:
            _, gone = self._cache.popitem(last=False)
            if gone is grammar:  # (the newest stays: it is in use now)
                self._cache[grammar.text] = grammar
                continue
            self._held -= gone.nbytes
            self._gone.append(gone)
            self.evictions += 1

    @staticmethod
    def for_hf_tokenizer(hf_tokenizer: Any, n_vocab: int, eos_token_ids: list[int],
                         limits: dict[str, int] | None = None,
                         cache_bytes: int | None = None) -> "GrammarCompiler":
        """A compiler over the LLTokenizer for a Hugging Face fast tokenizer
        (`text_tokenizer`; ~1 s to build, built once per tokenizer, width and end tokens).

        Args:
            hf_tokenizer: `PreTrainedTokenizerFast`.
            n_vocab: width of the model's logits (may exceed the tokenizer's vocabulary;
                the extra ids are never allowed).
            eos_token_ids: every id that ends the output; all are allowed where the grammar
                may end.
            limits: llguidance parser limits replacing `PARSER_LIMITS`' (by name).
            cache_bytes: the compiled-grammar cache's size (None: `GRAMMAR_CACHE_BYTES`).
        """
        key = (n_vocab, tuple(eos_token_ids))
        with _TOKENIZERS_LOCK:
            built = _TOKENIZERS.setdefault(hf_tokenizer, {}).get(key)
        if built is None:
            built = text_tokenizer(hf_tokenizer, n_vocab, eos_token_ids)
            with _TOKENIZERS_LOCK:
                _TOKENIZERS[hf_tokenizer][key] = built
        return GrammarCompiler(built[0], limits=limits, specials=built[1],
                               cache_bytes=GRAMMAR_CACHE_BYTES if cache_bytes is None
                               else cache_bytes)

    def compile(self, c: Constraint, thinking: Thinking | None = None) -> CompiledGrammar:
        """Compile (or fetch from cache) a constraint, after a think block when `thinking`.

        Raises:
            GrammarError: invalid or unsupported constraint, with llguidance's message.
        """
        text = to_grammar(c)
        if thinking is not None:
            text = think_grammar(text, thinking, self.markup)
        with self._lock:
            self._let_go()
            hit = self._cache.get(text)
            if hit is not None:
                self._cache.move_to_end(text)
                self.hits += 1
                return hit
            self._measuring += 1
        try:
            compiled = self._compile(c, text, thinking)
        finally:
            with self._lock:
                self._measuring -= 1
        with self._lock:
            self.misses += 1
            old = self._cache.pop(text, None)  # compiled twice at once: keep the last
            if old is not None:
                self._held -= old.nbytes
                self._gone.append(old)
            if compiled.nbytes <= self.cache_bytes:
                self._cache[text] = compiled
                self._held += compiled.nbytes
            while self._held > self.cache_bytes:
                _, gone = self._cache.popitem(last=False)
                self._held -= gone.nbytes
                self._gone.append(gone)
                self.evictions += 1
            self._let_go()
        return compiled

    def vocab(self) -> Vocab:
        """The tokenizer's bytes per token, as the uniqueness rule reads them (made once)."""
        with self._vocab_lock:
            if self._vocab is None:
                self._vocab = Vocab(self.tokenizer)
            return self._vocab

    def _unique_rule(self, text: str, thinking: Thinking | None) -> UniqueRule | None:
        """The uniqueness rule of a grammar whose schema has a followed `uniqueItems`."""
        if MARK not in text:
            return None
        schemas = [g["json_schema"] for g in json.loads(text).get("grammars", [])
                   if isinstance(g.get("json_schema"), dict)]
        if not schemas:
            return None
        return UniqueRule(schemas[0], self.vocab(), thinking)

    def _compile(self, c: Constraint, text: str, thinking: Thinking | None = None
                 ) -> CompiledGrammar:
        """Compile `text` (of constraint `c`), measuring the heap it adds."""
        limits = llguidance.LLParserLimits(**self.limits)
        before = _heap_but_arrays()
        is_error, messages = LLMatcher.validate_grammar_with_warnings(text, self.tokenizer,
                                                                      limits=limits)
        if is_error:
            raise GrammarError(c.kind, "; ".join(messages) or "rejected by the compiler")
        template = LLMatcher(self.tokenizer, text, log_level=0, limits=limits)
        if template.is_error():
            raise GrammarError(c.kind, template.get_error())
        # A grammar can compile and still match nothing (regex `[^\s\S]`): its first mask is
        # empty. That is bad input, found here once per grammar, not a fault mid-request.
        probe = template.deep_copy()
        first = llnp.allocate_token_bitmask(1, self.tokenizer.vocab_size)
        llnp.fill_next_token_bitmask(probe, first, 0)
        if probe.is_error() or not first.any():
            raise GrammarError(c.kind, "the constraint matches no text: no token, not even the "
                                       "end of output, is allowed at the start")
        del probe  # (its own parser state is not the grammar's)
        after = _heap_but_arrays()
        # Other threads allocate and free meanwhile: what they free can hide this grammar's
        # bytes (hence the floor), what they allocate is counted here (a cache that holds a
        # little less than it could).
        nbytes = (grammar_bytes_estimate(text) if before is None or after is None
                  else max(after - before, 2 * len(text.encode())))
        return CompiledGrammar(text, tuple(map(_keyword_warning, messages)), template, nbytes,
                               _owner=weakref.ref(self),
                               unique=self._unique_rule(text, thinking))
