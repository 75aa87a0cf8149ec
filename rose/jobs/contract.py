"""The job contract, as rose-worker holds a job to it (docs/jobs.md): what an RQ job must be for the worker to run
it, and the shapes of how it ends (the result it stores, the message it fails with).

`parse(job, ...)` turns a job (RQ's JSON payload `["rose.jobs.generate", null, [], {kwargs}]`) into its validated
`GenerateRequest`, or into the message of the failure it must end with: nothing in a refused job is run, and its
callbacks run only if `may_run_callbacks` says the job is ours. `job_result(...)` builds a finished job's RQ result
(`JobResult`) from the engine's final output; `failure_message(output)` is the message of a job whose output finished
"error".

The producer's side imports this package without the engine installed: nothing here imports rose.engine but the
types it names (rose.jobs.schemas, which it imports, needs no torch either).
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any, TypedDict

from rq.exceptions import DeserializationError
from rq.job import Job

from rose.jobs.keys import FUNC_PATH
from rose.jobs.schemas import (
    INVALID_STRUCTURED_OUTPUT,
    GenerateRequest,
    ValidationError,
    format_validation_error,
)

if TYPE_CHECKING:
    from rose.engine.outputs import RequestOutput

__all__ = [
    "PICKLE_MESSAGE",
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
) -> GenerateRequest | str:
    """The job's request, or the message of the failure it must end with (nothing in it is run). `queue_name`: the
    queue it came from; `queue_names`: those the worker serves (both named in the messages); a constraint is
    checked by the front end of `structured_outputs_backend`, the worker's own grammar backend."""
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
    return request


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


class JobResult(TypedDict):
    """A finished job's RQ result (`job.return_value()`, `Client`'s `Job.result()`), as docs/jobs.md shows it.
    "Started" in its metrics is the engine's arrival time of the request (the worker's start when it has none)."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    usage: ResultUsage
    metrics: ResultMetrics
    worker: str  # the worker's name
    metadata: dict[str, Any] | None  # the job's own, echoed


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
) -> JobResult:
    """The job's RQ result from the engine's final output. `started_wall`: when the worker started the job (the
    engine's arrival time when it has none); `worker`: the worker's name; `metadata`: the request's."""
    m = output.metrics
    start = m.arrival_time or started_wall
    finished = m.finished_time or time.time()
    generation_s = max(0.0, finished - start)
    completion = len(output.token_ids)
    return {
        "text": output.text,
        "token_ids": list(output.token_ids),
        "finish_reason": output.finish_reason,
        "usage": {"prompt_tokens": len(output.prompt_token_ids), "completion_tokens": completion},
        "metrics": {
            "queue_s": queue_seconds(job),
            "ttft_s": (m.first_token_time - start) if m.first_token_time else None,
            "generation_s": generation_s,
            "tokens_per_s": completion / generation_s if generation_s > 0 else None,
        },
        "worker": worker,
        "metadata": metadata,
    }


def failure_message(output: RequestOutput) -> str:
    """A failed job's message for an engine output that finished "error": why it could not run, or what its
    output broke (INVALID_STRUCTURED_OUTPUT, then the violation), with the output's text (nothing is lost: the
    text is in the message)."""
    if output.structured_output_error is None:
        return output.error or "engine error"
    text = json.dumps(output.text, ensure_ascii=False)
    return (
        f"{INVALID_STRUCTURED_OUTPUT}: {output.structured_output_error}; "
        f"the output ({len(output.text)} characters): {text}"
    )
