"""The models a server serves by name: `--model NAME=PATH` flags, models folders (each
model directory in one, named by its directory) and a models file (TOML or JSON), checked
whole before the server starts.

A models file:

    default = "smol"              # what `model: "default"` and no model name mean

    [models.smol]
    path = "default"              # the embedded model, a local mlx-lm directory or a cached
    aliases = ["small"]           # Hugging Face repo id, as `--model` takes
    pinned = true                 # never unloaded

    [models.qwen]
    path = "/models/Qwen3-0.6B-4bit"
    draft = "none"                # as --draft-model
    chat_template = "qwen.jinja"  # as --chat-template (relative to this file)
    reasoning_format = "think"    # as --reasoning-format
    max_kv_tokens = 65536         # as --max-kv-tokens
    grammar_cache_mb = 64         # as --grammar-cache-mb
    prompt_store_mb = 512         # as --prompt-store-mb
    ttl = 600                     # unloaded after this many idle seconds

Each entry starts from the command line's engine settings and replaces the fields it gives.
Every fault (a field of the wrong type, an unknown field, a duplicate name or alias, a path
that is not here, a draft whose tokenizer differs from its target's) is a `ModelConfigError`
naming the file, the line and the field.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .config import DEFAULT_DRAFT, DEFAULT_MODEL, EngineConfig
from .errors import ModelConfigError, SpecdecError

FIELDS = ("path", "aliases", "draft", "chat_template", "reasoning_format", "max_kv_tokens",
          "grammar_cache_mb", "prompt_store_mb", "pinned", "ttl")
DEFAULT_NAME = "default"  # the name every request may use for the default model


@dataclass(frozen=True)
class ModelSpec:
    """One served model, before it is loaded.

    Attributes:
        name: what requests name it by. path: what `models.load` takes. config: its engine
        settings. aliases: other names for it. pinned: never unloaded. ttl_s: unloaded
        after this many idle seconds (None: only to make room).
    """

    name: str
    path: str
    config: EngineConfig
    aliases: tuple[str, ...] = ()
    pinned: bool = False
    ttl_s: float | None = None


@dataclass(frozen=True)
class Catalog:
    """Every served model, and the default's name."""

    models: tuple[ModelSpec, ...]
    default: str

    def named(self, name: str) -> ModelSpec | None:
        """The model a request's name (a name or an alias; "default") means, or None."""
        if name == DEFAULT_NAME:
            name = self.default
        return next((m for m in self.models if name == m.name or name in m.aliases), None)


def build(flags: list[str], files: list[str], default: str | None,
          base: EngineConfig, folders: Sequence[str] = ()) -> Catalog:
    """The catalog of `--model` flags (`NAME=PATH` or `PATH`), models folders and models
    files, all with `base`'s settings unless a file's entry replaces some; the default is
    `default`, else the file's, else the first model.

    Raises:
        ModelConfigError: what is wrong, and where.
    """
    specs: list[ModelSpec] = []
    for flag in flags:
        name, _, path = flag.rpartition("=") if _named(flag) else ("", "", flag)
        specs.append(ModelSpec(name or _served_name(path, "--model"), path, base))
    for folder in folders:
        found = sorted(d for d in Path(folder).expanduser().iterdir()
                       if (d / "config.json").exists() or _is_gguf(d)) \
            if Path(folder).is_dir() else []
        if not found:
            raise ModelConfigError(f"--models-dir {folder}: no model directories (with a "
                                   "config.json) or GGUF files in it")
        specs.extend(ModelSpec(d.stem if _is_gguf(d) else d.name, str(d), base) for d in found)
    for f in files:
        more, chosen = read_file(Path(f), base)
        specs.extend(more)
        default = default or chosen
    if not specs:
        specs.append(ModelSpec(_served_name(DEFAULT_MODEL, "--model"), DEFAULT_MODEL, base))
    seen: dict[str, str] = {}
    for m in specs:
        for n in (m.name, *m.aliases):
            if n == DEFAULT_NAME:
                raise ModelConfigError(f"model {m.name!r}: {DEFAULT_NAME!r} is reserved "
                                       "(requests name the default model so); pick another")
            if n in seen:
                raise ModelConfigError(f"{n!r} names two models ({seen[n]!r} and {m.name!r}); "
                                       "a name or alias must be unique")
            seen[n] = m.name
    catalog = Catalog(tuple(specs), default or specs[0].name)
    if catalog.named(catalog.default) is None:
        raise ModelConfigError(f"the default model {catalog.default!r} is none of the models "
                               f"served ({', '.join(m.name for m in specs)})")
    for m in specs:
        check_draft_tokenizer(m)
    return catalog


