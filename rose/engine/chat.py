"""Chat messages (OpenAI's format) rendered into a prompt with the tokenizer's own chat template.

`render_chat` renders the template to text (`apply_chat_template(..., tokenize=False)`) and encodes that text with
`add_special_tokens=False`, exactly what `apply_chat_template(..., tokenize=True)` does: the special tokens the
template writes (BOS, role markers) appear once, never a second BOS from the tokenizer's post-processor. The text is
kept as the request's prompt. Every problem — a malformed message, no chat template, a template that raises (a role
it rejects) — is a `ChatTemplateError` (a ValueError) naming it, so it fails that request alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rose.engine.tool_calls import check_tools, messages_for_template

ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatTemplateError(ValueError):
    """The messages cannot be rendered into a prompt."""


@dataclass(frozen=True, slots=True)
class ChatOptions:
    """How messages are rendered (vLLM's and transformers' names)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None  # a Jinja template that replaces the tokenizer's own
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # e.g. {"enable_thinking": False}
    tools: list[dict[str, Any]] | None = None  # OpenAI-format tools: the template's `tools`

    def __post_init__(self) -> None:
        if self.add_generation_prompt and self.continue_final_message:
            raise ChatTemplateError(
                "continue_final_message=True continues the last (assistant) message: set add_generation_prompt=False"
            )
        reserved = set(self.chat_template_kwargs) & {
            "conversation", "messages", "tokenize", "add_generation_prompt", "continue_final_message",
            "chat_template", "return_dict", "tools", "tool_choice",
        }  # fmt: skip
        if reserved:
            raise ChatTemplateError(
                f"chat_template_kwargs may not set {sorted(reserved)}: they are fields of their own"
            )
        if self.tools is not None:
            try:
                check_tools(self.tools)
            except ValueError as exc:
                raise ChatTemplateError(str(exc)) from None


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    prompt: str  # the rendered text
    prompt_token_ids: list[int]


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Check OpenAI-format messages; text content parts are joined into one string (as vLLM does), other part types
    are refused. Other keys of a message (name, tool_calls, tool_call_id, ...) are passed to the template as they are.
    """
    if not isinstance(messages, list | tuple) or not messages:
        raise ChatTemplateError(
            "'messages' must be a non-empty list of {'role': ..., 'content': ...} objects"
        )
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise ChatTemplateError(f"messages[{i}] must be an object with 'role' and 'content'")
        role = msg.get("role")
        if role not in ROLES:
            raise ChatTemplateError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}")
        content = msg.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if (
                    not isinstance(part, dict)
                    or part.get("type") != "text"
                    or not isinstance(part.get("text"), str)
                ):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise ChatTemplateError(
                        f"messages[{i}].content[{j}]: only {{'type': 'text', 'text': ...}} parts are supported, "
                        f"got {kind!r}"
                    )
                texts.append(part["text"])
            content = "\n".join(texts)
        elif content is None:
            if role != "assistant" or not msg.get("tool_calls"):
                raise ChatTemplateError(f"messages[{i}].content is missing")
        elif not isinstance(content, str):
            raise ChatTemplateError(f"messages[{i}].content must be a string or a list of text parts")
        out.append({**msg, "content": content})
    return out


def render_chat(tokenizer: Any, messages: Any, options: ChatOptions | None = None) -> ChatPrompt:
    """The prompt `messages` make under the tokenizer's chat template (or `options.chat_template`), with
    `options.tools` as the template's `tools`. Past calls' `function.arguments` reach the template as objects
    (rose.engine.tool_calls.messages_for_template): templates write them with `| tojson`."""
    options = options or ChatOptions()
    if tokenizer is None:
        raise ChatTemplateError("chat messages need a tokenizer; this engine has none")
    msgs = normalize_messages(messages)
    if options.chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError(
            "this model's tokenizer has no chat template, so 'messages' cannot be rendered: send a 'prompt' "
            "instead (or a per-job 'chat_template' where the worker allows one)"
        )
    try:
        text = tokenizer.apply_chat_template(
            messages_for_template(msgs),
            tools=options.tools,
            chat_template=options.chat_template,
            add_generation_prompt=options.add_generation_prompt,
            continue_final_message=options.continue_final_message,
            tokenize=False,
            **options.chat_template_kwargs,
        )
    except Exception as exc:  # jinja2's TemplateError / raise_exception, or transformers' ValueError
        raise ChatTemplateError(f"the chat template could not render these messages: {exc}") from None
    if not isinstance(text, str):
        raise ChatTemplateError(f"the chat template rendered {type(text).__name__}, not text")
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if not ids:
        raise ChatTemplateError("the chat template rendered an empty prompt")
    return ChatPrompt(text, ids)
