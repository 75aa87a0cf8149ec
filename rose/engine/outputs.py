"""What the engine hands back: per-step deltas and finished requests."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

# "error": the request could not run at all (its grammar failed to compile after it was queued; see rose.engine.grammar),
# or its JSON-constrained output broke its schema (rose.engine.structured_check; the text is kept)
FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass
class TokenLogprob:
    """Log-probability of one token (generated, or of the prompt given the tokens before it), with the top-N
    alternatives (token id -> logprob, most likely first). `rank`: vLLM's rank of the token (1 = most likely; ties
    count against it), for prompt logprobs only."""

    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)
    rank: int | None = None


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
class CompletionOutput:
    """One choice of a request (vLLM's CompletionOutput): a request has `SamplingParams.n` of them."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None  # finish_reason "error": why the request could not run, or what its output broke
    # a JSON constraint's output that is not strict JSON valid under its schema: what breaks it ("$.a: ...")
    structured_output_error: str | None = None


@dataclass
class RequestOutput:
    """The whole result of one request (vLLM's RequestOutput): its prompt, its `outputs` (one per choice, in index
    order) and its metrics (for n > 1: the first token of any choice, the last finish, every choice's tokens).

    `text`, `token_ids`, `finish_reason`, `logprobs`, `error` and `structured_output_error` are the first choice's:
    the only one unless n > 1."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: RequestMetrics
    # SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (nothing comes before it)
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        return self.outputs[0].logprobs

    @property
    def error(self) -> str | None:
        return self.outputs[0].error

    @property
    def structured_output_error(self) -> str | None:
        return self.outputs[0].structured_output_error


@dataclass
class StepOutput:
    """What one engine step did for one request.

    `new_text` is the detokenized delta; concatenating every delta of a choice gives its final text exactly.
    `index`: the choice the tokens belong to (0 unless n > 1); `finish_reason`: set once that choice has finished.
    `finished` and `output` (the final RequestOutput): set once the whole request has, every choice.
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool = False
    finish_reason: FinishReason | None = None
    new_logprobs: list[TokenLogprob] | None = None
    output: RequestOutput | None = None
    index: int = 0
