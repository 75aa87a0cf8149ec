"""Tool calls in jobs (OpenAI's `tools` / `tool_choice`, as vLLM serves them): which parser a worker reads calls
with, and the calls of a finished job.

A job's `tool_choice` (`GenerateRequest.effective_tool_choice`) decides how its output is read:

* "none" (the default without tools): the tools are rendered into the prompt, nothing is parsed.
* "auto" (the default with tools): the model writes calls in its own format; the worker's parser
  (`--tool-call-parser`, else the one `guess_tool_parser` reads off the chat template) extracts them. A worker with
  no parser refuses such a job (`missing_parser`).
* "required" or a named function: the output was decoded under the tools' JSON schema
  (rose.engine.tool_calls.constraint_for, `GenerateRequest.constraint`); `parse_forced` reads it.

`tool_result` gives the result's `content`, `tool_calls` and `finish_reason`. Model output never fails a job here:
what is not a call is content. No torch: a producer's install imports rose.jobs.
"""

from __future__ import annotations

from typing import Any, TypedDict

from rose.engine.sampling_params import SamplingParams
from rose.engine.tool_calls import (
    TOOL_PARSERS,
    ToolParser,
    get_tool_parser,
    guess_tool_parser,
    parse_forced,
    to_openai,
)
from rose.jobs.schemas import GenerateRequest

__all__ = [
    "NO_PARSER",
    "PARSER_CHOICES",
    "ToolResult",
    "missing_parser",
    "resolve_parser",
    "sampling_params",
    "tool_result",
]

NO_PARSER = "none"  # --tool-call-parser none: no parser, whatever the chat template shows
PARSER_CHOICES = (*TOOL_PARSERS, NO_PARSER)


class ToolResult(TypedDict):
    """The result fields tool calling decides (rose.jobs.contract.JobResult has them)."""

    content: (
        str | None
    )  # the text that is not a call; None when the output is only calls, or the job has no tools
    tool_calls: list[dict[str, Any]] | None  # OpenAI's form (to_openai); None for a job without tools
    finish_reason: str | None  # "tool_calls" where vLLM says so, else the engine's


def resolve_parser(setting: str | None, chat_template: str | None) -> ToolParser | None:
    """The worker's parser: `setting` (--tool-call-parser: a name of TOOL_PARSERS, NO_PARSER), else (None) the one
    the chat template shows (guess_tool_parser), else None."""
    if setting == NO_PARSER:
        return None
    name = setting if setting is not None else guess_tool_parser(chat_template)
    return get_tool_parser(name) if name is not None else None


def _parses(request: GenerateRequest) -> bool:
    """Whether the job's calls are read by the worker's parser (tools with tool_choice "auto")."""
    return request.tools is not None and request.effective_tool_choice == "auto"


def missing_parser(request: GenerateRequest, parser: ToolParser | None) -> str | None:
    """The failure message of a job whose calls need a parser this worker has not; None when it can run."""
    if parser is not None or not _parses(request):
        return None
    return (
        "this job has 'tools' with tool_choice 'auto', but this worker has no tool-call parser to read the calls "
        "its model writes (its chat template shows no tool-call format rose knows): start rose-worker with "
        f"--tool-call-parser ({', '.join(TOOL_PARSERS)}; ROSE_TOOL_CALL_PARSER), or send tool_choice "
        "'required' or a named function, which need no parser"
    )


def sampling_params(request: GenerateRequest, parser: ToolParser | None) -> SamplingParams:
    """The job's SamplingParams; decoded with skip_special_tokens=False when its calls are read by a parser whose
    call marker is a special token (Mistral's [TOOL_CALLS]), as vLLM's parser does."""
    params = request.to_sampling_params()
    if parser is not None and not parser.skip_special_tokens and _parses(request):
        params.skip_special_tokens = False
    return params


def tool_result(
    request: GenerateRequest | None, text: str, finish_reason: str | None, parser: ToolParser | None
) -> ToolResult:
    """The calls in a finished job's text. Without tools: content and tool_calls None, finish_reason as it is.
    "none": the text is content, no calls. "auto": `parser` reads them (vLLM: finish_reason "tool_calls" when it
    found any). "required": parse_forced (finish_reason "tool_calls" when the output ended by "stop"); a named
    function: parse_forced, finish_reason as it is (vLLM's "stop")."""
    if request is None or request.tools is None:
        return {"content": None, "tool_calls": None, "finish_reason": finish_reason}
    choice = request.effective_tool_choice
    if choice == "none" or (choice == "auto" and parser is None):
        return {"content": text, "tool_calls": [], "finish_reason": finish_reason}
    name = parser.name if parser is not None else None
    if choice == "auto":
        parsed = parser.parse(text)  # type: ignore[union-attr]
    else:
        parsed = parse_forced(text, request.tools, choice, parser=name)
    calls = [to_openai(call) for call in parsed.tool_calls]
    if calls and (choice == "auto" or (choice == "required" and finish_reason == "stop")):
        finish_reason = "tool_calls"
    return {"content": parsed.content, "tool_calls": calls, "finish_reason": finish_reason}
