"""The engine's settings and their shipped defaults, defined once, on the floor: what a
request decodes with (`SpecConfig`), what its grammar may cost (`MaskBudget`), what it gets
for the fields it leaves out (`EngineDefaults`), and everything `Engine.load` sets up
(`EngineConfig`, `EngineConfig()` being what `specdec serve` and `specdec generate` run).
The CLI, the server and the benchmarks read these; nothing restates them. Imports nothing of
ours but the floor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .errors import DraftConfigError
from .types import MAX_DRAFT_TOKENS

MAX_TREE_NODES = 32
DEFAULT_MODEL = "default"  # the embedded model (`models.load`)
DEFAULT_DRAFT = "default-draft"  # its shipped distilled draft
DEFAULT_MAX_TOKENS = 256  # a request's output tokens where it names none (`EngineDefaults`)
PROMPT_STORE_MB = 1024  # the prompt store's bound (`EngineConfig.prompt_store_mb`)
GRAMMAR_CACHE_MB = 256  # compiled grammars kept per model (`EngineConfig.grammar_cache_mb`)


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding settings.

    Attributes:
        k: most draft-model tokens proposed per round (1..16); looked-up tokens may bring
            the proposals not forced to `cheap_k` = min(2k, 16), and where one request runs,
            forced tokens run on past them to 16 in all.
        draft_masking: mask the draft's logits with a matcher clone (proposals legal by
            construction). Off: the draft proposes unmasked and the backstop cuts.
        forced_drafting: propose grammar-forced tokens without running the draft model.
        lookup: propose continuations of the context's own n-grams (prompt lookup) before
            asking the draft model; legal ones only, like every proposal.
        lookup_min_ngram: the shortest context suffix (tokens) a lookup match must repeat.
        suffix: propose continuations from earlier answers (`lookup.SuffixStore`: those to
            the same grammar first, then any), after prompt lookup; legal ones only.
        draft_min_prob: stop drafting this round when the draft model gives its own pick
            less than this probability (a likely rejection costs verify width and draft
            steps); 0 drafts all k.
        tree: most branch tokens a round adds to its chain of proposals (0: a chain): at
            each position the draft model was asked for, its likeliest other legal tokens
            (and, where the gate ended the chain, its pick among them) become branches, each
            followed by the tokens the grammar then forces; at each looked-up position, the
            other runs the prompt's index and the earlier answers hold there (`Proposer`);
            the target verifies the whole tree in one forward (`ragged.forward`'s trees). A
            batched round shares it out (`core`), so a full batch verifies chains.
        tree_min_score: a branch's least estimated chance of being reached and accepted
            (the draft's probabilities, lookup's acceptance rate in the request); None: what
            rows cost now decides (`TreeCosts.min_score`: a branch token is proposed when the
            tokens it is expected to add are worth its row's time at the round's rate).
    """

    k: int = 4
    draft_masking: bool = True
    forced_drafting: bool = True
    lookup: bool = False
    lookup_min_ngram: int = 2
    suffix: bool = False
    draft_min_prob: float = 0.0
    tree: int = 0
    tree_min_score: float | None = None

    @classmethod
    def serving(cls) -> "SpecConfig":
        """The shipped defaults (`specdec serve`, `specdec generate`, `Engine.load()`): k=4
        draft-model tokens a round, forced tokens, prompt lookup and earlier answers
        proposing, drafting ended below p=0.3, token trees of up to 4 branch tokens, their
        threshold priced by what rows cost now. Measured in bench/ (README, Performance)."""
        return cls(k=4, lookup=True, suffix=True, draft_min_prob=0.3, tree=4)

    @property
    def cheap_k(self) -> int:
        """Most proposals per round when they come free (forced) or from lookup."""
        return min(2 * self.k, MAX_DRAFT_TOKENS)

    def __post_init__(self) -> None:
        if not isinstance(self.k, int) or not (1 <= self.k <= MAX_DRAFT_TOKENS):
            raise DraftConfigError(f"k={self.k!r}: must be an integer in [1, {MAX_DRAFT_TOKENS}]")
        if not 0.0 <= self.draft_min_prob < 1.0:
            raise DraftConfigError(f"draft_min_prob={self.draft_min_prob!r}: must be in [0, 1)")
        if not isinstance(self.tree, int) or not 0 <= self.tree <= MAX_TREE_NODES:
            raise DraftConfigError(f"tree={self.tree!r}: must be an integer in "
                                   f"[0, {MAX_TREE_NODES}]")
        if self.tree_min_score is not None and not 0.0 <= self.tree_min_score <= 1.0:
            raise DraftConfigError(f"tree_min_score={self.tree_min_score!r}: must be in [0, 1]")
        if self.lookup_min_ngram < 1:
            raise DraftConfigError(f"lookup_min_ngram={self.lookup_min_ngram!r}: must be >= 1")


