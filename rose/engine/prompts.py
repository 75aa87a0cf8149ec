"""Prompts as the engine takes them: text, token ids, or vLLM's TokensPrompt dict."""

from __future__ import annotations

from typing import Any


def tokenize_prompt(
    prompt: str | list[int] | dict[str, Any], tokenizer: Any, vocab_size: int
) -> tuple[str | None, list[int]]:
    """A request's prompt as (its text if any, its token ids). Raises ValueError / TypeError naming the problem.

    `prompt`: text (encoded with the tokenizer's special tokens), token ids, or vLLM's TokensPrompt
    `{"prompt_token_ids": [...], "prompt": text}` (ids used as they are; the text is only echoed).
    """
    if isinstance(prompt, dict):
        unknown = set(prompt) - {"prompt", "prompt_token_ids"}
        if unknown or "prompt_token_ids" not in prompt:
            raise ValueError("a prompt dict takes 'prompt_token_ids' and an optional 'prompt' (its text)")
        text = prompt.get("prompt")
        if text is not None and not isinstance(text, str):
            raise TypeError(f"prompt['prompt'] must be a str, got {type(text).__name__}")
        ids = prompt["prompt_token_ids"]
        if not isinstance(ids, list | tuple):
            raise TypeError(
                f"prompt['prompt_token_ids'] must be a list of token ids, got {type(ids).__name__}"
            )
        return text, tokenize_prompt(list(ids), tokenizer, vocab_size)[1]
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer; this engine has none: pass token ids instead")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate: the tokenizer would raise a bare TypeError
            raise ValueError(
                f"the prompt is not valid Unicode text: a lone surrogate {prompt[exc.start]!a} at index {exc.start}"
            ) from None
        ids = list(tokenizer.encode(prompt))
        text = prompt
    elif isinstance(prompt, list | tuple) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        ids, text = list(prompt), None
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {vocab_size}), got {bad[:5]}")
    else:
        raise TypeError(f"prompt must be a str or a list of token ids, got {type(prompt).__name__}")
    if not ids:
        raise ValueError("the prompt is empty: it must have at least one token")
    return text, ids


def room_to_generate(prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> int:
    """The tokens a request may generate: its `max_tokens`, or (None) what the context leaves after its prompt.
    Raises ValueError when the prompt and max_tokens do not fit in `max_model_len`."""
    if prompt_tokens and max_tokens is None and prompt_tokens >= max_model_len:
        raise ValueError(
            f"prompt has {prompt_tokens} tokens, which leaves no room to generate within max_model_len "
            f"{max_model_len}"
        )
    most = max_tokens if max_tokens is not None else max_model_len - prompt_tokens
    if prompt_tokens + most > max_model_len:
        raise ValueError(
            f"prompt ({prompt_tokens} tokens) + max_tokens ({most}) = {prompt_tokens + most} exceeds "
            f"max_model_len {max_model_len}: shorten the prompt or lower max_tokens"
        )
    return most
