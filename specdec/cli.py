"""`specdec` command line: generate, info, serve.

The launcher picks the BLAS before MLX is imported (see `specdec.blas`), so every import of
MLX-using modules here is deferred into the subcommands.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from .config import LIMITS, EngineConfig

DEFAULTS = EngineConfig()  # the shipped settings every flag below defaults to


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default",
                   help="'default' (embedded SmolLM2-135M-Instruct), a GGUF file (llama, "
                        "mistral, qwen2, qwen3, phi3; converted once into the cache), a local "
                        "mlx-lm directory (quantized ones too) or a Hugging Face repo id "
                        "already in the local Hugging Face cache (never downloaded)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="specdec", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate text, optionally constrained")
    _add_model_args(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="user message (rendered with the chat template)")
    src.add_argument("--messages", help="chat messages: a JSON list or a file holding one")
    src.add_argument("--raw-prompt", help="prompt text used as is (no chat template)")
    g.add_argument("--system", help="system message to put before --prompt")
    con = g.add_mutually_exclusive_group()
    con.add_argument("--json-schema", metavar="FILE", help="JSON schema file")
    con.add_argument("--json-object", action="store_true", help="any JSON object")
    con.add_argument("--regex", help="regular expression the output must match")
    con.add_argument("--grammar", metavar="FILE", help="Lark or GBNF grammar file")
    con.add_argument("--choice", nargs="+", metavar="OPTION", help="output is one of these")
    g.add_argument("--lenient", action="store_true",
                   help="JSON schema: skip unimplemented keywords instead of refusing")
    g.add_argument("--max-tokens", type=int, default=None,
                   help=f"most output tokens (default {DEFAULTS.defaults.max_tokens}, within the "
                        "context)")
    g.add_argument("--no-close-at-budget", dest="close_at_budget", action="store_false",
                   help="cut a constrained output where --max-tokens ends instead of closing "
                        "it in time (a budget below the constraint's minimum is then no "
                        "error)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--stats", action="store_true",
                   help="print a JSON line to stderr: finish reason, usage, stats, the output "
                        "token ids (and their logprobs with --logprobs)")
    g.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="with --stats: each token's logprob and its top N alternatives")
    g.add_argument("--think", action="store_true",
                   help="think before the answer (a chat template with a think block): the "
                        "thinking goes to stderr, the (constrained) answer to stdout")
    g.add_argument("--max-thinking-tokens", type=int, default=None,
                   help="thinking budget (implies --think; default: half of --max-tokens, at "
                        "most 1024); then the end of thinking is forced")
    _add_spec_args(g)

    sub.add_parser("info", help="backend, BLAS, model and cache paths")

    d = sub.add_parser("distill", help="train a small draft model for a target (CPU, seeded, "
                                       "resumable)")
    d.add_argument("--target", default="default",
                   help="'default' (the embedded model) or a local mlx-lm directory")
    d.add_argument("--out", required=True, help="output directory (rerun to resume)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--prompts", type=int, help="prompts to sample the target on")
    d.add_argument("--epochs", type=int, help="training passes over the samples")
    d.add_argument("--layers", type=int, help="draft blocks")
    d.add_argument("--draft-vocab", type=int, help="draft output ids")

    la = sub.add_parser("launch", help="run a specdec command on several ranks with "
                                       "mlx.launch (ring backend); exits non-zero when a "
                                       "rank fails")
    la.add_argument("-n", type=int, default=2, help="ranks on this machine")
    la.add_argument("--launcher-arg", action="append", default=[],
                    help="an argument for mlx.launch (repeatable), e.g. --hostfile=FILE")
    la.add_argument("command", nargs=argparse.REMAINDER,
                    help="-- then the specdec command, e.g. -- serve --model DIR")

    s = sub.add_parser("serve", help="OpenAI-compatible server")
    s.add_argument("--model", action="append", default=[], metavar="[NAME=]MODEL",
                   help="a model to serve (repeatable: several are served by name, each "
                        "loaded on its first request): 'default' (embedded SmolLM2-135M-"
                        "Instruct, served when no model is given), a GGUF file, a local mlx-lm "
                        "directory or a Hugging Face repo id already in the local cache; NAME= "
                        "names it (default: its file's or directory's name)")
    s.add_argument("--models-file", action="append", default=[], metavar="FILE",
                   help="models to serve, from a TOML or JSON file (path, aliases, draft, "
                        "chat_template, reasoning_format, max_kv_tokens, grammar_cache_mb, "
                        "prompt_store_mb, pinned, ttl; see README)")
    s.add_argument("--models-dir", action="append", default=[], metavar="DIR",
                   help="serve every model directory in DIR (one with a config.json), each "
                        "named by its directory (repeatable)")
    s.add_argument("--default-model", default=None, metavar="NAME",
                   help="what model \"default\" and a request naming no model mean "
                        "(default: the file's 'default', else the first model)")
    s.add_argument("--max-loaded", type=int, default=None, metavar="N",
                   help="most models loaded at once; the least recently used idle one is "
                        "unloaded to make room, never a pinned one (default: no limit)")
    s.add_argument("--load-wait", type=float, default=120.0, metavar="SECONDS",
                   help="how long a request for a model that cannot load yet (the models "
                        "holding the room busy) waits in line for them to go idle before a "
                        "503 (default 120; the request's own time limit also bounds it)")
    s.add_argument("--memory-budget", default="auto", metavar="MB|auto|none",
                   help="most megabytes of models loaded at once (each its weights, grammar "
                        "cache, KV budget and prompt store; under a budget an 'auto' KV budget "
                        "is a quarter of it and a prompt store at most a sixteenth), made room "
                        "for as for --max-loaded ('auto', the default: half the machine's "
                        "memory)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="required of clients (Bearer or x-api-key); repeat it for several "
                        "callers, each seeing only the responses and conversations its own "
                        "key stored")
    s.add_argument("--api-keys-file", default=None, metavar="FILE",
                   help="callers' keys, a JSON object {name: key}: each name's stored "
                        "objects its own")
    s.add_argument("--no-ui", dest="ui", action="store_false",
                   help="serve no playground page at / (the APIs only)")
    s.add_argument("--chat-template", metavar="FILE", default=None)
    s.add_argument("--reasoning-format", default=None,
                   help="the reasoning protocol thinking requests follow: harmony, gemma, "
                        "think, or a think tag such as '<seed:think>' (default: read from "
                        "what the chat template renders)")
    # (the scheduler's limits: `config.ServeLimits`, which `server.door.ServeConfig` reads)
    s.add_argument("--max-batch", type=int, default=None,
                   help="requests decoded together (continuous batching; default "
                        f"{LIMITS.max_batch})")
    s.add_argument("--max-queue", type=int, default=None,
                   help="requests waiting for a slot; more get 503 with Retry-After "
                        f"(default {LIMITS.max_queue})")
    s.add_argument("--request-timeout", type=float, default=None,
                   help="seconds a request may take from arrival (waiting included) before "
                        f"it is stopped with a 504 (default {LIMITS.request_timeout_s:g}); 0 "
                        "for no limit")
    s.add_argument("--store", default=None, metavar="PATH|memory|none",
                   help="where the Responses API keeps stored responses and conversations: "
                        "an SQLite file (default: responses.sqlite3 in the cache directory, "
                        "$SPECDEC_CACHE), memory (gone at exit), or none (nothing stored)")
    s.add_argument("--store-max-age", type=float, default=30.0, metavar="DAYS",
                   help="a stored conversation, or chain of responses, lasts this long "
                        "since last used (written or read; default 30 days)")
    s.add_argument("--store-max-count", type=int, default=10_000, metavar="N",
                   help="most responses and conversations stored (default 10000); whole "
                        "conversations and chains go, the least recently used first")
    s.add_argument("--store-max-mb", type=int, default=1024, metavar="MB",
                   help="most megabytes of stored JSON (default 1024)")
    s.add_argument("--store-max-object-mb", type=int, default=None, metavar="MB",
                   help="most megabytes one conversation or chain of responses may take "
                        "(default: 64, at most --store-max-mb); a turn past it is a 400")
    s.add_argument("--max-thinking-tokens", type=int, default=None,
                   help="most tokens a thinking request thinks before its answer when it "
                        f"gives no max_thinking_tokens (and at most half its max_tokens; "
                        f"default {DEFAULTS.defaults.max_thinking_tokens})")
    _add_spec_args(s)
    for p in sub.choices.values():  # every subcommand runs MLX (`launch`: on its ranks)
        _add_blas_arg(p)
    return ap


def _add_blas_arg(p: argparse.ArgumentParser) -> None:
    from .blas import CHOICES

    p.add_argument("--blas", choices=CHOICES, default=None,
                   help="MLX's CPU BLAS on Linux, as SPECDEC_BLAS (default: it, else auto): "
                        "'openblas' (~2x faster decoding; a request's tokens can depend on "
                        "its neighbours at near-ties), 'reference' (batch-invariant: output "
                        "bitwise independent of the batch), 'auto' (OpenBLAS when installed)")


def _add_spec_args(p: argparse.ArgumentParser) -> None:
    """The engine's settings (`config.EngineConfig`); a flag left out keeps its shipped
    default, so `specdec generate`, `specdec serve` and `Engine.load()` decode alike."""
    spec = DEFAULTS.spec
    p.add_argument("--draft-model", default=None,
                   help="speculative draft: 'auto' (the shipped distilled draft when the target "
                        "is the embedded default, else none), a local mlx-lm directory, 'self' "
                        "(the target as its own draft) or 'none' (default "
                        f"{DEFAULTS.draft!r})")
    p.add_argument("--draft-min-prob", type=float, default=None,
                   help="end a round's drafting when the draft model gives its pick less than "
                        f"this probability (0: always draft k tokens; default "
                        f"{spec.draft_min_prob})")
    p.add_argument("--draft-max-batch", default=None,
                   help="run the draft model in batched rounds only while at most this many "
                        "requests draft; larger rounds propose grammar-forced and looked-up "
                        "tokens only ('auto': 4 on the CPU backend, no limit on a GPU; "
                        "'none': no limit)")
    p.add_argument("--no-lookup", action="store_true",
                   help="do not propose tokens copied from the prompt (n-gram lookup)")
    p.add_argument("--no-suffix", action="store_true",
                   help="do not propose tokens from earlier answers (answers to the same "
                        "grammar first, then any; kept in memory, bounded)")
    p.add_argument("--tree", type=int, default=None,
                   help="most branch tokens a round adds to its chain of proposals (token "
                        "trees, verified in one forward; shared out across a batch, none "
                        f"where the draft model is left out); 0: chains only (default "
                        f"{spec.tree})")
    p.add_argument("--tree-min-score", default=None,
                   help="a branch's least estimated chance of being reached and accepted; "
                        "'auto': priced by what verify rows cost now (wide trees where rows "
                        "are cheap, chains where a full batch waits on them)")
    p.add_argument("--k", "--num-draft-tokens", dest="k", type=int, default=None,
                   help=f"tokens proposed per speculative round (1..16; default {spec.k})")
    p.add_argument("--no-draft-masking", action="store_true",
                   help="let the draft propose unmasked (the verify backstop cuts)")
    p.add_argument("--no-forced-drafting", action="store_true",
                   help="run the draft model even where the grammar forces the token")
    p.add_argument("--no-jump-forward", action="store_true",
                   help="with no draft model, decode constrained requests one token per "
                        "forward instead of feeding runs of grammar-forced tokens at once")
    p.add_argument("--compile-timeout", type=float, default=None,
                   help="seconds a request's grammar may take to compile before it is "
                        f"refused (default {DEFAULTS.defaults.compile_timeout_s:g}); 0 for no "
                        "limit")
    p.add_argument("--max-kv-tokens", default=None,
                   help="most KV positions the decoding requests hold together (prompt + "
                        "max_tokens + 17 each); more wait, one that cannot fit alone is a 400 "
                        "('auto', the default: a quarter of the machine's memory; 'none': no "
                        "bound)")
    p.add_argument("--grammar-cache-mb", type=int, default=None, metavar="MB",
                   help="megabytes of compiled grammars each model keeps for reuse, least "
                        "recently used dropped first, counted in --memory-budget (default "
                        f"{DEFAULTS.grammar_cache_mb}; 0 keeps none)")
    masks = DEFAULTS.masks
    p.add_argument("--prompt-store-mb", type=int, default=None, metavar="MB",
                   help="megabytes of prompt and answer states each model keeps for later "
                        "requests (a conversation's next turn restores them), least recently "
                        "used dropped first, counted in --memory-budget (default "
                        f"{DEFAULTS.prompt_store_mb}; 0 keeps none)")
    p.add_argument("--grammar-slow-mask", type=float, default=None,
                   help=f"seconds (default {masks.slow_s:g}): a request whose grammar mask "
                        "takes longer decodes plainly, its masks filled off the batch's rounds")
    p.add_argument("--grammar-mask-limit", type=float, default=None,
                   help=f"seconds (default {masks.mask_s:g}) one grammar mask may take before "
                        "its request is stopped (grammar_too_complex)")
    p.add_argument("--grammar-budget", type=float, default=None,
                   help=f"seconds (default {masks.total_s:g}) of grammar mask work one request "
                        "may spend in all before it is stopped (grammar_too_complex)")


def _reasoning_format(name: str | None) -> str | None:
    if name is not None:
        from .chat import protocol_named
        from .errors import RequestError

        try:
            protocol_named(name)
        except RequestError as e:
            raise SystemExit(f"specdec: error: --reasoning-format: {e}")
    return name


def _tree_min_score(value: str) -> float | None:
    if value == "auto":
        return None
    try:
        return float(value)
    except ValueError:
        raise SystemExit(f"specdec: error: --tree-min-score {value!r}: a number in [0, 1] "
                         "or 'auto'")


def _choice(flag: str, value: str | None, words: tuple[str, ...]) -> Any:
    """A flag that takes an integer or one of `words` (None: not given)."""
    if value is None or value in words:
        return value
    try:
        return int(value)
    except ValueError:
        raise SystemExit(f"specdec: error: {flag} {value!r}: an integer or "
                         + " or ".join(repr(w) for w in words))


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The command line's engine settings: the shipped ones (`EngineConfig()`) with the
    fields its flags give replaced."""
    from dataclasses import replace

    c = DEFAULTS
    spec = {"k": args.k, "draft_min_prob": args.draft_min_prob, "tree": args.tree}
    spec = {k: v for k, v in spec.items() if v is not None}
    if args.tree_min_score is not None:
        spec["tree_min_score"] = _tree_min_score(args.tree_min_score)
    for flag, name in (("no_draft_masking", "draft_masking"),
                       ("no_forced_drafting", "forced_drafting"), ("no_lookup", "lookup"),
                       ("no_suffix", "suffix")):
        if getattr(args, flag):
            spec[name] = False
    template = getattr(args, "chat_template", None)
    defaults = {"chat_template": Path(template).read_text() if template else None,
                "reasoning_format": _reasoning_format(getattr(args, "reasoning_format", None))}
    if args.compile_timeout is not None:
        defaults["compile_timeout_s"] = args.compile_timeout or None
    if args.cmd == "serve" and args.max_thinking_tokens is not None:
        defaults["max_thinking_tokens"] = args.max_thinking_tokens
    masks = {"slow_s": args.grammar_slow_mask, "mask_s": args.grammar_mask_limit,
             "total_s": args.grammar_budget}
    try:
        budget = replace(c.masks, **{k: v for k, v in masks.items() if v is not None})
    except ValueError as e:
        raise SystemExit(f"specdec: error: {e}")
    changes: dict[str, Any] = {
        "spec": replace(c.spec, **spec), "masks": budget,
        "defaults": replace(c.defaults, **defaults),
        "jump_forward": c.jump_forward and not args.no_jump_forward}
    if args.draft_model is not None:
        changes["draft"] = args.draft_model
    limit = _choice("--draft-max-batch", args.draft_max_batch, ("auto", "none"))
    if limit is not None:
        changes["draft_max_batch"] = None if limit == "none" else limit
    if args.grammar_cache_mb is not None:
        if args.grammar_cache_mb < 0:
            raise SystemExit(f"specdec: error: --grammar-cache-mb {args.grammar_cache_mb}: "
                             "megabytes (an integer >= 0)")
        changes["grammar_cache_mb"] = args.grammar_cache_mb
    if args.prompt_store_mb is not None:
        if args.prompt_store_mb < 0:
            raise SystemExit(f"specdec: error: --prompt-store-mb {args.prompt_store_mb}: "
                             "megabytes (an integer >= 0)")
        changes["prompt_store_mb"] = args.prompt_store_mb
    kv = _choice("--max-kv-tokens", args.max_kv_tokens, ("auto", "none"))
    if kv is not None:
        changes["max_kv_tokens"] = None if kv == "none" else kv
    return replace(c, **changes)


