"""OpenAI's Batch API file format for `rose batch`: request lines in, batch output (and error) lines out.

Input line: {"custom_id": "...", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions", "body": {...}},
the body being a Chat Completions / Completions request. Each body field maps to a rose.jobs.generate job field;
a field rose cannot honour (echo, best_of, the legacy functions, ...) makes that line a 400 error line rather
than being ignored. Chat lines may carry `tools` / `tool_choice` (rose.jobs.tools): the output's message has the
calls as `tool_calls`, and `content` the text outside them. `stream` becomes the job field of that name (true: the
workers publish the job's tokens on Redis for whoever watches it; false: only its end); the output line is the
non-streaming response either way.
Output line (OpenAI's BatchRequestOutput): {"id": "batch_req_...", "custom_id",
"response": {"status_code", "request_id", "body"} | null, "error": {"code", "message"} | null}.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

from rose.cli.batch_files import Entry, LineFormat, PlainFormat, key_of, validate
from rose.cli.openai_choices import openai_choices

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
_LINE_FIELDS = {"custom_id", "method", "url", "body"}

# body fields taken as the job field of the same name (the sampling ones mean the same in OpenAI's API and vLLM's)
_SAME = (
    "temperature",
    "top_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "stop",
    "response_format",
    "logit_bias",
    "n",
)
# vLLM's extra request parameters (its OpenAI server's "extra_body"), also job fields of the same name
_VLLM_EXTRAS = (
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "structured_outputs",
    "priority",
    "allowed_token_ids",
    "bad_words",
    "prompt_logprobs",
)
_VLLM_CHAT_EXTRAS = (
    "add_generation_prompt",
    "continue_final_message",
    "chat_template",
    "chat_template_kwargs",
)
# accepted and without effect on the output: identifiers (`user` is the job's tenant), and storing (rose stores
# nothing but the result)
_NO_EFFECT = ("user", "safety_identifier", "prompt_cache_key", "store")
# accepted only with these values (the default); anything else is a feature rose does not have.
# parallel_tool_calls (chat) is accepted as it is, as vLLM does: the model writes as many calls as it writes.
_ONLY = {"echo": (False,), "best_of": (1,)}
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on chat's top_logprobs, and vLLM's default max_logprobs
_STREAM_OPTIONS = ("include_usage", "include_obfuscation")  # OpenAI's; what rose does with each: see _stream
_ENDPOINT_FIELDS = {
    CHAT_URL: {
        "messages",
        "max_completion_tokens",
        "metadata",
        "logprobs",
        "top_logprobs",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
    },
    COMPLETIONS_URL: {"prompt", "echo", "best_of", "logprobs"},
}
_COMMON = {"model", "max_tokens", "stream", "stream_options", *_SAME, *_VLLM_EXTRAS, *_NO_EFFECT}


class RequestError(ValueError):
    """A line rose cannot run: its 400 response body names `param` and `code` as OpenAI's errors do."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


def is_openai_line(obj: Any) -> bool:
    """A line in OpenAI's format names one of custom_id / method / url / body, none of which is a rose job field."""
    return isinstance(obj, dict) and bool(_LINE_FIELDS & obj.keys())


def detect_format(
    path: Path, queue_for: dict[str, str], lora_models: frozenset[str] = frozenset()
) -> LineFormat:
    """The format of the file, by its first line that is a JSON object (plain when there is none)."""
    with path.open(encoding="utf-8", errors="replace") as f:
        for text in f:
            try:
                obj = json.loads(text)
            except ValueError:
                continue
            if isinstance(obj, dict):
                return OpenAIFormat(queue_for, lora_models) if is_openai_line(obj) else PlainFormat()
    return PlainFormat()


