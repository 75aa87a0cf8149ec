"""The job contract, as rose-worker holds a job to it (docs/jobs.md): what an RQ job must be for the worker to run
it, and the shapes of how it ends (the result it stores, the message it fails with).

`parse(job, ...)` turns a job (RQ's JSON payload `["rose.jobs.generate", null, [], {kwargs}]`) into its validated
`GenerateRequest`, or into the message of the failure it must end with: nothing in a refused job is run, and its
callbacks run only if `may_run_callbacks` says the job is ours. `job_result(...)` builds a finished job's RQ result
(`JobResult`) from the engine's final output, its tool calls read by rose.jobs.tools; `failure_message(output)` is the
message of a job whose output finished "error".

The producer's side imports this package without the engine installed: what it imports of rose.engine (through
rose.jobs.schemas and rose.jobs.tools: sampling params, chat rendering, tool calls) needs no torch.
"""

from __future__ import annotations

import datetime
import json
import time
from typing import TYPE_CHECKING, Any, TypedDict

from rq.exceptions import DeserializationError
from rq.job import Job

from rose.jobs.keys import FUNC_PATH
from rose.jobs.logprobs import LogprobEntry, PromptLogprobEntry
from rose.jobs.schemas import (
    INVALID_STRUCTURED_OUTPUT,
    GenerateRequest,
    ValidationError,
    format_validation_error,
)
from rose.jobs.tools import missing_parser, tool_result

if TYPE_CHECKING:
    from rose.engine.outputs import CompletionOutput, RequestOutput
    from rose.engine.tool_calls import ToolParser

__all__ = [
    "PICKLE_MESSAGE",
    "ChoiceResult",
    "JobResult",
    "ResultMetrics",
    "ResultUsage",
    "failure_message",
    "job_result",
    "may_run_callbacks",
    "parse",
    "queue_seconds",
]

PICKLE_MESSAGE = (
    "the job's payload is not JSON (was it enqueued with RQ's default pickle serializer?). rose-worker never "
    "unpickles anything, so nothing in this job was run. Enqueue with "
    "Queue('{queue}', connection=r, serializer=JSONSerializer).enqueue('rose.jobs.generate', "
    "kwargs={{'prompt': ..., 'max_tokens': ...}}) or use rose.Client."
)


# ---- the job's arguments ---------------------------------------------------------------------------------------


def parse(
    job: Job,
    queue_name: str,
    queue_names: list[str],
    trust_chat_template: bool,
    structured_outputs_backend: str = "auto",
    tool_parser: ToolParser | None = None,
) -> GenerateRequest | str:
    """The job's request, or the message of the failure it must end with (nothing in it is run). `queue_name`: the
    queue it came from; `queue_names`: those the worker serves (both named in the messages); a constraint is
    checked by the front end of `structured_outputs_backend`, the worker's own grammar backend; `tool_parser`: the
    worker's (rose.jobs.tools.resolve_parser), which a job with tools and tool_choice "auto" needs."""
    try:
        func_name, args, kwargs = job.func_name, job.args, job.kwargs
    except DeserializationError as exc:
        if isinstance(exc.__cause__, RecursionError):
            return (
                "the job's payload is JSON nested too deeply to decode (RecursionError); nothing in this job was "
                "run. rose.jobs.generate kwargs need only a few levels"
            )
        if isinstance(exc.__cause__, ValueError | TypeError) and not isinstance(
            exc.__cause__, UnicodeError | json.JSONDecodeError
        ):
            return (
                "the job's payload is JSON but not RQ's [\"rose.jobs.generate\", null, [], {kwargs}] layout "
                f"({exc.__cause__}); enqueue with RQ's JSONSerializer or follow docs/jobs.md"
            )
        return PICKLE_MESSAGE.format(queue=queue_name)
    if func_name != FUNC_PATH:
        return (
            f"rose-worker only runs {FUNC_PATH} jobs, not {func_name!r}: keep other jobs off the queues "
            f"it serves ({', '.join(queue_names)})"
        )
    if args:
        return f"{FUNC_PATH} takes keyword arguments only (kwargs={{'prompt': ...}}), got positional {json.dumps(args)[:200]}"
    try:
        request = GenerateRequest.model_validate(
            kwargs, context={"structured_outputs_backend": structured_outputs_backend}
        )
    except ValidationError as exc:
        return format_validation_error(exc)
    except TypeError as exc:  # e.g. non-string keys
        return f"invalid {FUNC_PATH} arguments: {exc}"
    if request.chat_template is not None and not trust_chat_template:
        return (
            "this job sets 'chat_template' but the worker does not accept per-job chat templates: start "
            "rose-worker with --trust-request-chat-template (ROSE_TRUST_REQUEST_CHAT_TEMPLATE=1), or leave "
            "'chat_template' out to use the model's own"
        )
    return missing_parser(request, tool_parser) or request


def may_run_callbacks(job: Job) -> bool:
    """Whether a failing job's RQ callbacks may be imported and run: only for a rose.jobs.generate job whose payload
    decodes as JSON. A refused job (pickle, another function such as os.system) is no job of ours: its callbacks
    are the sender's code, never run here."""
    try:
        return job.func_name == FUNC_PATH
    except Exception:
        return False


# ---- how it ends ---------------------------------------------------------------------------------------------


class ResultUsage(TypedDict):
    prompt_tokens: int
    completion_tokens: int


class ResultMetrics(TypedDict):
    queue_s: float | None  # enqueued -> started, when RQ recorded both
    ttft_s: float | None  # started -> first token
    generation_s: float  # started -> finished
    tokens_per_s: float | None  # completion tokens / generation_s