def build_engine(model: str, args: argparse.Namespace, shard_group: Any = None) -> Any:
    """The Engine the command line names (`Engine.load` with `engine_config(args)`; the
    target sharded over `shard_group` when given, the draft whole on every rank)."""
    from .engine import Engine

    return Engine.load(model, engine_config(args), shard_group=shard_group)


def _constraint(args: argparse.Namespace) -> Any:
    from .grammar import Constraint

    if args.json_schema:
        return Constraint.json_schema(Path(args.json_schema).read_text(), lenient=args.lenient)
    if args.json_object:
        return Constraint.json_object()
    if args.regex is not None:
        return Constraint.regex(args.regex)
    if args.grammar:
        return Constraint.grammar(Path(args.grammar).read_text())
    if args.choice:
        return Constraint.choice(args.choice)
    return None


def _messages(args: argparse.Namespace) -> tuple[Any, ...]:
    from .request import Message

    if args.messages:
        text = args.messages
        if not text.lstrip().startswith("["):
            text = Path(text).read_text()
        msgs = json.loads(text)
        if not isinstance(msgs, list) or not all(
                isinstance(m, dict) and isinstance(m.get("content"), str) and
                m.get("role") in ("system", "user", "assistant") for m in msgs):
            raise ValueError("--messages must be a JSON list of {role, content} with roles "
                             "system, user or assistant")
        return tuple(Message(m["role"], m["content"]) for m in msgs)
    if args.prompt is not None:
        msgs = [Message("system", args.system)] if args.system else []
        return (*msgs, Message("user", args.prompt))
    return ()


