"""A lower bound on a request's prompt tokens that needs no rendering or tokenizing
(`PromptBound`), from what the tokenizer can do to text (`text_shrink`): so that a prompt
that cannot fit the context is refused before any work on it.

Tokenizer knowledge, so it lives in the library; the server keeps one bound per loaded
model and checks each request against it before rendering (`server.door`). It imports the
floor only (the request and its errors).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from llguidance import LLTokenizer

from .errors import RequestError
from .request import GenerateRequest


@dataclass(frozen=True)
class PromptBound:
    """A lower bound on a request's prompt tokens that needs no rendering or tokenizing, so
    a prompt that cannot fit the context is refused before any work on it.

    Each turn costs at least one token (its role marker, in every template); the text of
    the user and tool turns (which no template drops, as some drop past reasoning), or a
    raw prompt, at least its UTF-8 bytes over `bytes_per_token`: the most text bytes one
    token can stand for, through the tokenizer's normalizer. Token ids count as themselves.

    Attributes:
        context: the model's context length (tokens).
        bytes_per_token: None where the tokenizer may delete text (no text bound).
    """

    context: int
    bytes_per_token: float | None

    @staticmethod
    def of(context: int, hf_tokenizer: Any, llt: LLTokenizer) -> PromptBound:
        """The bound of a model.

        Args:
            context: its context length (tokens).
            hf_tokenizer: its Hugging Face tokenizer (what its normalizer does to text).
            llt: the same vocabulary as llguidance reads it (each token's bytes).
        """
        shrink = text_shrink(hf_tokenizer)
        if shrink is None:
            return PromptBound(context, None)
        longest = max(len(llt.decode_bytes([t])) for t in range(llt.vocab_size))
        return PromptBound(context, max(longest, 4) * shrink)  # 4: an unknown character

    def at_least(self, greq: GenerateRequest) -> int:
        """Tokens the request's prompt has at least."""
        p = greq.prompt
        if p is not None and not isinstance(p, str):
            return len(p)
        texts = [p] if isinstance(p, str) else [m.content for m in greq.messages
                                                 if m.role in ("user", "tool")]
        turns = len(greq.messages)
        if self.bytes_per_token is None:
            return turns
        size = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
        return max(turns, math.ceil(size / self.bytes_per_token))

    def check(self, greq: GenerateRequest) -> None:
        """Raises:
            RequestError: `context_length_exceeded` (param "messages" or "max_tokens")."""
        n = self.at_least(greq)
        if n >= self.context:
            raise RequestError(f"the prompt has at least {n} tokens; the context length is "
                               f"{self.context}", param="messages",
                               code="context_length_exceeded")
        if greq.max_tokens is not None and n + greq.max_tokens > self.context:
            raise RequestError(f"asks for more output tokens than the context length "
                               f"{self.context} leaves after a prompt of at least {n} "
                               f"(at most {self.context - n})", param="max_tokens",
                               code="context_length_exceeded")


# How many bytes of text a normalizer may turn into one: Unicode normalization maps a 4-byte
# character to one byte at most (NFKC: U+1D400 -> "A"); lowercasing a 3-byte one (U+212A).
_SHRINK = {"NFC": 4.0, "NFD": 4.0, "NFKC": 4.0, "NFKD": 4.0, "Lowercase": 3.0,
           "Prepend": 1.0}
_KEEPS_TEXT = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "Split", "UnicodeScripts"}


def text_shrink(hf_tokenizer: Any) -> float | None:
    """The factor by which a Hugging Face fast tokenizer's normalizer can shrink text (1:
    none), or None where it or its pre-tokenizer may delete text (strip, whitespace
    splitting, a removing split), added tokens swallow whitespace, or unknown text may fuse
    into one token."""
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    model = backend.model
    if type(model).__name__ != "BPE" or (model.unk_token and model.fuse_unk
                                         and not model.byte_fallback):
        return None
    added = getattr(hf_tokenizer, "added_tokens_decoder", {}) or {}
    if any(t.lstrip or t.rstrip for t in added.values()):
        return None

    def norm(n: dict[str, Any]) -> float | None:
        if n["type"] == "Sequence":
            out: float | None = 1.0
            for part in n["normalizers"]:
                f = norm(part)
                out = None if f is None or out is None else out * f
            return out
        if n["type"] == "Replace" and "String" in n["pattern"] and n["content"]:
            return max(1.0, len(n["pattern"]["String"].encode()) / len(n["content"].encode()))
        return _SHRINK.get(n["type"])

    def keeps(p: dict[str, Any]) -> bool:
        if p["type"] == "Sequence":
            return all(keeps(q) for q in p["pretokenizers"])
        return p["type"] in _KEEPS_TEXT and p.get("behavior") != "Removed"

    try:
        n, p = backend.normalizer, backend.pre_tokenizer
        shrink = 1.0 if n is None else norm(json.loads(n.__getstate__()))
        if p is not None and not keeps(json.loads(p.__getstate__())):
            return None
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    return shrink
