"""Offline API (vLLM's `LLM`): a thin loop over `Engine`."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator, Sequence
from typing import Any

from transformers import PreTrainedModel

from rose.engine.chat import ChatOptions, ChatTemplateError, render_chat
from rose.engine.config import EngineConfig
from rose.engine.engine import Engine
from rose.engine.lora import LoRARequest
from rose.engine.outputs import RequestOutput, StepOutput
from rose.engine.sampling_params import SamplingParams

PromptType = str | list[int] | dict[str, Any]
Conversation = list[dict[str, Any]]


class LLM:
    """Generate for many prompts at once with continuous batching.

    The engine's options (rose.engine.config.EngineConfig: device, dtype, max_num_seqs, max_model_len, ...) are
    keyword arguments, as in vLLM, or an `EngineConfig` as `config`.

    >>> llm = LLM(model="tiny-llama", device="cpu")
    >>> outs = llm.generate(["Hello", "Bonjour"], SamplingParams(temperature=0, max_tokens=8))
    """

    def __init__(
        self,
        model: str | os.PathLike | PreTrainedModel,
        tokenizer: Any = None,
        config: EngineConfig | None = None,
        **options: Any,
    ) -> None:
        self.engine = Engine(model, tokenizer, config, **options)
        self._ids = itertools.count()
        self._inbox: dict[str, list[StepOutput]] = {}  # step outputs not yet read, per request of this LLM

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order. `lora_request` (vLLM's): the adapter
        for every prompt, or one per prompt (None: the base model); the LLM needs `enable_lora=True`."""
        prompt_list = _normalize_prompts(prompts)
        default = SamplingParams()
        params_list = [
            p if p is not None else default
            for p in _one_each(sampling_params, SamplingParams, len(prompt_list), "sampling_params", "prompt")
        ]
        if priority is not None and len(priority) != len(prompt_list):
            raise ValueError(
                f"got {len(priority)} priority values for {len(prompt_list)} prompts: pass one per prompt"
            )
        loras = _one_each(lora_request, LoRARequest, len(prompt_list), "lora_request", "prompt")
        ids = [str(next(self._ids)) for _ in prompt_list]
        try:
            for i, (rid, prompt, params) in enumerate(zip(ids, prompt_list, params_list, strict=True)):
                self._add(rid, prompt, params, priority[i] if priority else 0, loras[i])
            results = self._run(ids, use_tqdm)
        finally:
            self._release(ids)
        return results

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: render each conversation with the tokenizer's chat template (or `chat_template`) and
        generate for all of them at once; outputs come back in input order, each with the rendered text as its
        `prompt`.

        `messages` is one conversation (a list of OpenAI-format message dicts) or a list of conversations.
        Every conversation is rendered before any is queued, so a bad one (malformed message, no chat template,
        a template that raises) raises `rose.engine.chat.ChatTemplateError` (a ValueError) naming the
        conversation and runs nothing.

        `tools` (OpenAI-format, as vLLM's): rendered into every prompt by the chat template; reading calls out of
        the outputs is up to the caller (rose.engine.tool_calls: `get_tool_parser(...).parse(out.text)`).

        `lora_request` (vLLM's): the LoRA adapter for every conversation, or one per conversation (None: the base
        model), as `generate` takes it; the LLM needs `enable_lora=True`.
        """
        conversations = _normalize_conversations(messages)
        options = ChatOptions(
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template=chat_template,
            chat_template_kwargs=dict(chat_template_kwargs or {}),
            tools=tools,
        )
        # checked before rendering, in the conversations' terms; generate takes them one per prompt
        params_list = _one_each(
            sampling_params, SamplingParams, len(conversations), "sampling_params", "conversation"
        )
        loras = _one_each(lora_request, LoRARequest, len(conversations), "lora_request", "conversation")
        prompts: list[PromptType] = []
        for i, conversation in enumerate(conversations):
            try:
                rendered = render_chat(self.engine.tokenizer, conversation, options)
            except ChatTemplateError as exc:
                where = f"conversation {i}: " if len(conversations) > 1 else ""
                raise ChatTemplateError(f"{where}{exc}") from None
            prompts.append({"prompt": rendered.prompt, "prompt_token_ids": rendered.prompt_token_ids})
        return self.generate(prompts, params_list, use_tqdm=use_tqdm, lora_request=loras)

    def _add(
        self,
        rid: str,
        prompt: str | list[int] | dict[str, Any],
        params: SamplingParams,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.engine.add_request(rid, prompt, params, priority=priority, lora_request=lora_request)
        self._inbox[rid] = []

    def _release(self, ids: list[str]) -> None:
        """Forget requests (aborting any still running): their caller is done with them."""
        for rid in ids:
            if self._inbox.pop(rid, None) is not None:
                self.engine.abort(rid)

    def _step(self) -> None:
        """One engine step; each output goes to the inbox of the call that owns its request."""
        if not self.engine.has_unfinished():
            raise RuntimeError("the engine has nothing left to run but a request is still waiting for output")
        for out in self.engine.step():
            inbox = self._inbox.get(out.request_id)
            if inbox is not None:
                inbox.append(out)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="req")
        pending = set(ids)
        while pending:
            for rid in list(pending):
                for out in self._inbox[rid]:
                    if out.finished:
                        results[rid] = out.output
                        pending.discard(rid)
                        if bar is not None:
                            bar.update(1)
                self._inbox[rid].clear()
            if pending:
                self._step()
        if bar is not None:
            bar.close()
        return [results[rid] for rid in ids]

    def stream(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        *,
        lora_request: LoRARequest | None = None,
    ) -> Iterator[str]:
        """Yield the text of one request as it is generated (`lora_request`: its LoRA adapter, as `generate`'s).

        Other requests of this LLM (other streams, a generate call) advance in the same steps; none loses output.
        """
        params = sampling_params or SamplingParams()
        if params.n > 1:
            raise ValueError(
                "stream() yields one text: give SamplingParams.n = 1 (generate() returns n choices)"
            )
        rid = str(next(self._ids))
        (normalized,) = _normalize_prompts([prompt])
        self._add(rid, normalized, params, lora_request=lora_request)
        try:
            while True:
                inbox = self._inbox[rid]
                while inbox:
                    out = inbox.pop(0)
                    if out.new_text:
                        yield out.new_text
                    if out.finished:
                        return
                self._step()
        finally:
            self._release([rid])


def _one_each(value: Any, single: type, count: int, name: str, unit: str) -> list[Any]:
    """`value` (`sampling_params`, `lora_request`) for each of `count` prompts or conversations (`unit`): None or
    one `single` for all of them, else a sequence of one each (ValueError when its length is not `count`)."""
    if value is None or isinstance(value, single):
        return [value] * count
    values = list(value)
    if len(values) != count:
        raise ValueError(f"got {len(values)} {name} for {count} {unit}s: pass one, or one per {unit}")
    return values


def _normalize_conversations(messages: Any) -> list[Conversation]:
    """One conversation (a list of message dicts) or a list of them -> a list of conversations."""
    if not isinstance(messages, list | tuple) or not messages:
        raise ChatTemplateError(
            "messages must be a conversation (a non-empty list of {'role': ..., 'content': ...} dicts) or a "
            "non-empty list of conversations"
        )
    if all(isinstance(m, list | tuple) for m in messages):
        return [list(c) for c in messages]
    if any(isinstance(m, list | tuple) for m in messages):
        raise ChatTemplateError(
            "messages mixes message dicts and conversations (lists): give one or the other"
        )
    return [list(messages)]


def _normalize_prompts(prompts: PromptType | Sequence[PromptType]) -> list[str | list[int] | dict[str, Any]]:
    if isinstance(prompts, str | dict):
        prompts = [prompts]
    elif isinstance(prompts, list | tuple) and prompts and all(isinstance(t, int) for t in prompts):
        prompts = [list(prompts)]
    out: list[str | list[int] | dict[str, Any]] = []
    for p in prompts:
        if isinstance(p, dict):
            if "prompt_token_ids" in p:
                out.append(dict(p))  # TokensPrompt: ids, and optionally the text they came from
            elif "prompt" in p:
                out.append(p["prompt"])
            else:
                raise ValueError("a prompt dict needs a 'prompt' or a 'prompt_token_ids' key")
        else:
            out.append(p if isinstance(p, str) else list(p))
    return out
