"""n choices of one request (`SamplingParams.n`, vLLM's parallel sampling), run as n child sequences and handed back
as one request.

The children are ordinary requests to the scheduler, with vLLM's ids (`"{index}_{request_id}"`) and the parent's
params with n = 1 and, when the parent is seeded, seed + index (vLLM's rule: each choice is reproducible alone, and
the choices differ). Their prompt is computed once: the engine marks every child after the first as sharing the
first one's prompt (`Sequence.shares_prompt_with`), and the KV cache manager admits it only once the first child's
prefill is done, with the prompt's full blocks shared (rose.engine.kv_cache_manager); each child computes only the
prompt's last, partial block again, as a prefix-cache hit would.

`ParallelSampling` owns the parent requests: `add` registers one and names its children, `step_outputs` turns the
children's step outputs into the parent's (its id, the choice's `index`; `finished` and the merged `output` once the
last choice has finished), `abort` ends every choice of a parent.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from rose.engine.outputs import RequestMetrics, RequestOutput, StepOutput
from rose.engine.sampling_params import SamplingParams

_SEED_MOD = 2**64  # torch's seeds are 64-bit: seed + index wraps past the top


def child_id(request_id: str, index: int) -> str:
    return f"{index}_{request_id}"


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The params of choice `index`: n = 1, seed + index when seeded."""
    seed = params.seed
    if seed is not None:
        seed = (seed + index) % _SEED_MOD if seed >= 0 else seed + index
    return dataclasses.replace(params, n=1, seed=seed)


@dataclass(slots=True)
class ParentRequest:
    request_id: str
    children: list[str]
    finals: list[RequestOutput | None] = field(
        default_factory=list
    )  # each choice's final output, once finished

    def __post_init__(self) -> None:
        self.finals = [None] * len(self.children)


class ParallelSampling:
    def __init__(self) -> None:
        self._parents: dict[str, ParentRequest] = {}
        self._children: dict[str, tuple[ParentRequest, int]] = {}  # child id -> (its parent, its index)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._parents

    def children(self, request_id: str) -> list[str]:
        """The ids of the choices of parent `request_id` (none if it is not one)."""
        parent = self._parents.get(request_id)
        return list(parent.children) if parent is not None else []

    def add(self, request_id: str, n: int) -> list[str]:
        """Register a request of `n` choices; returns its children's ids, in index order."""
        parent = ParentRequest(request_id, [child_id(request_id, i) for i in range(n)])
        self._parents[request_id] = parent
        for i, child in enumerate(parent.children):
            self._children[child] = (parent, i)
        return parent.children

    def step_outputs(self, outputs: list[StepOutput]) -> list[StepOutput]:
        """The children's outputs of a step as their parents' (others pass through)."""
        if not self._children:
            return outputs
        return [self._as_parents(out) if out.request_id in self._children else out for out in outputs]

    def abort(
        self, request_id: str, abort_child: Callable[[str], RequestOutput | None]
    ) -> RequestOutput | None:
        """End every unfinished choice of the parent `request_id` with `abort_child(child id)` (the engine's abort of
        one sequence); the parent's merged output, None if it is not one."""
        parent = self._parents.get(request_id)
        if parent is None:
            return None
        for i, child in enumerate(parent.children):
            if parent.finals[i] is None:
                parent.finals[i] = abort_child(child)
        return self._finish(parent)

    def _as_parents(self, out: StepOutput) -> StepOutput:
        parent, index = self._children[out.request_id]
        merged = None
        if out.output is not None:
            parent.finals[index] = out.output
            if all(final is not None for final in parent.finals):
                merged = self._finish(parent)
        return dataclasses.replace(
            out, request_id=parent.request_id, index=index, finished=merged is not None, output=merged
        )

    def _finish(self, parent: ParentRequest) -> RequestOutput | None:
        """The parent's output from its choices' (forgetting it); None if a choice has none (never added)."""
        del self._parents[parent.request_id]
        for child in parent.children:
            self._children.pop(child, None)
        finals = [final for final in parent.finals if final is not None]
        if len(finals) < len(parent.finals):
            return None
        first = finals[0]
        outputs = [dataclasses.replace(final.outputs[0], index=i) for i, final in enumerate(finals)]
        # the prompt's entries: those of a choice that computed the whole prompt (the first admitted, or one that
        # recomputed it after a preemption); the others shared its blocks and hold fewer
        prompt_logprobs = max(
            (final.prompt_logprobs for final in finals), key=lambda e: -1 if e is None else len(e)
        )
        return RequestOutput(
            parent.request_id,
            first.prompt,
            first.prompt_token_ids,
            outputs,
            merge_metrics([final.metrics for final in finals]),
            prompt_logprobs,
        )


def merge_metrics(metrics: list[RequestMetrics]) -> RequestMetrics:
    """One request's metrics from its choices': the first arrival, schedule and token, the last finish, every
    choice's tokens and preemptions (the prompt counted once)."""

    def first(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return min(known) if known else None

    finished = [m.finished_time for m in metrics]
    return RequestMetrics(
        arrival_time=min(m.arrival_time for m in metrics),
        first_scheduled_time=first([m.first_scheduled_time for m in metrics]),
        first_token_time=first([m.first_token_time for m in metrics]),
        finished_time=max(finished) if all(f is not None for f in finished) else None,
        num_prompt_tokens=metrics[0].num_prompt_tokens,
        num_generated_tokens=sum(m.num_generated_tokens for m in metrics),
        num_preemptions=sum(m.num_preemptions for m in metrics),
    )
