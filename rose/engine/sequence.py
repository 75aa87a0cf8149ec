"""Per-request state: metadata only. A sequence holds a block table (block ids of the KV store), never KV tensors."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from rose.engine.detokenizer import IncrementalDetokenizer
from rose.engine.outputs import FinishReason, RequestMetrics, TokenLogprob
from rose.engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # xgrammar is imported only by engines that get a constrained request
    from rose.engine.grammar import StructuredOutputRequest
    from rose.engine.lora import LoRARequest


# The entry of a block given back because every window has passed it (Sequence.num_dropped_blocks counts them): a
# valid block id, so that tables built from block_ids need no special case; never read unmasked, never freed.
PASSED_BLOCK = 0


class SequenceStatus(enum.Enum):
    """Set by the scheduler only (rose.engine.scheduler), as vLLM's RequestStatus."""

    WAITING_FOR_GRAMMAR = (
        "waiting_for_grammar"  # queued; its grammar compiles on the pool (vLLM: WAITING_FOR_FSM)
    )
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class PromptShare:
    """The prompt of a request's n choices, computed once (rose.engine.parallel_sampling). Written by the KV cache
    manager alone: the first choice admitted computes the prompt; its full blocks are then held here (one
    reference each) until every other choice has been admitted with them or has left."""

    pending: set[str]  # the choices not admitted yet (and not gone)
    blocks: list[int] = field(default_factory=list)  # the prompt's computed full blocks, while held


@dataclass(frozen=True, slots=True)
class Placement:
    """A request's standing among the others (Engine.add_request's): its priority, deadline and arrival time, and the
    LoRA adapter it runs with (rose.engine.lora.LoRARequest; None: the base model)."""

    priority: int
    deadline: float | None
    arrival: float
    lora_request: LoRARequest | None = None

    def __post_init__(self) -> None:
        deadline = self.deadline
        if deadline is not None and (
            isinstance(deadline, bool) or not isinstance(deadline, int | float) or not math.isfinite(deadline)
        ):
            raise ValueError(f"deadline must be a Unix time in seconds (a finite number), got {deadline!r}")


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: params.max_tokens, or what the context leaves
    metrics: RequestMetrics
    detokenizer: IncrementalDetokenizer | None
    priority: int = 0
    # Unix time: among equal priorities, earliest deadline first (None: after those)
    deadline: float | None = None
    generator: torch.Generator | None = None  # only for seeded requests
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    # SamplingParams.prompt_logprobs: the prompt's entries so far (None first), written by the scheduler alone
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # written by the scheduler alone: the step's progress
    num_computed_tokens: int = 0  # tokens whose K/V are in the store
    # the tokens to prefill before decoding: the prompt, or after a preemption the prompt and the generated tokens
    num_prefill_tokens: int = 0
    # written by the KV-cache manager alone (rose.engine.kv_cache_manager): the blocks it holds
    block_ids: list[int] = field(
        default_factory=list
    )  # block table: position p is in block_ids[p // block_size]
    num_registered_blocks: int = 0  # full blocks indexed by the prefix cache
    # leading blocks given back because every layer's window has passed them (PASSED_BLOCK in block_ids)
    num_dropped_blocks: int = 0
    queue_order: int = 0  # arrival order in the scheduler (ties among equal priorities)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    text: str = ""
    block_hashes: list[int] | None = None  # chained hashes of the full blocks so far (prefix caching only)
    structured: StructuredOutputRequest | None = (
        None  # a constrained request's grammar state (freed when done)
    )
    # SamplingParams.bad_words as token id sequences (rose.engine.bad_words), tokenized once by the engine
    bad_words_token_ids: list[list[int]] | None = None
    # the prompt this choice shares with the other choices of its request (rose.engine.parallel_sampling)
    prompt_share: PromptShare | None = None
    lora_request: LoRARequest | None = (
        None  # the adapter it runs with (rose.engine.lora); None: the base model
    )

    def __post_init__(self) -> None:
        if not self.num_prefill_tokens:
            self.num_prefill_tokens = len(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then generated tokens (a new list)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_prefill_tokens

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def num_preemptions(self) -> int:
        return self.metrics.num_preemptions

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


def new_sequence(
    request_id: str,
    text: str | None,
    ids: list[int],
    params: SamplingParams,
    *,
    max_tokens: int,
    bad_words: list[list[int]] | None,
    placement: Placement,
    structured: StructuredOutputRequest | None,
    device: torch.device,
    tokenizer: Any,
) -> Sequence:
    """A sequence of a request (one choice of it), with its own generator (seeded) and detokenizer.
    `placement`: its priority, deadline, LoRA adapter and arrival time; `structured`: its grammar's request."""
    generator = None
    if params.seed is not None:
        generator = torch.Generator(device=device)
        generator.manual_seed(params.seed)
    detok = None
    if tokenizer is not None and params.detokenize:
        detok = IncrementalDetokenizer(
            tokenizer,
            ids,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
        )
    return Sequence(
        request_id=request_id,
        prompt=text,
        prompt_token_ids=list(ids),
        params=params,
        max_tokens=max_tokens,
        metrics=RequestMetrics(arrival_time=placement.arrival, num_prompt_tokens=len(ids)),
        detokenizer=detok,
        priority=placement.priority,
        deadline=placement.deadline,
        generator=generator,
        logprobs=[] if params.logprobs is not None else None,
        prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
        structured=structured,
        bad_words_token_ids=bad_words,
        lora_request=placement.lora_request,
    )
