"""What the engine hands back: per-step deltas and finished requests."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

# "error": the request could not run at all (its grammar failed to compile after it was queued; see rose.engine.grammar),
# or its JSON-constrained output broke its schema (rose.engine.structured_check; the text is kept)
FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass
class TokenLogprob:
    """Log-probability of one generated token, with the top-N alternatives (token id -> logprob)."""

    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)


@dataclass
class RequestMetrics:
    """Wall-clock times (time.time()) and token counts of one request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    # times its KV blocks were taken back and it was recomputed (rose.engine.scheduler)
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    """The whole result of one request (vLLM's RequestOutput, flattened to one completion)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    metrics: RequestMetrics
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None  # finish_reason "error": why the request could not run, or what its output broke
    # a JSON constraint's output that is not strict JSON valid under its schema: what breaks it ("$.a: ...")
    structured_output_error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class StepOutput:
    """What one engine step did for one request.

    `new_text` is the detokenized delta; concatenating every delta of a request gives its final text exactly.
    `output` is set once the request finishes.
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool = False
    finish_reason: FinishReason | None = None
    new_logprobs: list[TokenLogprob] | None = None
    output: RequestOutput | None = None
