"""What waiting on a job can raise (and `Client.submit` before enqueueing): the exceptions of `rose.jobs.client`,
in a module of their own so that the client and `rose.jobs.gather` both take them from here."""

from __future__ import annotations

from typing import Any

__all__ = ["InvalidRequest", "JobCanceled", "JobFailed", "StreamReset"]


class JobFailed(Exception):
    """The job failed; `message` is the worker's explanation (validation error, timeout, engine error...)."""

    def __init__(self, job_id: str, message: str):
        super().__init__(f"job {job_id} failed: {message}")
        self.job_id = job_id
        self.message = message


class JobCanceled(Exception):
    """The job was canceled (or stopped) before it finished."""

    def __init__(self, job_id: str, reason: str = "canceled"):
        super().__init__(f"job {job_id} {reason}")
        self.job_id = job_id
        self.reason = reason


class StreamReset(Exception):
    """The job restarted from scratch while its text was being streamed; `text` is what had been yielded.
    Iterate `stream()` again to get the new attempt from its start."""

    def __init__(self, job_id: str, text: str):
        super().__init__(f"job {job_id} restarted from scratch; drop the {len(text)} characters received")
        self.job_id = job_id
        self.text = text


class InvalidRequest(ValueError):
    """A job's arguments are invalid; nothing was enqueued. The message is the worker's own for the same job, one
    clause per problem, naming the field (and the closest known name for a typo: `unknown field 'max_token' (did
    you mean 'max_tokens'?)`). `errors` is pydantic's structured list; the ValidationError is the `__cause__`."""

    def __init__(self, message: str, errors: list[dict[str, Any]]):
        super().__init__(message)
        self.errors = errors