@dataclass(frozen=True)
class MaskBudget:
    """What one request's grammar may cost in host time (llguidance mask fills and all the
    grammar work around them: `request_grammar.GrammarClock`), so that no grammar holds the
    requests decoded next to it.

    A request's next mask is filled between rounds, off the round; a round waits for it at
    most `slow_s` (in all, for every request) and goes on without the requests whose mask is
    not ready (they sit the round out: their output does not change, only its pace). A
    request whose one fill took longer than `slow_s` decodes plainly from then on (one mask
    per token, filled off the round, instead of one per proposal, filled in it).

    Attributes:
        slow_s: the longest fill a round waits for (and the threshold for plain decoding).
        mask_s: one fill longer than this stops the request (`GrammarTooComplex`).
        total_s: the request's grammar work in all longer than this stops it too.
    """

    slow_s: float = 0.05
    mask_s: float = 2.0
    total_s: float = 30.0
    in_round: bool = True  # also end a round's proposals at slow_s (not on a sharded target:
    # its ranks must propose alike, so only the decisions rank 0 publishes use the clock)

    def __post_init__(self) -> None:
        if not 0 < self.slow_s <= self.mask_s <= self.total_s:
            raise ValueError(f"mask budget: need 0 < slow_s ({self.slow_s}) <= mask_s "
                             f"({self.mask_s}) <= total_s ({self.total_s})")


@dataclass(frozen=True)
class EngineDefaults:
    """What a request gets when it leaves a field out, and the limits `prepare` applies.

    Attributes:
        max_tokens: most output tokens (within the context length).
        max_thinking_tokens: a thinking request's budget when it gives none (and at most
            half its max_tokens).
        compile_timeout_s: most seconds a constraint may take to compile (None: no limit).
        chat_template: a Jinja template overriding the model's.
        reasoning_format: the reasoning protocol thinking requests follow (`chat.
            protocol_named`: harmony, gemma, think, or a think tag) instead of the one read
            from the rendered template.
    """

    max_tokens: int = DEFAULT_MAX_TOKENS
    max_thinking_tokens: int = 1024
    compile_timeout_s: float | None = None
    chat_template: str | None = None
    reasoning_format: str | None = None


@dataclass(frozen=True)
class ServeLimits:
    """The scheduler's limits a server starts it with (`Engine.start`), and their shipped
    values (`server.door.ServeConfig` and the CLI's flags default to these).

    Attributes:
        max_batch: most requests decoded together. max_queue: most more waiting (then
            `QueueFull`). request_timeout_s: a request's time limit from arrival, waiting
            included (None: no limit).
    """

    max_batch: int = 8
    max_queue: int = 64
    request_timeout_s: float | None = 600.0


LIMITS = ServeLimits()


@dataclass(frozen=True)
class EngineConfig:
    """Everything `Engine.load` sets up besides the model; `EngineConfig()` holds the
    shipped defaults, which `specdec serve`, `specdec generate` and `Engine.load()` use
    alike (command-line flags replace single fields).

    Attributes:
        draft: "auto" (the shipped distilled draft for the embedded default model, else
            none), "self" (the target as its own draft), "none", or a model name or path.
        spec: requests' speculative settings (`SpecConfig.serving()`).
        jump_forward: with no draft model, constrained requests still propose grammar-forced
            tokens (a run of them costs one forward).
        draft_max_batch: batched rounds run the draft model only while at most this many
            requests draft ("auto": 4 on the CPU backend, no limit on a GPU; None: no limit).
        defaults: what requests get for the fields they leave out, and their limits.
        masks: what one request's grammar may cost.
        max_kv_tokens: most KV positions decoding requests hold together ("auto": a quarter
            of the machine's memory; None: no bound).
        parser_limits: llguidance's parser limits, by name (None: `grammar.PARSER_LIMITS`).
        grammar_cache_mb: megabytes of compiled grammars kept for reuse (least recently
            used dropped first; `grammar.GrammarCompiler`).
        kv_memory_mb: the megabytes an "auto" KV budget sizes itself to (None: a quarter of
            the machine's memory; a server of several models with a memory budget gives each
            a quarter of that budget).
        prompt_store_mb: megabytes of prompt and answer states the prompt store keeps
            (`decode.PromptKVCache`; least recently used dropped first).
    """

    draft: str = "auto"
    spec: SpecConfig = field(default_factory=SpecConfig.serving)
    jump_forward: bool = True
    draft_max_batch: int | None | Literal["auto"] = "auto"
    defaults: EngineDefaults = EngineDefaults(compile_timeout_s=10.0)
    masks: MaskBudget = MaskBudget()
    max_kv_tokens: int | None | Literal["auto"] = "auto"
    parser_limits: dict[str, int] | None = None
    grammar_cache_mb: int = GRAMMAR_CACHE_MB
    kv_memory_mb: int | None = None
    prompt_store_mb: int = PROMPT_STORE_MB

    def draft_for(self, model: str) -> str | None:
        """The draft to load for target `model` ("self" or a name), or None."""
        name = self.draft
        if name == "auto":
            name = DEFAULT_DRAFT if model == DEFAULT_MODEL else "none"
        return None if name in ("none", "") else name
