"""Log-probabilities in a job's result and token events, and in OpenAI's shapes.

A job with `logprobs: k` gets, for each generated token, one entry (`LogprobEntry`): the token's id, its text and
bytes (rose.engine.token_bytes: a token that is part of a character has its own bytes, its text shows U+FFFD), its
log-probability, and the k most likely tokens at that position in `top_logprobs`, most likely first (k = 0: none).
The values are vLLM V1's default (raw logprobs: the model's distribution before logit_bias, penalties, temperature and
top-k/top-p; a structured output's grammar mask applies). A log-probability below -9999 (a token the model gives no
chance) is written as -9999.0, as vLLM's OpenAI server does: JSON has no -Infinity.

A job with `prompt_logprobs: k` (vLLM's) gets the same for its prompt: None for the first token (nothing comes
before it), then one entry per prompt token (`PromptLogprobEntry`, with vLLM's `rank` of the token: 1 = the most
likely).

`openai_chat_logprobs` and `openai_completion_logprobs` turn a result's entries into OpenAI's chat
(`choices[i].logprobs`) and legacy completions shapes, `openai_prompt_logprobs` into vLLM's OpenAI server's
`prompt_logprobs`. Nothing here imports torch.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypedDict

if TYPE_CHECKING:
    from rose.engine.outputs import TokenLogprob

__all__ = [
    "MIN_LOGPROB",
    "LogprobEntry",
    "PromptLogprobEntry",
    "TopLogprob",
    "logprob_entries",
    "openai_chat_logprobs",
    "openai_completion_logprobs",
    "openai_prompt_logprobs",
    "prompt_logprob_entries",
]

MIN_LOGPROB = -9999.0


class TopLogprob(TypedDict):
    token_id: int
    token: str
    bytes: list[int] | None
    logprob: float


class LogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob]


class PromptLogprobEntry(LogprobEntry):
    rank: int


def logprob_entries(
    logprobs: Iterable[TokenLogprob], token_bytes: Callable[[int], bytes | None] | None
) -> list[LogprobEntry]:
    """The entries of the engine's `logprobs` (one per generated token). `token_bytes`: token id -> its bytes
    (rose.engine.token_bytes.TokenBytes), None where unknown; None without a tokenizer (then `token` is "" and
    `bytes` None)."""

    def top(token_id: int, logprob: float) -> TopLogprob:
        raw = token_bytes(token_id) if token_bytes is not None else None
        return {
            "token_id": token_id,
            "token": raw.decode("utf-8", errors="replace") if raw is not None else "",
            "bytes": list(raw) if raw is not None else None,
            "logprob": max(logprob, MIN_LOGPROB),
        }

    return [
        {**top(lp.token_id, lp.logprob), "top_logprobs": [top(t, v) for t, v in lp.top.items()]}  # type: ignore[typeddict-item]
        for lp in logprobs
    ]


def prompt_logprob_entries(
    prompt_logprobs: Iterable[TokenLogprob | None], token_bytes: Callable[[int], bytes | None] | None
) -> list[PromptLogprobEntry | None]:
    """The entries of the engine's `prompt_logprobs` (None for the prompt's first token), as `logprob_entries`."""
    return [
        None if lp is None else {**logprob_entries([lp], token_bytes)[0], "rank": lp.rank}  # type: ignore[typeddict-item]
        for lp in prompt_logprobs
    ]


def openai_prompt_logprobs(entries: list[PromptLogprobEntry | None]) -> list[dict[str, Any] | None]:
    """vLLM's OpenAI `prompt_logprobs`: per prompt token None (the first) or {token id: {logprob, rank,
    decoded_token}} for the token itself, then its top k (ranks 1..k; the token's own entry takes its top-k rank
    when it is among them, as vLLM's)."""

    def one(entry: TopLogprob, rank: int) -> dict[str, Any]:
        return {"logprob": entry["logprob"], "rank": rank, "decoded_token": entry["token"]}

    out: list[dict[str, Any] | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        tokens = {str(e["token_id"]): one(e, e["rank"])}
        for rank, t in enumerate(
            e["top_logprobs"], 1
        ):  # a top-k rank wins over the counted one, as in vLLM's dict
            tokens[str(t["token_id"])] = one(t, rank)
        out.append(tokens)
    return out


def _openai_token(entry: TopLogprob) -> dict[str, Any]:
    return {"token": entry["token"], "logprob": entry["logprob"], "bytes": entry["bytes"]}


def openai_chat_logprobs(entries: list[LogprobEntry]) -> dict[str, Any]:
    """OpenAI's `choices[i].logprobs` of a chat completion (ChatCompletionTokenLogprob per token)."""
    return {
        "content": [
            {**_openai_token(e), "top_logprobs": [_openai_token(t) for t in e["top_logprobs"]]}
            for e in entries
        ],
        "refusal": None,
    }


def openai_completion_logprobs(entries: list[LogprobEntry]) -> dict[str, Any]:
    """OpenAI's legacy completions `choices[i].logprobs`: `tokens`, `token_logprobs`, `top_logprobs` (token text ->
    logprob: the k most likely and the chosen one) and `text_offset` (where each token starts in the completion's
    text, in characters: a token that starts inside a character points at that character)."""
    decoder, chars, offsets = codecs.getincrementaldecoder("utf-8")("replace"), 0, []
    for e in entries:
        offsets.append(chars)  # a character's bytes still pending count once they complete it
        chars += len(
            decoder.decode(bytes(e["bytes"]) if e["bytes"] is not None else e["token"].encode("utf-8"))
        )
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        # the chosen token too, as OpenAI's legacy API and vLLM give it (k + 1 entries when it is not in the top k)
        "top_logprobs": [
            {**{t["token"]: t["logprob"] for t in e["top_logprobs"]}, e["token"]: e["logprob"]}
            for e in entries
        ],
        "text_offset": offsets,
    }
