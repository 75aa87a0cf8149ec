"""Admitting the jobs the intake took: each held to the job contract and to its deadline, then added to the engine.

`Admission.admit(run)` returns None once the job's request is in the engine (the job loop then records it as
generating), or a `Refusal` saying how the job fails instead: the contract refused it (no retry; its callbacks as
the contract says), its deadline passed before this attempt started, or the engine refused it (a ValueError, such as
a prompt longer than the context or an adapter not served here: no retry; anything else is an engine error, retried
as RQ's Retry says). `add_to_engine(run)` adds a parsed job's request, also again after the step isolation took it
out. Admission records the job's milestones (taken) and its tenant's queue wait; it never touches the loop's
`running`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rose.config import WorkerSettings
from rose.jobs import contract, tools
from rose.worker import step_outputs
from rose.worker.adapters import Adapters
from rose.worker.engine_protocol import WorkerEngine
from rose.worker.milestones import Milestones
from rose.worker.running import Running
from rose.worker.tenants import Tenants

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a taken job fails instead of running. `deadline`: its deadline had passed (the message is the
    contract's); `callbacks`: whether its failure callback may run."""

    message: str = ""
    retry: bool = True
    deadline: bool = False
    callbacks: bool = True


class Admission:
    """Admits the jobs of one worker into its engine (the module's docstring has the contract)."""

    def __init__(
        self,
        engine: WorkerEngine,
        settings: WorkerSettings,
        queue_names: Callable[[], list[str]],
        tool_parser: Any,
        adapters: Adapters,
        tenants: Tenants,
        milestones: Milestones,
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.queue_names = queue_names
        self.tool_parser = tool_parser
        self.adapters = adapters
        self.tenants = tenants
        self.milestones = milestones

    def admit(self, run: Running) -> Refusal | None:
        self.milestones.taken(run)
        request = contract.parse(
            run.job,
            run.queue.name,
            self.queue_names(),
            self.settings.trust_request_chat_template,
            self.settings.structured_outputs_backend,
            self.tool_parser,
        )
        if isinstance(request, str):
            return Refusal(request, retry=False, callbacks=contract.may_run_callbacks(run.job))
        run.request = request
        run.choices = step_outputs.choices(request)
        self.tenants.on_taken(run)
        if request.deadline is not None and request.deadline <= time.time():
            return Refusal(deadline=True)
        try:
            self.add_to_engine(run)
        except ValueError as exc:  # prompt too long for the context, an adapter not served here, ...
            return Refusal(str(exc), retry=False)
        except Exception as exc:
            log.exception("engine refused job %s", run.id)
            return Refusal(f"engine error while adding the job: {exc!r}")
        return None

    def add_to_engine(self, run: Running) -> None:
        request = run.request
        assert request is not None
        self.engine.add_request(
            run.id,
            request.engine_prompt(self.engine.tokenizer),
            tools.sampling_params(request, self.tool_parser),
            priority=request.priority,
            lora_request=self.adapters.request_for(request.lora),
            deadline=request.deadline,
        )
