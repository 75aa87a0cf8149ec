"""A job this worker has started, from its start in RQ to the moment its end is stored: `Running`, whose `phase`
says where it is, and the job's timeout arithmetic.

    TAKEN ──> GENERATING ──> FINISHED ──> RETIRING ──> (stored: done)
                                │             │
                                └──> CHECKING <──┘ (a success callback; handed back by the retirer)
                                        │
                                     STORING ──> CALLED_BACK ──> (stored by RQ's handler: done)
                                        ^             │
                                        └─ CHECKING / RECHECKING (a Redis error while storing)

TAKEN is a started job being admitted: it fails at once (a bad payload, a prompt the engine refuses) or enters the
engine, and only then the loop's running jobs. Every phase but RETIRING can end otherwise: failed (step error),
canceled or deleted, lost to another worker; the ACTIVE ones (TAKEN, GENERATING) also timed out, past their deadline
or STOPPING (`rq`'s stop commands: stored as stopped, tried again after a Redis error). FINISHED jobs go to the
retirer in batches; jobs with a success callback, and those the retirer hands back, are stored by RQ's own
`handle_job_success` on the loop's thread once a probe has read their status (CHECKING -> STORING): a job canceled
before that read is never stored as finished (RQ's handler WATCHes only the job's dependents: a cancel in the step
between the read and the store comes too late), and a success callback never runs twice. Only the job loop
(rose.worker.loop) moves a job from phase to phase.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rq.executions import Execution
from rq.job import Job
from rq.queue import Queue

from rose.jobs.contract import JobResult, job_result
from rose.jobs.logprobs import LogprobEntry, prompt_logprob_entries
from rose.jobs.schemas import GenerateRequest

log = logging.getLogger("rose.worker.endings")  # the job log (docs/operations.md)

if TYPE_CHECKING:
    from collections.abc import Callable

    from rose.engine.outputs import RequestOutput
    from rose.engine.tool_calls import ToolParser

DEFAULT_JOB_TIMEOUT = Queue.DEFAULT_TIMEOUT  # what RQ applies when neither job nor queue sets one
# Registry entries outlive a dead worker by this much: long enough for a rose-worker to requeue its jobs
# (RQ's cleanup would FAIL them as abandoned once the score passes).
ORPHAN_GRACE_S = 3600


class Phase(enum.Enum):
    TAKEN = "taken"  # started in RQ, not in the engine yet
    GENERATING = "generating"  # in the engine
    FINISHED = "finished"  # the engine is done with it: its result is to be stored
    RETIRING = "retiring"  # in a retirer batch (out of the loop's running jobs)
    CHECKING = "checking"  # to be stored by RQ's handler once a probe has read its status
    STORING = "storing"  # checked: RQ's handler stores it (its success callback first)
    CALLED_BACK = "called_back"  # its success callback ran: RQ's handler stores it
    RECHECKING = "rechecking"  # storing failed after the callback ran: its status is read again
    STOPPING = (
        "stopping"  # an `rq` stop command names it: stored as stopped (tried again after a Redis error)
    )


# phases of a job still running: a stop command, its timeout or its deadline ends it (a finished one is stored)
ACTIVE = (Phase.TAKEN, Phase.GENERATING)
# phases of a job whose status must be read before RQ's handler may store it, and the phase each goes to once read
CHECKED_PHASE = {Phase.CHECKING: Phase.STORING, Phase.RECHECKING: Phase.CALLED_BACK}
# phases in which RQ's handler stores the job on the loop's thread, and the phase each goes back to on a Redis error
STORE_RETRY_PHASE = {Phase.STORING: Phase.CHECKING, Phase.CALLED_BACK: Phase.RECHECKING}


def job_timeout(job: Job) -> int | None:
    """The job's RQ timeout in seconds (the queue's default when unset), None for no limit (RQ's -1)."""
    timeout = job.timeout if job.timeout is not None else DEFAULT_JOB_TIMEOUT
    return None if timeout is None or int(timeout) < 0 else int(timeout)


@dataclass(slots=True)
class Choice:
    """What one choice of a job has generated so far (a job has `n`; most have one)."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[LogprobEntry] | None = None  # one per token, for a job with `logprobs`


@dataclass(slots=True, eq=False)
class Running:
    """A job this worker has started (it may still be waiting in the engine)."""

    job: Job
    queue: Queue
    execution: Execution
    started_wall: float
    started_mono: float
    timeout: int | None  # seconds, None = no limit
    phase: Phase = Phase.TAKEN
    request: GenerateRequest | None = None
    restarted: bool = (
        False  # an earlier attempt left events in the job's stream: this one begins with a reset
    )
    seq: int = 0  # next event seq in the current attempt
    # what each choice has generated so far: one, or the job's `n` (set when it is parsed)
    choices: list[Choice] = field(default_factory=lambda: [Choice()])
    output: RequestOutput | None = None  # the engine's final output, once FINISHED
    result: JobResult | None = None  # the job's RQ result, built from `output` once it is FINISHED
    stream_ttl_due: float = 0.0  # monotonic time at which the next event (re)sets the stream's expiry
    events_batch: int = 0  # the publisher batch carrying the job's latest events (rose.worker.outbox)
    refusals: int = 0  # times Redis refused the job's events (its stream is started over once, not forever)
    queue_s: float | None = None  # seconds on the queue (enqueued to started), when RQ recorded both
    ttft_s: float | None = None  # seconds from start to the first token
    # The job's id and hash key, read once: RQ's properties recompute them, and the loop reads them for every
    # running job at every step (events, probe).
    id: str = field(init=False)
    key: str = field(init=False)

    def __post_init__(self) -> None:
        self.id = self.job.id
        self.key = self.job.key

    @property
    def streamed(self) -> bool:
        """Whether the job's tokens are streamed (its `stream` field; a job not parsed yet has none)."""
        return self.request is not None and self.request.stream

    @property
    def composite_key(self) -> str:
        return self.execution.composite_key

    def registry_ttl(self) -> int:
        """How long the job's StartedJobRegistry entry and execution live without a heartbeat."""
        return (self.timeout or 0) + ORPHAN_GRACE_S

    def past_deadline(self, now: float) -> bool:
        """Whether the job's deadline (Unix time) passed while it runs."""
        deadline = self.request.deadline if self.request is not None else None
        return deadline is not None and self.phase in ACTIVE and now >= deadline

    def timed_out(self, now_mono: float) -> bool:
        """Whether the job ran past its timeout without finishing (a finished job's result is stored regardless)."""
        return (
            self.timeout is not None and self.phase in ACTIVE and now_mono - self.started_mono > self.timeout
        )

    def build_result(
        self,
        worker: str,
        tool_parser: ToolParser | None = None,
        token_bytes: Callable[[int], bytes | None] | None = None,
    ) -> JobResult:
        """The job's RQ result (rose.jobs.contract.job_result) from the engine's final output; `worker`: its name;
        `tool_parser`: the worker's, which reads the calls of a job with tools; `token_bytes`: its tokenizer's
        (rose.engine.token_bytes.TokenBytes), for the entries of a job's `prompt_logprobs`."""
        if self.output is None:
            raise RuntimeError(f"job {self.id} has no final output")
        finals = self.output.outputs
        if len(finals) != len(self.choices) or any(
            "".join(c.text) != final.text for c, final in zip(self.choices, finals, strict=False)
        ):
            log.error("job %s: streamed text differs from the engine's final text (engine bug?)", self.id)
        metadata = self.request.metadata if self.request is not None else None
        return job_result(
            self.output,
            self.job,
            started_wall=self.started_wall,
            worker=worker,
            metadata=metadata,
            logprobs=[c.logprobs for c in self.choices],
            prompt_logprobs=(
                prompt_logprob_entries(self.output.prompt_logprobs, token_bytes)
                if self.output.prompt_logprobs is not None
                else None
            ),
            request=self.request,
            tool_parser=tool_parser,
        )

    @property
    def num_tokens(self) -> int:
        """Tokens generated so far, every choice's."""
        return sum(len(c.token_ids) for c in self.choices)

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq - 1