def to_job_fields(line: dict[str, Any], defaults: dict[str, Any] | None = None) -> tuple[dict[str, Any], str]:
    """A request line -> (rose.jobs.generate fields, body.model). RequestError for what rose cannot run as asked.

    `defaults` are the command line's sampling flags: they apply where the body is silent. Without a max_tokens
    from either, the job may generate up to the context limit, as OpenAI's default is (not rose's 16). A null
    body field counts as absent (OpenAI's default).
    """
    defaults = defaults or {}
    extra = sorted(line.keys() - _LINE_FIELDS)
    if extra:
        raise RequestError(f"unknown field(s) in the request line: {', '.join(extra)}", extra[0])
    if line.get("method") != "POST":
        raise RequestError(f"method must be 'POST', got {line.get('method')!r}", "method", "invalid_method")
    url = line.get("url")
    if url not in _ENDPOINT_FIELDS:
        raise RequestError(
            f"url {url!r} is not supported by rose batch: use {CHAT_URL!r} or {COMPLETIONS_URL!r}",
            "url",
            "invalid_url",
        )
    body = line.get("body")
    if not isinstance(body, dict):
        raise RequestError("'body' must be a JSON object", "body")
    body = {k: v for k, v in body.items() if v is not None}
    unsupported = sorted(body.keys() - _COMMON - _ENDPOINT_FIELDS[url] - set(_vllm_chat_extras(url)))
    if unsupported:
        raise RequestError(
            f"not supported by rose: {', '.join(unsupported)}", unsupported[0], "unsupported_parameter"
        )
    for name, allowed in _ONLY.items():
        # by type too: False == 0 and True == 1, but logprobs=0 asks for logprobs and n=true is no count
        if name in body and not any(type(body[name]) is type(a) and body[name] == a for a in allowed):
            why = f"only {json.dumps(allowed[0])}"
            raise RequestError(
                f"{name}={json.dumps(body[name])} is not supported by rose ({why})", name, "unsupported_value"
            )
    stream = _stream(body)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError("'model' is required (a string)", "model", "missing_required_parameter")

    fields: dict[str, Any] = {
        n: body[n] for n in (*_SAME, *_VLLM_EXTRAS, *_vllm_chat_extras(url)) if n in body
    }
    if url == CHAT_URL:
        if "messages" not in body:
            raise RequestError("'messages' is required", "messages", "missing_required_parameter")
        fields["messages"] = body["messages"]
        for name in ("metadata", "tools", "tool_choice"):
            if name in body:
                fields[name] = body[name]
    else:
        fields.update(_prompt(body))
    logprobs = _logprobs(body, url)
    if logprobs is not None:
        fields["logprobs"] = logprobs
    max_tokens = _max_tokens(body)
    if max_tokens is not None:
        fields["max_tokens"] = max_tokens
    elif "max_tokens" not in defaults:
        fields["max_tokens"] = None
    if stream is not None:  # absent: the command line's choice (rose batch: false unless --stream)
        fields["stream"] = stream
    return fields, model


def _stream(body: dict[str, Any]) -> bool | None:
    """body.stream (None: absent), its `stream_options` checked: RequestError for what rose cannot honour.

    OpenAI's stream_options: `include_usage` (a last chunk with the usage): rose's terminal `done` event
    always carries the usage, so true is honoured, and false (OpenAI's default) is no different from leaving
    it out; `include_obfuscation` (random padding on streamed deltas, on by default at OpenAI): rose's events
    have none, so only false is honoured.
    """
    stream = body.get("stream")
    if stream is not None and type(stream) is not bool:
        raise RequestError(
            f"'stream' must be true or false, got {json.dumps(stream)}", "stream", "invalid_type"
        )
    options = body.get("stream_options")
    if options is None:
        return stream
    if stream is not True:
        raise RequestError(
            "'stream_options' is only allowed when 'stream' is true", "stream_options", "invalid_value"
        )
    if not isinstance(options, dict):
        raise RequestError("'stream_options' must be a JSON object", "stream_options", "invalid_type")
    for name, value in options.items():
        if value is None:  # null counts as absent, as in the body
            continue
        if name not in _STREAM_OPTIONS:
            raise RequestError(
                f"stream_options.{name} is not supported by rose (only {', '.join(_STREAM_OPTIONS)})",
                "stream_options",
                "unsupported_parameter",
            )
        if type(value) is not bool:
            raise RequestError(
                f"stream_options.{name} must be true or false, got {json.dumps(value)}",
                "stream_options",
                "invalid_type",
            )
        if name == "include_obfuscation" and value:
            raise RequestError(
                "stream_options.include_obfuscation=true is not supported by rose (its token events carry no "
                "obfuscation padding): give false",
                "stream_options",
                "unsupported_value",
            )
    return stream


def _logprobs(body: dict[str, Any], url: str) -> int | None:
    """The job's `logprobs` (how many alternatives per token; None: none asked). Chat: `logprobs` (a bool) with
    `top_logprobs` (0-20, only with logprobs true); completions: `logprobs` (0-20)."""

    def count(name: str) -> int:
        value = body[name]
        if type(value) is not int or not 0 <= value <= MAX_TOP_LOGPROBS:
            raise RequestError(
                f"'{name}' must be an integer in [0, {MAX_TOP_LOGPROBS}], got {json.dumps(value)}",
                name,
                "invalid_value",
            )
        return value

    if url != CHAT_URL:  # false: none (what a chat-shaped habit sends)
        return count("logprobs") if body.get("logprobs", False) is not False else None
    asked = body.get("logprobs", False)
    if type(asked) is not bool:
        raise RequestError(
            f"'logprobs' must be true or false, got {json.dumps(asked)}", "logprobs", "invalid_type"
        )
    if "top_logprobs" in body:
        if not asked:
            raise RequestError("'top_logprobs' needs 'logprobs': true", "top_logprobs", "invalid_value")
        return count("top_logprobs")
    return 0 if asked else None


def _vllm_chat_extras(url: str) -> tuple[str, ...]:
    return _VLLM_CHAT_EXTRAS if url == CHAT_URL else ()


