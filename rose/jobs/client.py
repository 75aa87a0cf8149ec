"""Producer API: submit generation jobs, stream their tokens, wait for their results, cancel them.

Jobs are plain RQ jobs (JSONSerializer, function path `rose.jobs.generate`); this module only adds convenience.
The asyncio twins (`AsyncClient`, `AsyncJob`) live in rose.jobs.async_client.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import redis
from rq import Queue
from rq.exceptions import NoSuchJobError
from rq.job import Job as RQJob
from rq.job import JobStatus
from rq.results import Result
from rq.serializers import JSONSerializer

from rose.jobs import gather, keys
from rose.jobs.connection import connect
from rose.jobs.errors import InvalidRequest, JobCanceled, JobFailed, StreamReset
from rose.jobs.events import CanceledEvent
from rose.jobs.schemas import GenerateRequest, ValidationError, format_validation_error
from rose.jobs.stream_reader import POLL_S, Cursor, TextDeltas

__all__ = ["Client", "InvalidRequest", "Job", "JobCanceled", "JobFailed", "StreamReset"]

# Enqueue options RQ takes for itself; everything else is a generation field.
_RQ_OPTIONS = (
    "job_id",
    "job_timeout",
    "result_ttl",
    "ttl",
    "failure_ttl",
    "description",
    "retry",
    "at_front",
    "meta",
    "depends_on",
    "on_success",
    "on_failure",
    "on_stopped",
)
_ENDED = {JobStatus.FAILED, JobStatus.CANCELED, JobStatus.STOPPED}
_SILENT_POLLS = 3


def _request_kwargs(prompt: str | list[int] | None, fields: dict[str, Any]) -> dict[str, Any]:
    """Validate locally (fail at submit time, not in the worker) and keep only what the caller set.

    The job's kwargs are the fields as given (a `messages` job carries its messages, not a rendered prompt: the
    worker renders them with its model's chat template), so they stay what a plain RQ producer would enqueue.
    Raises InvalidRequest (a ValueError) naming every bad field, with the worker's wording.
    """
    if prompt is not None:
        fields["prompt_token_ids" if isinstance(prompt, list) else "prompt"] = prompt
    try:
        return GenerateRequest(**fields).model_dump(exclude_unset=True)
    except ValidationError as exc:
        # pydantic's own text is a multi-line dump with URLs; a typo of an enqueue option lands here too
        raise InvalidRequest(format_validation_error(exc, also=_RQ_OPTIONS), exc.errors()) from exc


def _split(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    rq_opts = {k: options.pop(k) for k in _RQ_OPTIONS if k in options}
    return rq_opts, options


def _failure_message(job: RQJob) -> str:
    result = job.latest_result()
    if result is not None and result.type == Result.Type.FAILED and result.exc_string:
        return result.exc_string.strip()
    return "no failure message stored"


class Job:
    """Handle on one submitted job."""

    def __init__(self, client: Client, job_id: str):
        self.client = client
        self.id = job_id

    def __repr__(self) -> str:
        return f"rose.Job({self.id!r})"

    @property
    def rq_job(self) -> RQJob:
        return RQJob.fetch(self.id, connection=self.client.redis, serializer=JSONSerializer)

    def status(self) -> str:
        return str(self.rq_job.get_status(refresh=False).value)

    def events(self, timeout: float | None = None) -> Iterator[Any]:
        """Every event of the current attempt (and of later ones, after a reset), ending with the terminal event.

        Reads the job's Redis stream from the start, so nothing is missed or repeated whenever this is called.
        `timeout`: seconds without any event before TimeoutError.
        """
        r = self.client.redis
        stream = keys.stream_key(self.id)
        cursor = Cursor(self.id, timeout)
        events: Iterable[Any] | None = cursor.stored(r.xrange(stream))
        while True:
            yield from events or ()
            if cursor.ended:
                return
            events = cursor.read(r.xread({stream: cursor.last_id}, block=int(POLL_S * 1000), count=1000))
            if events is None:
                # a job that ended without reaching the worker (canceled while queued...) has no terminal event
                self.raise_if_ended_silently(cursor.quiet_polls)
                cursor.check_timeout()

    def raise_if_ended_silently(self, quiet_polls: int) -> None:
        """Called after each quiet poll. The worker publishes the terminal event right after ending the job, so
        an ended job still silent a few polls later ended without a worker (e.g. canceled while queued)."""
        try:
            job = self.rq_job
        except NoSuchJobError:
            raise JobFailed(self.id, "job does not exist (expired or deleted)") from None
        status = job.get_status(refresh=False)
        if status in _ENDED and quiet_polls >= _SILENT_POLLS:
            if status == JobStatus.FAILED:
                raise JobFailed(self.id, _failure_message(job))
            raise JobCanceled(self.id, str(status.value))

    def stream(self, timeout: float | None = None) -> Iterator[str]:
        """Text deltas as they are generated; their concatenation equals the result's text (a job of n > 1
        choices: the first choice's; `events()` has every choice's, each token event with its `index`).

        Raises JobFailed / JobCanceled if the job ends that way, StreamReset if it restarts mid-stream.
        """
        deltas = TextDeltas(self.id)
        for event in self.events(timeout=timeout):
            if (text := deltas.delta(event)) is not None:
                yield text

    def result(self, timeout: float | None = None) -> dict[str, Any]:
        """Wait for the job to end: its result dict, or JobFailed / JobCanceled; TimeoutError after `timeout` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                job = self.rq_job
            except NoSuchJobError:
                raise JobFailed(self.id, "job does not exist (expired or deleted)") from None
            status = job.get_status(refresh=False)
            if status == JobStatus.FINISHED:
                return job.return_value(refresh=True)
            if status == JobStatus.FAILED:
                raise JobFailed(self.id, _failure_message(job))
            if status in (JobStatus.CANCELED, JobStatus.STOPPED):
                raise JobCanceled(self.id, str(status.value))
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"job {self.id} still {status.value} after {timeout} s")
            # Block on RQ's result stream rather than spinning; wake up now and then to re-check the status.
            wait = POLL_S if left is None else min(POLL_S, left)
            job.latest_result(timeout=max(1, int(wait)))

    def cancel(self) -> bool:
        """Cancel the job: a queued job never starts, a running one stops within `--check-interval`
        (50 ms) plus an engine step, and is never stored as finished.
        Returns False if the job had already ended."""
        return self.client.cancel(self.id)