def _named(flag: str) -> bool:
    """`NAME=PATH` (a name holds no path separator), not a path with '=' in it."""
    name, eq, _ = flag.partition("=")
    return bool(eq) and bool(name) and "/" not in name and not Path(flag).exists()


def _served_name(path: str, where: str) -> str:
    from .models import resolve_model_path, served_name

    if _is_gguf(Path(path).expanduser()):  # named by its file: converted when it loads
        return Path(path).stem
    return served_name(path, _resolve(path, where, resolve_model_path))


def _is_gguf(path: Path) -> bool:
    return path.suffix.lower() == ".gguf" and path.is_file()


def _resolve(path: str, where: str, resolve: Any) -> Path:
    try:
        return Path(resolve(path))
    except SpecdecError as e:
        raise ModelConfigError(f"{where}: {e}") from None


def read_file(path: Path, base: EngineConfig) -> tuple[list[ModelSpec], str | None]:
    """A models file's models and its default (None: not given).

    Raises:
        ModelConfigError: naming the file, the line and the field at fault.
    """
    try:
        text = path.read_text()
    except OSError as e:
        raise ModelConfigError(f"{path}: cannot read the models file: {e}") from None
    try:
        doc = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except json.JSONDecodeError as e:
        raise ModelConfigError(f"{path}:{e.lineno}: not valid JSON: {e.msg}") from None
    except tomllib.TOMLDecodeError as e:
        raise ModelConfigError(f"{path}: not valid TOML: {e}") from None
    if not isinstance(doc, dict):
        raise ModelConfigError(f"{path}:1: a models file is an object of 'default' and "
                               "'models'")

    def fail(message: str, *keys: str) -> ModelConfigError:
        return ModelConfigError(f"{path}:{_line_of(text, keys)}: {'.'.join(keys)}: {message}")

    for key in doc:
        if key not in ("default", "models"):
            raise fail("unknown field (a models file has 'default' and 'models')", key)
    default = doc.get("default")
    if default is not None and not isinstance(default, str):
        raise fail("must be a model's name", "default")
    entries = doc.get("models")
    if not isinstance(entries, dict) or not entries:
        raise fail("must be a table of one or more models by name", "models")
    specs = []
    for name, entry in entries.items():
        if not isinstance(entry, dict):
            raise fail("must be a table of the model's fields", "models", name)
        specs.append(_entry(path, name, entry, base,
                            lambda msg, f, n=name: fail(msg, "models", n, f)))
    return specs, default


