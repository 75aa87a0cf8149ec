"""Incremental detokenization with stop strings.

Guarantees: no delta ends in half a UTF-8 character, and the concatenation of all deltas equals the final text.
Text that could still be the start of a stop string is held back until it is resolved.
"""

from __future__ import annotations

from typing import Any

from tokenizers.decoders import DecodeStream

_CONTEXT_TOKENS = (
    6  # prompt tokens given to the decoder so the first output token is spaced as in a full decode
)


class _SlowStream:
    """DecodeStream's contract for tokenizers without a Rust backend: decode a small window, emit the new suffix."""

    def __init__(self, tokenizer: Any, ids: list[int], skip_special_tokens: bool) -> None:
        self.tokenizer, self.ids, self.skip = tokenizer, list(ids), skip_special_tokens
        self.prefix = len(self.ids)

    def step(self, _tokenizer: Any, token_id: int) -> str | None:
        self.ids.append(token_id)
        start = max(0, self.prefix - _CONTEXT_TOKENS)
        before = self.tokenizer.decode(self.ids[start : self.prefix], skip_special_tokens=self.skip)
        after = self.tokenizer.decode(self.ids[start:], skip_special_tokens=self.skip)
        if after.endswith("\ufffd") or len(after) < len(before):
            return None
        self.ids, self.prefix = self.ids[start:], len(self.ids) - start
        return after[len(before) :]


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        *,
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
    ) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._tok = backend if backend is not None else tokenizer
        self._skip = skip_special_tokens
        # Seed the decoder with the prompt's tail, up to its last complete character: bytes of a character the
        # prompt leaves unfinished are fed as pending, so the first output token completes it without re-emitting
        # the prompt's text.
        tail = prompt_token_ids[-_CONTEXT_TOKENS:]
        clean = len(tail)
        while clean and self._decode(tail[:clean]).endswith("\ufffd"):
            clean -= 1
        context, partial = tail[:clean], tail[clean:]
        if backend is not None:
            self._stream: Any = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        else:
            self._stream = _SlowStream(tokenizer, context, skip_special_tokens)
        for token_id in partial:
            self._stream.step(self._tok, token_id)
        self._context = list(context)  # ids decoded so far (a short tail), to flush pending bytes at the end
        self._pending: list[int] = list(partial)  # ids whose bytes do not yet form complete characters
        self._pending_output = (
            False  # whether any pending id was generated (prompt bytes alone are not flushed)
        )
        self.stop = stop or []
        self.include_stop = include_stop_str_in_output
        self._max_stop = max((len(s) for s in self.stop), default=0)
        self.text = ""  # decoded text so far, cut at a stop string once one is found
        self._emitted = 0  # how much of self.text has been handed out
        # text up to here came with stop strings deferred (min_tokens): a stop string ending there never counts
        self._stop_floor = 0
        self.stop_reason: str | None = None

    @property
    def emitted_text(self) -> str:
        return self.text[: self._emitted]

    def update(self, token_id: int, *, decode: bool = True, check_stop: bool = True) -> str:
        """Feed one generated token; returns the new text that is safe to hand out (maybe "").

        decode=False skips the token's text (a stop token); check_stop=False defers stop strings (min_tokens).
        """
        if decode and self.stop_reason is None:
            piece = self._stream.step(self._tok, token_id)
            if piece is None:
                self._pending.append(token_id)
                self._pending_output = True
            else:
                self._context = (self._context + self._pending + [token_id])[-_CONTEXT_TOKENS:]
                self._pending = []
                self._pending_output = False
                self.text += piece
                if not check_stop:
                    self._stop_floor = len(self.text)
                elif self.stop:
                    self._check_stop(len(self.text) - self._emitted)
        return self._take(final=self.stop_reason is not None)

    def finish(self) -> str:
        """The request ended: flush incomplete bytes (as replacement characters) and any held-back text."""
        if self._pending_output and self.stop_reason is None:
            before = self._decode(self._context)
            self.text += self._decode(self._context + self._pending)[len(before) :]
            self._pending = []
            if self.stop:
                self._check_stop(len(self.text) - self._emitted)
        return self._take(final=True)

    def token_text(self, token_id: int) -> str:
        """One token's text on its own, as this detokenizer decodes (special tokens skipped or not)."""
        return self._decode([token_id])

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def _check_stop(self, new_chars: int) -> None:
        # a stop string found here must end inside the new text, after any deferred text (vLLM V1); it may start
        # in held-back or deferred text
        start = max(self._emitted, len(self.text) - new_chars - self._max_stop + 1)
        best: tuple[int, str] | None = None
        for s in self.stop:
            idx = self.text.find(s, max(start, self._stop_floor - len(s) + 1))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is not None:
            idx, s = best
            self.stop_reason = s
            self.text = self.text[: idx + len(s) if self.include_stop else idx]

    def _held_back(self) -> int:
        """Length of the longest suffix of the unsent text that is a proper prefix of some stop string."""
        unsent = len(self.text) - self._emitted
        for k in range(min(self._max_stop - 1, unsent), 0, -1):
            suffix = self.text[-k:]
            if any(s.startswith(suffix) for s in self.stop):
                return k
        return 0

    def _take(self, final: bool) -> str:
        end = len(self.text) if final or not self.stop else len(self.text) - self._held_back()
        delta = self.text[self._emitted : end]
        self._emitted = max(self._emitted, end)
        return delta
