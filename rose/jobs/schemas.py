"""The keyword arguments of a `rose.jobs.generate` job, validated."""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, model_validator

from rose.engine.chat import ChatOptions, normalize_messages, render_chat
from rose.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from rose.engine.structured_check import check_constraint
from rose.engine.structured_outputs import StructuredOutputsParams
from rose.engine.tool_calls import check_tools, constraint_for

__all__ = [
    "INVALID_STRUCTURED_OUTPUT",
    "GenerateRequest",
    "ValidationError",
    "format_validation_error",
    "suggest_field",
]

# How a failed job's message starts when its JSON-constrained output broke its schema (the engine checks every such
# output: rose.engine.structured_check); the violation and the output's whole text follow. `rose batch` files the
# job's error line under this code.
INVALID_STRUCTURED_OUTPUT = "invalid_structured_output"


class GenerateRequest(BaseModel):
    """One generation job: a prompt (text, token ids or chat messages: exactly one), SamplingParams fields, an
    optional output constraint, optional metadata.

    Field names and meanings are vLLM's (and OpenAI's for `messages` and `response_format`). Unknown fields are
    rejected (a typo must not silently do nothing).
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    prompt: str | None = Field(None, description="Text prompt (needs a tokenizer on the worker).")
    prompt_token_ids: list[int] | None = Field(None, description="Prompt as token ids.")
    messages: list[dict[str, Any]] | None = Field(
        None, description="OpenAI-format chat messages, rendered with the model's chat template."
    )
    # chat rendering (only with `messages`)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = Field(
        None, description="A Jinja chat template (only where the worker allows it)."
    )
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="Extra template variables.")
    # tool calling (OpenAI's; only with `messages`): rose.engine.tool_calls, rose.jobs.tools
    tools: list[dict[str, Any]] | None = Field(
        None, description="OpenAI-format tools [{'type': 'function', 'function': {name, parameters, ...}}]."
    )
    tool_choice: str | dict[str, Any] | None = Field(
        None,
        description="'auto' (the default with tools: the worker's tool-call parser reads the calls), 'none', "
        "'required' or {'type': 'function', 'function': {'name': ...}} (decoded under the tools' JSON schema).",
    )
    # output constraint (at most one of the two)
    structured_outputs: dict[str, Any] | None = Field(
        None, description="vLLM's constraint: {json | regex | choice | grammar | json_object: ...}."
    )
    response_format: dict[str, Any] | None = Field(
        None,
        description="OpenAI's: {'type': 'json_object'} or {'type': 'json_schema', 'json_schema': {...}}.",
    )
    lora: str | None = Field(
        None,
        description="The LoRA adapter to generate with: a name the worker serves (rose-worker --enable-lora "
        "--lora-modules NAME=PATH); none: the base model.",
    )
    metadata: dict[str, Any] | None = Field(None, description="Any JSON object, echoed into the result.")
    priority: int = Field(0, description="Engine scheduling priority among waiting jobs (lower runs first).")
    tenant: str | None = Field(
        None,
        description="Who the job is for (a team, a customer); none: the default tenant.",
    )
    deadline: float | None = Field(
        None,
        description="Unix time (seconds) by which the job must be done. Among the engine's waiting jobs of one "
        "priority, those with a deadline start first, earliest deadline first; a job whose deadline passed "
        "before a worker started it (this attempt) fails with 'deadline exceeded' (no retry); one whose deadline "
        "passes while it runs goes on, or fails so on workers started with --deadline-policy abort.",
    )
    stream: bool = Field(
        True,
        description="Publish the tokens as they are generated; false: only the job's end is published (its "
        "terminal event), so a job nobody watches costs Redis nothing per token.",
    )

    # SamplingParams (same names, defaults and checks)
    n: int = Field(1, description="Choices sampled from the prompt (the result's `choices` when > 1).")
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    # OpenAI's form: token ids as JSON object keys (strings); Python callers may give ints
    logit_bias: dict[int | str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None

    @model_validator(mode="after")
    def _check(self, info: ValidationInfo) -> GenerateRequest:
        for name in (
            "prompt", "messages", "stop", "bad_words", "chat_template", "chat_template_kwargs", "tools", "lora",
            "tenant",
        ):  # fmt: skip
            where = _lone_surrogate(getattr(self, name), name)
            if where is not None:  # the tokenizer would raise a TypeError deep down, on every retry alike
                raise ValueError(
                    f"{where} is not valid Unicode text: it holds a lone surrogate; encode the text as UTF-8 "
                    "(a JSON \\ud800-\\udfff escape must come as a high + low pair)"
                )
        given = [n for n in ("prompt", "prompt_token_ids", "messages") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(
                "give exactly one of 'prompt' (text), 'prompt_token_ids' (list of int) or 'messages' (chat)"
                + (f", got {' and '.join(given)}" if given else "")
            )
        if self.prompt is not None and self.prompt == "":
            raise ValueError("'prompt' is empty")
        if self.lora is not None and not self.lora.strip():
            raise ValueError(
                "'lora' is empty: name an adapter the workers serve, or leave it out (the base model)"
            )
        if self.tenant is not None and not self.tenant.strip():
            raise ValueError("'tenant' is empty: name the tenant, or leave it out (the default tenant)")
        if self.deadline is not None:
            check_deadline(self.deadline)
        if self.prompt_token_ids is not None:
            if not self.prompt_token_ids:
                raise ValueError("'prompt_token_ids' is empty")
            if any(t < 0 for t in self.prompt_token_ids):
                raise ValueError("'prompt_token_ids' must hold non-negative integers")
        if self.messages is not None:
            normalize_messages(self.messages)
            check_tools(self.tools, self.tool_choice)
            self.chat_options()
        else:
            chat_set = [n for n in _CHAT_FIELDS if n in self.model_fields_set]
            if chat_set:
                raise ValueError(f"{', '.join(chat_set)} only apply to 'messages' jobs")
        if self.structured_outputs is not None and self.response_format is not None:
            raise ValueError("give at most one of 'structured_outputs' and 'response_format'")
        forced = self.forces_tool_calls
        if forced and (self.structured_outputs is not None or self.response_format is not None):
            other = "structured_outputs" if self.structured_outputs is not None else "response_format"
            raise ValueError(
                f"tool_choice {self.tool_choice!r} constrains the output to tool calls (a JSON schema made of the "
                f"tools): it cannot be combined with {other!r}; use tool_choice 'auto' or 'none', or leave "
                f"{other!r} out"
            )
        backend = (info.context or {}).get("structured_outputs_backend", "auto")  # a worker's own
        if forced:  # each tool's schema checked alone first: the one that fails is named
            for i, tool in enumerate(self.tools or ()):
                name = tool["function"]["name"]
                if self.tool_choice == "required" or self.tool_choice["function"]["name"] == name:
                    schema = constraint_for(self.tools, {"type": "function", "function": {"name": name}})
                    where = f"tools[{i}].function.parameters"
                    check_constraint(StructuredOutputsParams(json=schema), where, backend)
        constraint = self.constraint()
        if constraint is not None:  # what the worker's grammar engine would refuse, named as the user sent it
            check_constraint(constraint, self._constraint_field(constraint.kind), backend)
        for name in ("logprobs", "prompt_logprobs"):  # what a worker's engine allows
            value = getattr(self, name)
            if isinstance(value, int) and value > MAX_LOGPROBS:
                raise ValueError(f"{name} must be <= {MAX_LOGPROBS} (the workers' max_logprobs), got {value}")
        # SamplingParams owns the range checks; its ValueError names the field.
        self.to_sampling_params(constraint)
        return self

    @classmethod
    def sampling_field_names(cls) -> list[str]:
        return SamplingParams.field_names()

    @property
    def effective_tool_choice(self) -> str | dict[str, Any]:
        """The job's tool_choice: as given, else "auto" with tools (OpenAI's default) and "none" without."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools is not None else "none"

    @property
    def forces_tool_calls(self) -> bool:
        """tool_choice is "required" or names a function: the output is decoded under the tools' JSON schema
        (rose.engine.tool_calls.constraint_for) and read with parse_forced."""
        return self.tools is not None and self.effective_tool_choice not in ("auto", "none")

    def constraint(self) -> StructuredOutputsParams | None:
        if self.forces_tool_calls:
            return StructuredOutputsParams(json=constraint_for(self.tools, self.tool_choice))
        if self.response_format is not None:
            return StructuredOutputsParams.from_response_format(self.response_format)
        if self.structured_outputs is not None:
            return StructuredOutputsParams.from_dict(self.structured_outputs)
        return None

    def _constraint_field(self, kind: str) -> str:
        if self.forces_tool_calls:
            if self.tool_choice == "required":
                return "tools (tool_choice 'required': an array of calls of any of them)"
            names = [tool["function"]["name"] for tool in self.tools or ()]
            return f"tools[{names.index(self.tool_choice['function']['name'])}].function.parameters"
        if self.response_format is None:
            return f"structured_outputs.{kind}"
        return "response_format.json_schema.schema" if kind == "json" else "response_format"

    def to_sampling_params(self, constraint: StructuredOutputsParams | None = None) -> SamplingParams:
        """`constraint`: `self.constraint()` when the caller has it (built once per validation)."""
        fields = {name: getattr(self, name) for name in SamplingParams.field_names()}
        fields["structured_outputs"] = constraint if constraint is not None else self.constraint()
        return SamplingParams(**fields)

    def chat_options(self) -> ChatOptions:
        return ChatOptions(
            add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message,
            chat_template=self.chat_template,
            chat_template_kwargs=dict(self.chat_template_kwargs or {}),
            tools=self.tools,
        )

    def engine_prompt(self, tokenizer: Any = None) -> str | list[int] | dict[str, Any]:
        """What `Engine.add_request` takes: the text, the ids, or the messages rendered with `tokenizer`'s chat
        template (raises rose.engine.chat.ChatTemplateError, a ValueError, when they cannot be)."""
        if self.messages is not None:
            rendered = render_chat(tokenizer, self.messages, self.chat_options())
            return {"prompt": rendered.prompt, "prompt_token_ids": rendered.prompt_token_ids}
        return self.prompt if self.prompt is not None else list(self.prompt_token_ids or [])