class Client:
    """`Client("redis://localhost:6379/0", queue="rose")`: submit jobs to rose-worker. `tenant`: the job field
    `tenant` of every job this client submits that does not set its own."""

    def __init__(
        self,
        redis_url: str | redis.Redis = "redis://localhost:6379/0",
        queue: str = keys.DEFAULT_QUEUE,
        tenant: str | None = None,
    ):
        if tenant is not None and (not isinstance(tenant, str) or not tenant.strip()):
            raise ValueError(
                f"tenant must be a non-empty string (or None: the default tenant), got {tenant!r}"
            )
        self.redis = connect(redis_url) if isinstance(redis_url, str) else redis_url
        self.queue = Queue(queue, connection=self.redis, serializer=JSONSerializer)
        self.tenant = tenant

    def _kwargs(self, prompt: str | list[int] | None, fields: dict[str, Any]) -> dict[str, Any]:
        if self.tenant is not None:
            fields.setdefault("tenant", self.tenant)
        return _request_kwargs(prompt, fields)

    def submit(self, prompt: str | list[int] | None = None, **options: Any) -> Job:
        """Enqueue one job. `options`: GenerateRequest fields (max_tokens, temperature, metadata, ...) and RQ's
        enqueue options (job_id, job_timeout, result_ttl, failure_ttl, ttl, retry, at_front, meta, ...).

        Invalid arguments raise InvalidRequest, a ValueError, before anything is enqueued; its message is the one
        the worker would fail the job with (`unknown field 'max_token' (did you mean 'max_tokens'?)`). It is not
        pydantic's ValidationError: catch InvalidRequest or ValueError."""
        rq_opts, fields = _split(dict(options))
        rq_job = self.queue.enqueue(keys.FUNC_PATH, kwargs=self._kwargs(prompt, fields), **rq_opts)
        return Job(self, rq_job.id)

    def chat(self, messages: list[dict[str, Any]], **options: Any) -> Job:
        """Enqueue one chat job: `submit(messages=messages, **options)`. `messages` are OpenAI-format dicts, rendered
        by the worker with its model's chat template; `options` add the chat fields (add_generation_prompt,
        continue_final_message, chat_template_kwargs, chat_template where the worker trusts it), `tools` /
        `tool_choice` (OpenAI's: the result's `tool_calls` and `content`), sampling fields, `structured_outputs` /
        `response_format`, and RQ's enqueue options. Malformed messages or tools raise InvalidRequest here, before
        anything is enqueued."""
        return self.submit(messages=messages, **options)

    def submit_many(
        self, requests: Iterable[str | list[int] | Mapping[str, Any]], **common: Any
    ) -> list[Job]:
        """Enqueue many jobs in one round trip. Each request is a prompt or a dict of fields (merged over `common`).
        An invalid request raises InvalidRequest (see `submit`) and nothing is enqueued."""
        prepared = []
        for request in requests:
            options = dict(common)
            if isinstance(request, Mapping):
                options.update(request)
                prompt = None
            else:
                prompt = request
            rq_opts, fields = _split(options)
            if "job_timeout" in rq_opts:
                rq_opts["timeout"] = rq_opts.pop("job_timeout")
            prepared.append(
                Queue.prepare_data(keys.FUNC_PATH, kwargs=self._kwargs(prompt, fields), **rq_opts)
            )
        with self.redis.pipeline() as pipe:
            jobs = self.queue.enqueue_many(prepared, pipeline=pipe)
            pipe.execute()
        return [Job(self, j.id) for j in jobs]

    def as_completed(
        self, jobs: Iterable[Job], timeout: float | None = None
    ) -> Iterator[tuple[Job, dict[str, Any] | Exception]]:
        """Yield (job, result dict) or (job, JobFailed / JobCanceled) as each job ends; TimeoutError after
        `timeout` s. A few round trips per wake-up however many jobs (rose.jobs.gather)."""
        return gather.as_completed(self.redis, jobs, timeout)

    def results(
        self, jobs: Iterable[Job], timeout: float | None = None, return_exceptions: bool = False
    ) -> list[Any]:
        """Every job's result, in the order given, once all have ended. A failed or canceled job raises its
        JobFailed / JobCanceled (after all have ended), or, with return_exceptions=True, stands in the list."""
        jobs = list(jobs)
        ended = {job.id: value for job, value in gather.as_completed(self.redis, jobs, timeout)}
        values = [ended[job.id] for job in jobs]
        if not return_exceptions:
            for value in values:
                if isinstance(value, Exception):
                    raise value
        return values

    def job(self, job_id: str) -> Job:
        return Job(self, job_id)

    def cancel(self, job_id: str) -> bool:
        try:
            job = RQJob.fetch(job_id, connection=self.redis, serializer=JSONSerializer)
        except NoSuchJobError:
            return False
        status = job.get_status(refresh=False)
        if status in (JobStatus.FINISHED, JobStatus.FAILED, JobStatus.CANCELED, JobStatus.STOPPED):
            return False
        job.cancel()
        if status != JobStatus.STARTED:
            # No worker will ever see it: publish the terminal event ourselves so streams end.
            publish_event(
                self.redis,
                CanceledEvent(job_id=job_id, seq=0, reason="canceled before it started"),
                ttl=job.get_result_ttl(500),
            )
        return True


def publish_event(r: redis.Redis, event: Any, ttl: int) -> None:
    """PUBLISH + XADD one event (what the worker does for every event), in one round trip."""
    data = event.to_json()
    with r.pipeline(transaction=False) as pipe:
        pipe.publish(keys.tokens_channel(event.job_id), data)
        pipe.xadd(keys.stream_key(event.job_id), {keys.STREAM_FIELD: data})
        if ttl > 0:
            pipe.expire(keys.stream_key(event.job_id), ttl)
        pipe.execute()
