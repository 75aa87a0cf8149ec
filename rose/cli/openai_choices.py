"""A job's result as the choices of OpenAI's chat and (legacy) completions responses, for `rose batch`'s OpenAI
output lines (rose.cli.openai_batch): each choice of the result (rose.jobs.contract.ChoiceResult; a job of one
choice is its own) becomes one, its logprobs in OpenAI's shapes (rose.jobs.logprobs), a chat message its tool calls
(rose.jobs.tools)."""

from __future__ import annotations

from typing import Any

from rose.jobs.logprobs import openai_chat_logprobs, openai_completion_logprobs, openai_prompt_logprobs


def openai_choices(result: dict[str, Any], chat: bool) -> dict[str, Any]:
    """A job's result (rose.jobs.contract.JobResult) as the `choices` of OpenAI's chat or completions response, and
    for a job with `prompt_logprobs` vLLM's `prompt_logprobs` (on the response for chat, on each choice for
    completions, as vLLM's OpenAI server puts them)."""
    # n > 1: every choice; otherwise the result is its one choice
    choices = [openai_choice(c, chat) for c in result.get("choices") or [{**result, "index": 0}]]
    entries = result.get("prompt_logprobs")
    if entries is None:
        return {"choices": choices}
    prompt_logprobs = openai_prompt_logprobs(entries)
    if chat:
        return {"choices": choices, "prompt_logprobs": prompt_logprobs}
    return {"choices": [{**c, "prompt_logprobs": prompt_logprobs} for c in choices]}


def openai_choice(choice: dict[str, Any], chat: bool) -> dict[str, Any]:
    """One choice of a job's result (rose.jobs.contract.ChoiceResult) as OpenAI's chat or completions choice."""
    # OpenAI knows stop / length / tool_calls (and a filter reason rose never has)
    finish_reason = choice.get("finish_reason")
    finish_reason = finish_reason if finish_reason in ("length", "tool_calls") else "stop"
    text = choice.get("text") or ""
    entries = choice.get("logprobs")  # a job that asked for them
    if not chat:
        logprobs = openai_completion_logprobs(entries) if entries is not None else None
        return {"index": choice["index"], "text": text, "finish_reason": finish_reason, "logprobs": logprobs}
    message = {"role": "assistant", "content": text, "refusal": None}
    if choice.get("tool_calls") is not None:  # a job with tools (rose.jobs.tools)
        message["content"] = choice.get("content")
        if choice["tool_calls"]:
            message["tool_calls"] = choice["tool_calls"]
    logprobs = openai_chat_logprobs(entries) if entries is not None else None
    return {
        "index": choice["index"],
        "message": message,
        "finish_reason": finish_reason,
        "logprobs": logprobs,
    }
