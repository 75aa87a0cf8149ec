"""The bytes each token stands for, as OpenAI's logprobs report them (`bytes`, and `token` their text).

A token is often not a whole character: byte-level BPE (GPT-2, Llama 3, Qwen) splits a multi-byte character over
tokens, and SentencePiece's byte fallback (Llama 2, Mistral, Phi-3) writes rare characters as `<0xE4>`-style byte
tokens. Decoding such a token alone gives U+FFFD, so its bytes are read from the vocabulary the way the tokenizer's
decoder reads them: byte-level symbols through GPT-2's byte <-> unicode table; SentencePiece pieces with `▁` as a space
and byte-fallback pieces as their byte. Added tokens (`<|im_end|>`) are their content. Anything else (a decoder of
another kind) is the token decoded alone.

`TokenBytes(tokenizer)(token_id)` -> bytes, None where the tokenizer cannot say (an id outside it, a stand-in without
`decode`): a logprob then names its id only, and no job fails for it. `.text(token_id)` -> those bytes as text, a
partial character as U+FFFD (what vLLM shows as the token), "" for None. Cached per id; nothing here imports torch.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    """The inverse of GPT-2's `bytes_to_unicode`: printable Latin-1 bytes are themselves, the others 256 + n."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def _decoder_kind(tokenizer: Any) -> str:
    """ "byte_level", "sentencepiece" (a `▁` Replace with ByteFallback) or "other", from the fast tokenizer's decoder."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return "other"
    state = json.loads(decoder.__getstate__())
    parts = state.get("decoders", [state]) if state.get("type") == "Sequence" else [state]
    types = {p.get("type") for p in parts}
    if "ByteLevel" in types:
        return "byte_level"
    spaces = any(p.get("type") == "Replace" and p.get("pattern", {}).get("String") == "▁" for p in parts)
    return "sentencepiece" if spaces and "ByteFallback" in types else "other"


class TokenBytes:
    """Token id -> the bytes it stands for (see the module's docstring); cached."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._kind = _decoder_kind(tokenizer)
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self._added = {i: str(t) for i, t in added.items()}
        self._cache: dict[int, bytes | None] = {}

    def __call__(self, token_id: int) -> bytes | None:
        if token_id not in self._cache:
            try:
                self._cache[token_id] = self._bytes(token_id)
            except (AttributeError, TypeError, ValueError, IndexError, OverflowError, KeyError):
                self._cache[token_id] = None
        return self._cache[token_id]

    def text(self, token_id: int) -> str:
        raw = self(token_id)
        return raw.decode("utf-8", errors="replace") if raw is not None else ""

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode("utf-8")
        piece = self._tokenizer.convert_ids_to_tokens(token_id) if self._kind != "other" else None
        if isinstance(piece, str):
            if self._kind == "byte_level":
                table = _unicode_to_byte()
                if all(c in table for c in piece):
                    return bytes(table[c] for c in piece)
            else:
                byte = _BYTE_PIECE.fullmatch(piece)
                return bytes([int(byte.group(1), 16)]) if byte else piece.replace("▁", " ").encode("utf-8")
        return self._tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")