EXIT_INCOMPLETE = 3  # `generate`: constrained output cut by --max-tokens (printed anyway)


def generate_request(args: argparse.Namespace) -> Any:
    """The command line as the engine's neutral request (the server builds the same one
    from an API body)."""
    from .request import GenerateRequest
    from .sampling import SamplingParams

    msgs = _messages(args)
    think = args.think or args.max_thinking_tokens is not None
    if think and not msgs:
        raise ValueError("--think needs a chat prompt (--prompt or --messages)")
    return GenerateRequest(
        messages=msgs, prompt=None if msgs else args.raw_prompt, constraint=_constraint(args),
        sampling=SamplingParams(args.temperature, args.top_p, args.top_k, args.seed),
        max_tokens=args.max_tokens, stop=tuple(args.stop), thinking=think,
        thinking_budget=args.max_thinking_tokens,
        logprobs=args.logprobs, close_at_budget=getattr(args, "close_at_budget", True))


def cmd_generate(args: argparse.Namespace) -> int:
    engine = build_engine(args.model, args)
    req = engine.prepare(generate_request(args))
    result = engine.generate(req)
    if result.reasoning is not None:
        print(result.reasoning, file=sys.stderr)
    if result.tool_calls:
        print(json.dumps([c.__dict__ for c in result.tool_calls]))
    else:
        print(result.text)
    if args.stats:
        line = {"finish_reason": result.finish_reason, **result.stats.as_dict(),
                "usage": {**result.usage.__dict__, "total_tokens": result.usage.total_tokens}}
        if result.warnings:
            line["warnings"] = list(result.warnings)
        if args.logprobs is not None:
            line["logprobs"] = [[e.token, e.logprob, [list(t) for t in e.top]]
                                for e in result.logprobs]
        line["tokens"] = list(result.tokens)
        print(json.dumps(line), file=sys.stderr)
    if req.constraint is not None and result.finish_reason == "length":
        m = engine.matcher(req)
        for t in result.tokens:
            m.consume_token(t)
        if not m.is_accepting():
            print(f"specdec: the output was cut at --max-tokens {req.max_tokens} before the "
                  "constraint was complete, so it does not match it; raise --max-tokens "
                  "(or leave out --no-close-at-budget)",
                  file=sys.stderr)
            return EXIT_INCOMPLETE
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    import mlx.core as mx

    from . import blas, models
    from .errors import ModelNotFoundError

    try:
        gguf: str = str(models.embedded_gguf())
    except ModelNotFoundError as e:
        gguf = f"missing ({e})"
    try:
        draft: str = str(models.default_draft_dir())
    except ModelNotFoundError as e:
        draft = f"missing ({e})"
    info = {
        "mlx": mx.__version__,
        "device": str(mx.default_device()),
        "gpu_backend": models.gpu_backend(),
        "blas_active": blas.active(),
        "blas_requested": blas.requested(),
        "batch_invariant": blas.BATCH_INVARIANT.get(blas.active(), "not measured"),
        "openblas_path": blas.openblas_path(),
        "default_model": "SmolLM2-135M-Instruct (embedded)",
        "default_weight_format": models.default_weight_format(),
        "embedded_gguf": gguf,
        "default_draft": draft,
        "cache_dir": str(models.cache_dir()),
    }
    for k, v in info.items():
        print(f"{k:24} {v}")
    return 0