_CHAT_FIELDS = (
    "add_generation_prompt",
    "continue_final_message",
    "chat_template",
    "chat_template_kwargs",
    "tools",
    "tool_choice",
)


def _lone_surrogate(value: Any, where: str) -> str | None:
    """Where in `value` (strings, nested in lists and dicts) a string holds a lone surrogate (a code point in
    U+D800-U+DFFF, which JSON's escapes can carry but no Unicode text can), e.g. "messages[0].content[3]"."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")  # at C speed: prompts can be long
        except UnicodeEncodeError as exc:
            return f"{where}[{exc.start}] ({value[exc.start]!a})"
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _lone_surrogate(key, f"{where} key") or _lone_surrogate(
            item, f"{where}.{key}" if isinstance(key, str) else f"{where}[{key}]"
        )
        if found is not None:
            return found
    return None


def suggest_field(name: str, also: Iterable[str] = ()) -> str | None:
    """The GenerateRequest field (or one of `also`, e.g. a client's enqueue options) that `name` is most likely a
    typo of, or None when nothing is close (difflib's ratio >= 0.6)."""
    close = difflib.get_close_matches(name, [*GenerateRequest.model_fields, *also], n=1)
    return close[0] if close else None


def format_validation_error(exc: ValidationError, also: Iterable[str] = ()) -> str:
    """One line per problem, naming the field: what a producer needs to fix the job. An unknown top-level field
    names the closest known one (`unknown field 'max_token' (did you mean 'max_tokens'?)`); `also`: more names a
    typo may have meant (a client passes its enqueue options)."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(part) for part in err["loc"])
        if err["type"] == "extra_forbidden":
            guess = suggest_field(loc, also) if len(err["loc"]) == 1 else None
            lines.append(f"unknown field {loc!r}" + (f" (did you mean {guess!r}?)" if guess else ""))
        elif loc:
            lines.append(f"{loc}: {err['msg']}")
        else:
            lines.append(err["msg"].removeprefix("Value error, "))
    return "invalid rose.jobs.generate arguments: " + "; ".join(lines)


# Unix times in seconds between these (2001 and 5138): below, a duration given for a time; above, milliseconds
_DEADLINE_RANGE = (1e9, 1e11)


def check_deadline(deadline: float) -> None:
    """ValueError unless `deadline` reads as a Unix time in seconds."""
    if not math.isfinite(deadline) or deadline <= 0:
        raise ValueError(f"'deadline' must be a Unix time in seconds (> 0), got {deadline!r}")
    if deadline < _DEADLINE_RANGE[0]:
        raise ValueError(
            f"'deadline' {deadline!r} looks like a duration: it is a Unix time in seconds (time.time() + "
            f"{deadline:g})"
        )
    if deadline > _DEADLINE_RANGE[1]:
        raise ValueError(f"'deadline' {deadline!r} looks like milliseconds: it is a Unix time in seconds")