def _max_tokens(body: dict[str, Any]) -> Any:
    """max_completion_tokens (chat's current name) or max_tokens (the older one); both but different: refused."""
    old, new = body.get("max_tokens"), body.get("max_completion_tokens")
    if old is not None and new is not None and old != new:
        raise RequestError(
            f"max_tokens ({old}) and max_completion_tokens ({new}) conflict: give one",
            "max_completion_tokens",
            "invalid_value",
        )
    return new if new is not None else old


def _prompt(body: dict[str, Any]) -> dict[str, Any]:
    """The completions `prompt` as OpenAI takes it (a string, token ids, or a list of one of those) -> job field."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        if len(prompt) != 1:
            raise RequestError(
                f"{len(prompt)} prompts in one request: rose runs one prompt per line",
                "prompt",
                "unsupported_value",
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return {"prompt_token_ids": prompt}
    if prompt is None:
        raise RequestError("'prompt' is required", "prompt", "missing_required_parameter")
    raise RequestError("'prompt' must be a string, a list of token ids, or a list of one of those", "prompt")


class OpenAIFormat:
    """OpenAI's Batch API lines; the line id is `custom_id`. `queue_for`: body.model -> queue (others: --queue);
    `lora_models`: the body.model names that are LoRA adapters (the job's `lora`; others: the base model)."""

    unique_ids = True  # OpenAI refuses a file that repeats a custom_id; so do we, before submitting anything

    def __init__(self, queue_for: dict[str, str] | None = None, lora_models: frozenset[str] = frozenset()):
        self.queue_for = dict(queue_for or {})
        self.lora_models = frozenset(lora_models)

    def line_key(self, lineno: int, text: str) -> tuple[str | None, str | None]:
        try:
            obj = json.loads(text)
        except ValueError as exc:
            return None, f"invalid JSON: {exc}"
        if not isinstance(obj, dict):
            return None, f"expected a JSON object, got {type(obj).__name__}"
        custom_id = obj.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            return None, "'custom_id' (a non-empty string) is required"
        return key_of(custom_id), None

    def output_key(self, obj: Any) -> tuple[str, bool]:
        response = obj["response"]
        return key_of(obj["custom_id"]), response is None or response["status_code"] != 200

    def parse(self, lineno: int, text: str, defaults: dict[str, Any]) -> Entry:
        line = json.loads(text)  # line_key has vetted the line: an object with a custom_id
        entry = Entry(lineno, line["custom_id"], context={"url": line.get("url")})
        try:
            fields, model = to_job_fields(line, defaults)
        except RequestError as exc:
            entry.error, entry.context["param"], entry.context["code"] = str(exc), exc.param, exc.code
            return entry
        entry.context["model"] = model
        if model in self.lora_models:
            fields["lora"] = model
        user = (line.get("body") or {}).get("user")
        if user is not None:  # OpenAI's end-user id: the job's tenant (over --tenant)
            if not isinstance(user, str) or not user.strip():
                entry.error = f"'user' must be a non-empty string (the job's tenant), got {user!r}"
                entry.context["param"], entry.context["code"] = "user", "invalid_value"
                return entry
            fields["tenant"] = user
        problem = validate({**defaults, **fields})
        if problem is not None:
            entry.error, param = problem
            body = line.get("body") or {}
            if param == "max_tokens" and body.get("max_completion_tokens") is not None:
                param = "max_completion_tokens"  # the body's name for what became the job's max_tokens
            entry.context["param"] = _BODY_NAMES.get(param or "", param)
            entry.context["code"] = "invalid_value"
            return entry
        entry.request = fields
        entry.queue = self.queue_for.get(model)
        return entry

    def invalid_line(self, entry: Entry) -> dict[str, Any]:
        error = {
            "message": entry.error,
            "type": "invalid_request_error",
            "param": entry.context.get("param"),
            "code": entry.context.get("code"),
        }
        # never submitted: no rose job id to give as request_id
        response = {"status_code": 400, "request_id": None, "body": {"error": error}}
        return {
            "id": f"batch_req_{uuid.uuid4().hex}",
            "custom_id": entry.id,
            "response": response,
            "error": None,
        }

    def result_line(self, entry: Entry, job_id: str, result: dict[str, Any]) -> dict[str, Any]:
        usage = result.get("usage") or {}
        prompt_tokens, completion_tokens = (
            int(usage.get("prompt_tokens", 0)),
            int(usage.get("completion_tokens", 0)),
        )
        chat = entry.context["url"] == CHAT_URL
        body: dict[str, Any] = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{job_id}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": entry.context["model"],
        }
        body.update(openai_choices(result, chat))
        body["usage"] = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
        body["system_fingerprint"] = None
        response = {"status_code": 200, "request_id": job_id, "body": body}
        return {"id": f"batch_req_{job_id}", "custom_id": entry.id, "response": response, "error": None}

    def failed_line(self, entry: Entry, job_id: str, message: str, code: str) -> dict[str, Any]:
        return {
            "id": f"batch_req_{job_id}",
            "custom_id": entry.id,
            "response": None,
            "error": {"code": code, "message": message},
        }


# job field at fault -> the body field that set it
_BODY_NAMES = {"prompt_token_ids": "prompt"}