def _entry(file: Path, name: str, entry: dict[str, Any], base: EngineConfig,
           fail: Any) -> ModelSpec:
    from .chat import protocol_named
    from .models import resolve_model_path

    for key in entry:
        if key not in FIELDS:
            raise fail(f"unknown field (a model has {', '.join(FIELDS)})", key)
    path = entry.get("path")
    if not isinstance(path, str) or not path:
        raise fail("required: the model's directory, a cached repo id, or 'default'", "path")
    if path != DEFAULT_MODEL and not Path(path).expanduser().is_absolute() and \
            (file.parent / path).exists():
        path = str(file.parent / path)
    try:
        resolve_model_path(path)
    except SpecdecError as e:
        raise fail(str(e), "path") from None
    aliases = entry.get("aliases", [])
    if not isinstance(aliases, list) or not all(isinstance(a, str) and a for a in aliases):
        raise fail("must be a list of names", "aliases")
    pinned = entry.get("pinned", False)
    if not isinstance(pinned, bool):
        raise fail("must be true or false", "pinned")
    ttl = entry.get("ttl")
    if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, (int, float))
                            or ttl <= 0):
        raise fail("must be a number of seconds > 0", "ttl")
    if pinned and ttl is not None:
        raise fail("a pinned model is never unloaded: leave out ttl or pinned", "ttl")
    config = base
    defaults: dict[str, Any] = {}
    if "draft" in entry:
        if not isinstance(entry["draft"], str):
            raise fail("must be 'auto', 'none', 'self' or a model", "draft")
        config = replace(config, draft=entry["draft"])
    if "chat_template" in entry:
        t = entry["chat_template"]
        try:
            defaults["chat_template"] = (file.parent / Path(t).expanduser()).read_text()
        except (OSError, TypeError) as e:
            raise fail(f"cannot read the template file: {e}", "chat_template") from None
    if "reasoning_format" in entry:
        fmt = defaults["reasoning_format"] = str(entry["reasoning_format"])
        try:
            protocol_named(fmt)
        except SpecdecError as e:
            raise fail(str(e), "reasoning_format") from None
    if "max_kv_tokens" in entry:
        kv = entry["max_kv_tokens"]
        if kv not in ("auto", "none") and (isinstance(kv, bool) or not isinstance(kv, int)
                                           or kv < 1):
            raise fail("must be an integer >= 1, 'auto' or 'none'", "max_kv_tokens")
        config = replace(config, max_kv_tokens=None if kv == "none" else kv)
    for key in ("grammar_cache_mb", "prompt_store_mb"):
        if key in entry:
            mb = entry[key]
            if isinstance(mb, bool) or not isinstance(mb, int) or mb < 0:
                raise fail("must be an integer >= 0 (megabytes)", key)
            config = replace(config, **{key: mb})
    if defaults:
        config = replace(config, defaults=replace(config.defaults, **defaults))
    return ModelSpec(name, path, config, tuple(aliases), pinned,
                     None if ttl is None else float(ttl))


def _line_of(text: str, keys: tuple[str, ...]) -> int:
    """The line a field is on (TOML's `[models.NAME]` table, or JSON's nesting), read by
    its keys in order; the last line found, else 1."""
    lines, at = text.splitlines(), 0
    for i, key in enumerate(keys):
        heads = (f"[{'.'.join(keys[:i + 1])}]", f'"{key}"', f"{key} =", f"{key}=",
                 f'"{key}" =')
        for n in range(at, len(lines)):
            if lines[n].strip().startswith(heads) or (i and f'"{key}"' in lines[n]):
                at = n
                break
    return at + 1


def check_draft_tokenizer(m: ModelSpec) -> None:
    """Refuse, before anything loads, a draft whose tokenizer is not its target's.

    Raises:
        ModelConfigError: the draft is missing or its vocabulary differs.
    """
    from .models import resolve_model_path

    draft = m.config.draft_for(m.path)
    if draft is None or draft == "self" or (draft == DEFAULT_DRAFT and m.path == DEFAULT_MODEL):
        return
    where = f"model {m.name!r}: draft"
    d = _resolve(draft, where, resolve_model_path)
    t = _resolve(m.path, f"model {m.name!r}", resolve_model_path)
    if (d / "token_map.json").exists():
        return  # a distilled draft: its ids are mapped onto the target's
    from transformers import AutoTokenizer

    try:
        same = AutoTokenizer.from_pretrained(str(d)).get_vocab() == \
            AutoTokenizer.from_pretrained(str(t)).get_vocab()
    except (OSError, ValueError) as e:
        raise ModelConfigError(f"{where} {draft!r}: cannot read its tokenizer: {e}") from None
    if not same:
        raise ModelConfigError(f"{where} {draft!r} uses a different tokenizer than its "
                               "target; speculation needs the same token ids")