def cmd_distill(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from . import load
    from .distill import DistillConfig, distill

    knobs = {k: getattr(args, k) for k in ("seed", "prompts", "epochs", "layers", "draft_vocab")
             if getattr(args, k) is not None}
    report = distill(load(args.target), Path(args.out), replace(DistillConfig(), **knobs))
    print(json.dumps(report))
    return 0


def serve_config(args: argparse.Namespace, channel: Any = None) -> Any:
    """The server's settings (`server.door.ServeConfig`) the command line gives: its
    defaults where no flag gives one (--request-timeout 0: no time limit)."""
    from dataclasses import replace

    from server.door import ServeConfig
    from server.store import DAY, SCHEMES, Bounds, PostgresStore, StoreUnavailable

    from .errors import ModelConfigError
    from .models import cache_dir

    given = {"max_batch": args.max_batch, "max_queue": args.max_queue,
             "request_timeout_s": args.request_timeout}
    for flag, value in (("--store-max-age", args.store_max_age),
                        ("--store-max-count", args.store_max_count),
                        ("--store-max-mb", args.store_max_mb),
                        ("--store-max-object-mb", 1 if args.store_max_object_mb is None
                         else args.store_max_object_mb)):
        if value <= 0:
            raise ModelConfigError(f"{flag} {value:g}: must be positive")
    store = args.store or str(cache_dir() / "responses.sqlite3")
    bounds = Bounds(args.store_max_age * DAY, args.store_max_count, args.store_max_mb << 20,
                    min(args.store_max_object_mb, args.store_max_mb) << 20
                    if args.store_max_object_mb is not None else None)
    scheme = re.match(r"([A-Za-z][A-Za-z0-9+.-]*)://", store)
    if scheme is not None:  # a URL is never a file path
        if scheme.group(1).lower() not in SCHEMES:
            raise ModelConfigError(
                f"--store {scheme.group(0)}...: not supported: a path (an SQLite file), "
                "memory, none, or a postgresql:// URL")
        try:  # reachable now, and not written by a later release: else an error at start
            PostgresStore(store, bounds).close()
        except StoreUnavailable as e:
            raise ModelConfigError(f"--store: {e}") from None
    keys = api_keys(args)
    single = keys[0][1] if len(keys) == 1 and keys[0][0] == "" else None
    return replace(ServeConfig(host=args.host, port=args.port, api_key=single,
                               api_keys=() if single is not None else keys,
                               ui=getattr(args, "ui", True), channel=channel, store=store,
                               store_bounds=bounds),
                   **{k: v or None if k == "request_timeout_s" else v
                      for k, v in given.items() if v is not None})


def api_keys(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    """(owner, key) pairs from `--api-key` (one alone: owner ""; several: each named by its
    hash, stable across restarts, so its stored objects stay its own) and `--api-keys-file`
    (named).

    Raises:
        ModelConfigError: an unreadable or malformed file, an empty key, a key twice.
    """
    import hashlib

    from .errors import ModelConfigError

    given = [k for k in (args.api_key or []) if k is not None]
    out = ([("", given[0])] if len(given) == 1 and not args.api_keys_file else
           [("key-" + hashlib.sha256(k.encode()).hexdigest()[:16], k) for k in given])
    if args.api_keys_file:
        try:
            named = json.loads(open(args.api_keys_file).read())
        except (OSError, ValueError) as e:
            raise ModelConfigError(f"--api-keys-file {args.api_keys_file}: {e}") from None
        if not isinstance(named, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in named.items()):
            raise ModelConfigError(f"--api-keys-file {args.api_keys_file}: a JSON object "
                                   "{name: key} of strings")
        out += list(named.items())
    keys = [k for _, k in out]
    if any(not k for k in keys):
        raise ModelConfigError("an API key cannot be empty")
    if len(set(keys)) != len(keys):
        raise ModelConfigError("an API key is given twice")
    return tuple(out)


def serve_target(args: argparse.Namespace, shard_group: Any = None) -> Any:
    """What `specdec serve` serves: the Engine of its one model (loaded now, the target
    sharded over `shard_group` when given), or a `server.fleet.Fleet` of several by name,
    each loaded on its first request.

    Raises:
        ModelConfigError: the models' configuration is invalid (nothing is loaded).
    """
    from server.fleet import Fleet

    from .catalog import build
    from .engine import Engine
    from .errors import ModelConfigError

    cat = build(args.model, args.models_file, args.default_model, engine_config(args),
                args.models_dir)
    if args.max_loaded is not None and args.max_loaded < 1:
        raise ModelConfigError(f"--max-loaded {args.max_loaded}: at least 1")
    budget = memory_budget(args.memory_budget)
    if len(cat.models) == 1:
        spec = cat.models[0]
        engine = Engine.load(spec.path, spec.config, shard_group=shard_group)
        if spec.name == engine.target.name and not args.models_file and not args.models_dir:
            return engine
        return Fleet(cat, lambda m: Engine.load(m.path, m.config), loaded={spec.name: engine})
    if shard_group is not None:
        raise ModelConfigError("a sharded target (specdec launch) serves one model")
    if args.load_wait < 0:
        raise ModelConfigError(f"--load-wait {args.load_wait:g}: seconds, at least 0")
    return Fleet(cat, lambda m: Engine.load(m.path, m.config), args.max_loaded,
                 memory_budget=budget, load_wait_s=args.load_wait)


MEMORY_BUDGET_SHARE = 0.5  # of the machine's memory, for --memory-budget auto


def memory_budget(value: str) -> int | None:
    """--memory-budget in bytes (None: no limit)."""
    import os

    from .errors import ModelConfigError

    if value == "none":
        return None
    if value == "auto":
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
                   * MEMORY_BUDGET_SHARE)
    try:
        mb = int(value)
    except ValueError:
        mb = 0
    if mb < 1:
        raise ModelConfigError(f"--memory-budget {value!r}: megabytes (an integer >= 1), "
                               "'auto' or 'none'")
    return mb << 20


def cmd_serve(args: argparse.Namespace) -> int:
    from server.app import serve  # the launcher lives with the server

    from . import distributed
    from .engine import Engine

    g = distributed.group()  # started by mlx.launch: the target is sharded over the ranks
    served = serve_target(args, shard_group=g)
    channel = distributed.Channel(g) if g is not None else None
    config = serve_config(args, channel)
    if channel is not None and channel.rank != 0:
        import logging

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        engine = served if isinstance(served, Engine) else served.default.engine
        return distributed.follow(engine, channel, config.max_batch)
    serve(served, config)
    return 0


def cmd_launch(args: argparse.Namespace) -> int:
    from . import distributed

    rest = list(args.command)
    if rest and rest[0] == "--":
        rest = rest[1:]
    if not rest:
        print("specdec launch: give the specdec command to run, e.g. "
              "`specdec launch -n 2 -- serve --model DIR`", file=sys.stderr)
        return 2
    return distributed.launch(args.n, rest, args.launcher_arg)


def main(argv: list[str] | None = None) -> int:
    from .blas import ensure_blas
    from .blas import request as request_blas
    from .errors import BlasError, SpecdecError

    args = build_parser().parse_args(argv)
    try:
        if args.blas is not None:
            request_blas(args.blas)  # as SPECDEC_BLAS, for the re-exec and its children
        ensure_blas()
    except BlasError as e:
        print(f"specdec: {e}", file=sys.stderr)
        return 2
    handlers = {"generate": cmd_generate, "info": cmd_info, "serve": cmd_serve,
                "distill": cmd_distill, "launch": cmd_launch}
    try:
        return handlers[args.cmd](args)
    except SpecdecError as e:
        if e.kind == "internal":  # a fault of ours, not bad input: one line, nothing past it
            print(f"specdec: internal error: {e}; no output past that point was emitted",
                  file=sys.stderr)
            return 1
        print(f"specdec: error: {e}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as e:
        print(f"specdec: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