class ChoiceResult(TypedDict):
    """One choice of a job of n > 1 (JobResult's `choices`); its fields mean what JobResult's of the same name do."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    tool_calls: list[dict[str, Any]] | None
    content: str | None
    logprobs: list[LogprobEntry] | None


class JobResult(TypedDict):
    """A finished job's RQ result (`job.return_value()`, `Client`'s `Job.result()`), as docs/jobs.md shows it.
    "Started" in its metrics is the engine's arrival time of the request (the worker's start when it has none).
    A job of n > 1 choices: `choices` lists them all, the top-level text, token_ids, finish_reason, tool_calls,
    content and logprobs are the first's, and usage counts every choice's tokens (the prompt once)."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    usage: ResultUsage
    metrics: ResultMetrics
    worker: str  # the worker's name
    metadata: dict[str, Any] | None  # the job's own, echoed
    choices: list[ChoiceResult] | None  # n > 1 only
    # Tool calling (rose.jobs.tools), for a job with `tools`: the calls in OpenAI's form ([] when none), and the text
    # outside them (None when the output is only calls). A job without tools has None for both: its text is `text`.
    # `text` is the raw output either way (what was streamed); finish_reason is "tool_calls" when there are calls
    # and tool_choice is not a named function ("required": when the output ended by "stop"), as vLLM's.
    tool_calls: list[dict[str, Any]] | None
    content: str | None
    logprobs: (
        list[LogprobEntry] | None
    )  # one per token of token_ids, for a job with `logprobs` (rose.jobs.logprobs)
    # a job with `prompt_logprobs`: one per prompt token, None for the first (rose.jobs.logprobs)
    prompt_logprobs: list[PromptLogprobEntry | None] | None


def queue_seconds(job: Job) -> float | None:
    """Seconds the job waited on its queue (enqueued to started), when RQ recorded both."""
    if job.enqueued_at is None or job.started_at is None:
        return None
    return max(0.0, (job.started_at - job.enqueued_at).total_seconds())


def job_result(
    output: RequestOutput,
    job: Job,
    *,
    started_wall: float,
    worker: str,
    metadata: dict[str, Any] | None,
    logprobs: list[list[LogprobEntry] | None] | None = None,
    prompt_logprobs: list[PromptLogprobEntry | None] | None = None,
    request: GenerateRequest | None = None,
    tool_parser: ToolParser | None = None,
) -> JobResult:
    """The job's RQ result from the engine's final output. `started_wall`: when the worker started the job (the
    engine's arrival time when it has none); `worker`: the worker's name; `metadata`: the request's; `logprobs`: each
    choice's entries, for a job that asked (rose.jobs.logprobs.logprob_entries), and `prompt_logprobs` the prompt's
    (prompt_logprob_entries); `request` and `tool_parser` (the worker's): the job's tool calls
    (rose.jobs.tools.tool_result)."""
    m = output.metrics
    start = m.arrival_time or started_wall
    finished = m.finished_time or time.time()
    generation_s = max(0.0, finished - start)
    completion = sum(len(c.token_ids) for c in output.outputs)
    choices: list[ChoiceResult] = []
    for i, c in enumerate(output.outputs):
        tools = tool_result(request, c.text, c.finish_reason, tool_parser)
        entries = logprobs[i] if logprobs is not None and i < len(logprobs) else None
        choices.append(
            {
                "index": i,
                "text": c.text,
                "token_ids": list(c.token_ids),
                "finish_reason": tools["finish_reason"],
                "tool_calls": tools["tool_calls"],
                "content": tools["content"],
                "logprobs": entries,
            }
        )
    first = choices[0]
    return {
        "text": first["text"],
        "token_ids": first["token_ids"],
        "finish_reason": first["finish_reason"],
        "usage": {"prompt_tokens": len(output.prompt_token_ids), "completion_tokens": completion},
        # to the microsecond (the clocks' resolution; more digits are float noise a stored result pays for)
        "metrics": {
            "queue_s": queue_seconds(job),
            "ttft_s": round(m.first_token_time - start, 6) if m.first_token_time else None,
            "generation_s": round(generation_s, 6),
            "tokens_per_s": round(completion / generation_s, 3) if generation_s > 0 else None,
        },
        "worker": worker,
        "metadata": metadata,
        "logprobs": first["logprobs"],
        "tool_calls": first["tool_calls"],
        "content": first["content"],
        "choices": choices if len(choices) > 1 else None,
        "prompt_logprobs": prompt_logprobs,
    }


def failure_message(output: RequestOutput | CompletionOutput) -> str:
    """A failed job's message for an engine output (or the choice of it) that finished "error": why it could not
    run, or what its output broke (INVALID_STRUCTURED_OUTPUT, then the violation), with the output's text (nothing
    is lost: the text is in the message)."""
    if output.structured_output_error is None:
        return output.error or "engine error"
    text = json.dumps(output.text, ensure_ascii=False)
    return (
        f"{INVALID_STRUCTURED_OUTPUT}: {output.structured_output_error}; "
        f"the output ({len(output.text)} characters): {text}"
    )


def deadline_exceeded(deadline: float, when: str) -> str:
    """The failure message of a job whose deadline (the job field, Unix time) passed `when`."""
    at = datetime.datetime.fromtimestamp(deadline, datetime.UTC).isoformat(timespec="milliseconds")
    return f"deadline exceeded: the job's deadline {at} (Unix {deadline:.3f}) passed {when}"
