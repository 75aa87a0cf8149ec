"""One engine step's outputs, read into the jobs they belong to.

`StepOutputs.read(outputs, running, now)` takes the engine's `StepOutput`s of one step, in order, and for each one of
a job in `running` that is still GENERATING (any other output is skipped: a job let go, or one already finished
earlier in the same step):

- new tokens: appended to the job's choice (`out.index`): its text, token ids and, for a job that asked, logprob
  entries (rose.jobs.logprobs); counted for its LoRA adapter, if any (rose.worker.adapters); queued as a token event (`Outbox.token`, `last` once the choice has finished); a job's
  first token is a milestone (`Milestones.first_token`);
- `finished`: the job's held tokens go out now (`Outbox.release`), ahead of its result or error, and the job is
  returned in `Read.ended`: with the failure's message (`contract.failure_message`) and whether RQ's Retry applies if
  a choice finished with "error" (a grammar that did not compile: no retry; an output that broke its schema:
  resampled, it may pass, counted in `structured_output_errors`), else with its final output and result written on
  it (`Running.output`, `Running.result`).

It returns what the step did (`Read`: tokens generated, those of jobs that already had one, the jobs that ended) and
never changes a job's phase, the running jobs or Redis: the loop applies the endings (rose.worker.loop; only it moves
a job between phases, rose.worker.running). `choices(request)` gives a job its empty choices when it is admitted.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rose.engine.token_bytes import TokenBytes
from rose.jobs import contract
from rose.jobs.logprobs import logprob_entries
from rose.worker.adapters import Adapters
from rose.worker.metrics import WorkerMetrics
from rose.worker.milestones import Milestones
from rose.worker.outbox import Outbox
from rose.worker.running import Choice, Phase, Running
from rose.worker.tenants import Tenants

if TYPE_CHECKING:
    from rose.engine.outputs import StepOutput
    from rose.engine.tool_calls import ToolParser
    from rose.jobs.schemas import GenerateRequest


def choices(request: GenerateRequest) -> list[Choice]:
    """A parsed job's choices before its first token: its `n`, each with logprob entries if it asks for them."""
    return [Choice(logprobs=[] if request.logprobs is not None else None) for _ in range(request.n)]


@dataclass(frozen=True, slots=True)
class Ended:
    """A job the engine is done with. `failure`: why it fails (None: its result is built, to be stored); `retry`:
    whether RQ's Retry applies to that failure."""

    run: Running
    failure: str | None = None
    retry: bool = True


@dataclass(frozen=True, slots=True)
class Read:
    """What one step did: `tokens` generated, `steady` of them by jobs that already had one (for the ITL), and the
    jobs that `ended`, in output order."""

    tokens: int = 0
    steady: int = 0
    ended: list[Ended] = field(default_factory=list)


class StepOutputs:
    """Reads steps' outputs into their jobs' choices and the outbox (the module's docstring has the contract)."""

    def __init__(
        self,
        outbox: Outbox,
        milestones: Milestones,
        metrics: WorkerMetrics,
        tokenizer: Any,
        worker: str,
        tool_parser: ToolParser | None,
        adapters: Adapters,
        tenants: Tenants,
    ) -> None:
        self.outbox = outbox
        self.milestones = milestones
        self.metrics = metrics
        self.tokenizer = tokenizer
        self.worker = worker  # its name, in results
        self.tool_parser = tool_parser  # the worker's, which reads the calls of a job with tools
        self.adapters = adapters  # tokens counted per LoRA adapter
        self.tenants = tenants  # tokens served per tenant (fair share)

    @functools.cached_property
    def _token_bytes(self) -> TokenBytes | None:
        """The bytes of a token, for logprobs and prompt logprobs (read once a job needs them)."""
        return TokenBytes(self.tokenizer) if self.tokenizer is not None else None

    def read(self, outputs: Iterable[StepOutput], running: Mapping[str, Running], now: float) -> Read:
        """One step's `outputs` (`running`: the loop's jobs, read only; `now`: the step's wall-clock end)."""
        tokens = steady = 0
        ended: list[Ended] = []
        done: set[str] = set()  # jobs ended earlier in this step
        for out in outputs:
            run = running.get(out.request_id)
            if run is None or run.phase is not Phase.GENERATING or run.id in done:
                continue
            if out.new_token_ids or out.new_text:
                n = len(out.new_token_ids)
                tokens += n
                if run.request is not None and run.request.lora is not None:
                    self.adapters.on_tokens(run.request.lora, n)
                self.tenants.on_tokens(run, n)
                if run.num_tokens:
                    steady += n
                elif n:
                    self.milestones.first_token(run, now)
                self._tokens(run, out)
            if out.finished:
                done.add(run.id)
                self.outbox.release(run)  # its held tokens go out now, ahead of its result
                ended.append(self._ended(run, out))
        return Read(tokens, steady, ended)

    def _tokens(self, run: Running, out: StepOutput) -> None:
        """The output's tokens join its choice and the job's events."""
        choice = run.choices[out.index]
        choice.text.append(out.new_text)
        choice.token_ids.extend(out.new_token_ids)
        logprobs = None
        if choice.logprobs is not None:
            logprobs = logprob_entries(out.new_logprobs or [], self._token_bytes)
            choice.logprobs.extend(logprobs)
        last = out.finish_reason is not None
        self.outbox.token(run, out.new_text, list(out.new_token_ids), logprobs, index=out.index, last=last)

    def _ended(self, run: Running, out: StepOutput) -> Ended:
        """How a finished job ends: "error" (any choice's) fails it, else its result is built."""
        output = out.output  # set on a finished output
        assert output is not None
        generated = sum(len(c.token_ids) for c in output.outputs)
        self.tenants.on_ended(run, len(output.prompt_token_ids), generated)
        error = next((c for c in output.outputs if c.finish_reason == "error"), None)
        if error is None:
            run.output = output
            run.result = run.build_result(self.worker, self.tool_parser, token_bytes=self._token_bytes)
            return Ended(run)
        # a grammar that will not compile fails again under RQ's Retry; resampled, an output may pass
        invalid = error.structured_output_error is not None
        if invalid:
            self.metrics.structured_output_errors.inc()
        return Ended(run, contract.failure_message(error), retry=invalid)
