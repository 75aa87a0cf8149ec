"""The step loop: add requests, run one batched forward per step, sample, detokenize, retire finished requests."""

from __future__ import annotations

import functools
import logging
import os
import time
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedModel

from rose.engine import loader, model_probe
from rose.engine.block_pool import BlockPool
from rose.engine.detokenizer import IncrementalDetokenizer
from rose.engine.host_malloc import tune_malloc
from rose.engine.kv_budget import plan_store
from rose.engine.kv_cache import KVCache
from rose.engine.layer_spec import first_needed
from rose.engine.model_runner import ModelRunner, model_context
from rose.engine.outputs import RequestMetrics, RequestOutput, StepOutput
from rose.engine.prefix_cache import PrefixCache
from rose.engine.prompts import tokenize_prompt
from rose.engine.sampler import Sampler, checks_after
from rose.engine.sampling_params import SamplingParams
from rose.engine.scheduler import Scheduler
from rose.engine.sequence import Sequence, SequenceStatus
from rose.engine.stopping import append_token, eos_token_ids, request_output
from rose.engine.structured_outputs import (
    DEFAULT_MAX_JSON_WHITESPACE,
    GRAMMAR_COMPILE_TIMEOUT_S,
    resolve_backend,
)

if TYPE_CHECKING:
    from rose.engine.grammar import StructuredOutputManager

logger = logging.getLogger(__name__)


class Engine:
    """Continuous-batching engine over a paged KV store: a pool of fixed-size blocks, allocated as sequences grow.

    `max_num_seqs` caps the running batch; how many sequences run at once is otherwise decided by the blocks free
    (rose.engine.scheduler), with preemption by recompute when decoding sequences outgrow the pool. The pool holds
    `max_kv_cache_bytes` (default: rose.engine.kv_budget), at most what `max_num_seqs` sequences of `max_model_len`
    tokens could use; `num_gpu_blocks_override` (vLLM's name; on any device) sets the number of blocks instead.

        Single-threaded: call every method from the same thread (grammars of structured outputs compile on a small
        pool of their own). `disable_any_whitespace`: JSON constrained by a schema is written on one line (vLLM's
        structured-outputs option of that name); by default any whitespace may separate its tokens, at most
        `max_json_whitespace` characters of it at a time (None: no limit). `structured_outputs_backend`: the
        grammar engine, "guidance" (llguidance), "xgrammar", or "auto" (guidance; rose.engine.grammar_backends).
        `grammar_compile_timeout`: seconds a request waits for its grammar to compile before it fails (None: no
        limit).
    """

    def __init__(
        self,
        model: str | os.PathLike | PreTrainedModel,
        tokenizer: Any = None,
        *,
        device: str | torch.device = "auto",
        dtype: str | torch.dtype = "auto",
        max_num_seqs: int = 256,
        max_model_len: int | None = None,
        max_num_batched_tokens: int | None = None,
        max_kv_cache_bytes: int | None = None,
        num_gpu_blocks_override: int | None = None,
        seed: int = 0,
        max_logprobs: int = 20,
        enable_prefix_caching: bool = False,
        block_size: int | None = None,
        trust_remote_code: bool = False,
        disable_any_whitespace: bool = False,
        max_json_whitespace: int | None = DEFAULT_MAX_JSON_WHITESPACE,
        structured_outputs_backend: str = "auto",
        grammar_compile_timeout: float | None = GRAMMAR_COMPILE_TIMEOUT_S,
    ) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if grammar_compile_timeout is not None and not grammar_compile_timeout > 0:
            raise ValueError(
                f"grammar_compile_timeout must be > 0 or None (no limit), got {grammar_compile_timeout}"
            )
        if max_json_whitespace is not None and max_json_whitespace < 1:
            raise ValueError(
                f"max_json_whitespace must be >= 1 or None (no limit), got {max_json_whitespace}"
            )
        loaded = loader.load(
            model, tokenizer, device=device, dtype=dtype, trust_remote_code=trust_remote_code
        )
        self.model, self.tokenizer, self.model_name = loaded.model, loaded.tokenizer, loaded.name
        self.device, self.dtype = loaded.device, loaded.dtype
        if self.device.type == "cpu":
            tune_malloc()  # steps reuse their activation memory instead of page-faulting it in again
        self.max_num_seqs = max_num_seqs
        self.max_logprobs = max_logprobs

        # refuses, before any request, a model rose cannot serve exactly
        layers = model_probe.probe(self.model)
        context = layers.exact_context(model_context(self.model.config), max_model_len)
        plan = plan_store(
            layers,
            self.device,
            self.dtype,
            context=context,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            max_kv_cache_bytes=max_kv_cache_bytes,
            num_gpu_blocks_override=num_gpu_blocks_override,
            block_size=block_size,
        )
        self.max_model_len, self.block_size = plan.max_model_len, plan.block_size
        self.pool = BlockPool(plan.num_blocks, plan.block_size)
        self.cache = KVCache(layers.specs, plan.num_blocks, plan.block_size, self.dtype, self.device)
        logger.info(
            "KV store: %d blocks x %d tokens (%d tokens, %.1f MiB), max_model_len %d, up to %d sequences",
            plan.num_blocks,
            plan.block_size,
            plan.num_blocks * plan.block_size,
            self.cache.nbytes / 2**20,
            self.max_model_len,
            max_num_seqs,
        )
        self.runner = ModelRunner(self.model, layers, self.cache)
        budget = layers.exact_step_tokens(max_num_batched_tokens, max(2048, max_num_seqs))
        # every layer windowed or chunked: blocks that all windows have passed are given back early
        visibilities = frozenset(spec.visibility for spec in layers.specs)
        windowed = (None, None) not in visibilities
        self.scheduler = Scheduler(
            max_num_seqs,
            budget,
            self.pool,
            watermark_blocks=plan.watermark_blocks,
            first_needed=functools.partial(first_needed, visibilities) if windowed else None,
        )
        self.prefix_cache: PrefixCache | None = None
        if enable_prefix_caching:
            self.prefix_cache = PrefixCache(self.pool)
            self.scheduler.should_defer = self.prefix_cache.pending_overlap
            self.scheduler.lookup_prefix = self.prefix_cache.lookup
            self.scheduler.take_prefix = self.prefix_cache.take

        config_vocab = self.model.config.get_text_config().vocab_size
        vocab = config_vocab
        # ids past the tokenizer are padding rows of the embedding: never sample them
        if self.tokenizer is not None and 0 < len(self.tokenizer) < config_vocab:
            vocab = len(self.tokenizer)
        self.vocab_size = vocab
        self.eos_token_ids = eos_token_ids(self.model, self.tokenizer)
        self.sampler = Sampler(vocab, self.device, self.eos_token_ids, seed=seed)
        self._seqs: dict[str, Sequence] = {}
        self._num_steps = 0  # forwards run
        self._undelivered: list[StepOutput] = []  # finished by a step that then raised (see step)
        self._structured: StructuredOutputManager | None = None  # built for the first constrained request
        self._disable_any_whitespace = disable_any_whitespace
        self._max_json_whitespace = max_json_whitespace
        self._grammar_compile_timeout = grammar_compile_timeout
        self._structured_backend = resolve_backend(
            structured_outputs_backend
        )  # refused here, not at first use
        self.scheduler.is_ready = lambda seq: seq.structured is None or seq.structured.is_ready

    # ----------------------------------------------------------------- requests

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | dict[str, Any],
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request. Raises ValueError (naming the problem) for one that can never run.

        `prompt`: text (encoded with the tokenizer's special tokens), token ids, or vLLM's TokensPrompt
        `{"prompt_token_ids": [...], "prompt": text}` (ids used as they are; the text, e.g. a rendered chat, is
        only echoed in the output).
        """
        if request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if params.logprobs is not None and params.logprobs > self.max_logprobs:
            raise ValueError(
                f"SamplingParams.logprobs must be <= {self.max_logprobs} (the engine's max_logprobs), "
                f"got {params.logprobs}"
            )
        bad_stops = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad_stops:
            raise ValueError(
                f"SamplingParams.stop_token_ids must be in [0, {self.vocab_size}) (the model's vocabulary), "
                f"got {bad_stops[:5]}"
            )
        text, ids = tokenize_prompt(prompt, self.tokenizer, self.vocab_size)
        if ids and params.max_tokens is None and len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens, which leaves no room to generate within max_model_len "
                f"{self.max_model_len}"
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(ids)
        if len(ids) + max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) = {len(ids) + max_tokens} exceeds "
                f"max_model_len {self.max_model_len}: shorten the prompt or lower max_tokens"
            )
        structured = None
        if params.structured_outputs is not None:  # parsed here (invalid: ValueError), compiled on a thread
            structured = self.structured_outputs.make_request(params.structured_outputs)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
        detok = None
        if self.tokenizer is not None and params.detokenize:
            detok = IncrementalDetokenizer(
                self.tokenizer,
                ids,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
        seq = Sequence(
            request_id=request_id,
            prompt=text,
            prompt_token_ids=ids,
            params=params,
            max_tokens=max_tokens,
            metrics=RequestMetrics(
                arrival_time=time.time() if arrival_time is None else arrival_time, num_prompt_tokens=len(ids)
            ),
            detokenizer=detok,
            priority=priority,
            generator=generator,
            logprobs=[] if params.logprobs is not None else None,
            structured=structured,
        )
        if structured is not None:
            self._structured.num_live += 1
        self._seqs[request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks. Returns its final output (finish_reason "abort")."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return None
        return self._finish_now(seq, "abort")

    def _finish_now(self, seq: Sequence, reason: str) -> RequestOutput:
        self._remove(seq)
        seq.finish_reason = reason
        seq.metrics.finished_time = time.time()
        if seq.detokenizer is not None:
            seq.text = seq.detokenizer.emitted_text
        return request_output(seq)

    @property
    def structured_outputs(self) -> StructuredOutputManager:
        """The grammar machinery (rose.engine.grammar), built on first use: xgrammar loads only when needed."""
        if self._structured is None:
            from rose.engine.grammar import StructuredOutputManager

            self._structured = StructuredOutputManager(
                self.tokenizer,
                self.vocab_size,
                self.eos_token_ids,
                self.device,
                disable_any_whitespace=self._disable_any_whitespace,
                max_json_whitespace=self._max_json_whitespace,
                backend=self._structured_backend,
                compile_timeout=self._grammar_compile_timeout,
            )
        return self._structured

    def prepare_structured_outputs(self) -> None:
        """Build the grammar machinery now (xgrammar's import, the tokenizer's vocabulary scan: ~0.2 s for 8k
        tokens, more for a large vocabulary) rather than inside the first constrained request's `add_request`.
        A no-op without a tokenizer (constrained requests are then refused)."""
        if self.tokenizer is not None:
            self.structured_outputs  # noqa: B018 - built on access
            if self.device.type == "cpu":
                from rose.engine import cpu_bitmask

                cpu_bitmask.warm()

    def close(self) -> None:
        """Stop the grammar compile pool (compiles not started are cancelled). Call when done with the engine."""
        if self._structured is not None:
            self._structured.shutdown()

    def _grammar_errors(self) -> list[StepOutput]:
        """Finish the waiting requests whose grammar failed to compile on the pool (finish_reason "error")."""
        steps = []
        for seq in self._structured.take_failed(self.scheduler.waiting_seqs()):
            error = seq.structured.error
            out = self._finish_now(self._seqs.pop(seq.request_id), "error")
            out.error = error
            steps.append(StepOutput(out.request_id, [], "", True, "error", output=out))
        return steps

    def _remove(self, seq: Sequence) -> None:
        if seq.structured is not None:
            seq.structured = None  # frees the matcher
            self._structured.num_live -= 1
        self.scheduler.remove(seq)  # its cached full blocks stay in the pool for prefix hits until evicted

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._undelivered)

    # ----------------------------------------------------------------- the step

    def step(self) -> list[StepOutput]:
        """Run one batched forward; returns what each request that produced a token got from it."""
        structured = self._structured if self._structured is not None and self._structured.num_live else None
        errors, self._undelivered = self._undelivered, []
        if structured is not None and structured.failures_due:
            errors += self._grammar_errors()
        try:
            outputs = self._forward(structured)
        except BaseException:
            self._undelivered = errors  # requests already finished with an error: reported by the next step
            raise
        return errors + outputs if errors else outputs

    def _forward(self, structured: StructuredOutputManager | None) -> list[StepOutput]:
        batch = self.scheduler.schedule()
        if not batch and structured is not None and self.scheduler.num_waiting:
            # only requests whose grammar is compiling are left: wait for one rather than spin
            waiting = [s.structured for s in self.scheduler.waiting_seqs() if s.structured is not None]
            structured.wait_for_any(waiting, timeout=0.05)
            batch = self.scheduler.schedule()
        if not batch:
            return []
        self._num_steps += 1
        now = time.time()
        for chunk in batch.prefill:
            if chunk.seq.metrics.first_scheduled_time is None:
                chunk.seq.metrics.first_scheduled_time = now
        logits = self.runner.execute(batch)
        sampled = list(batch.decode) + [c.seq for c in batch.prefill if c.completes_prefill]
        check = None
        if structured is not None and sampled:  # masks that logprobs or truncation need come before the draw
            requests = [s.structured for s in sampled]
            check = structured.mask_or_defer(logits, requests, [checks_after(s.params) for s in sampled])
        result = self.sampler(logits, sampled, check) if sampled else None

        # Only now, with the forward and the sampler done, does the step change request state: an exception above
        # leaves every request as it was, so the caller can abort the ones it touched and carry on.
        for seq in batch.decode:
            seq.num_computed_tokens += 1
        for chunk in batch.prefill:
            chunk.seq.num_computed_tokens += chunk.length
            if chunk.completes_prefill:
                self.scheduler.prefill_done(chunk.seq)
        # registered before passed blocks go back to the pool: they stay findable in its free queue
        if self.prefix_cache is not None:
            for seq in batch.decode:
                self.prefix_cache.register(seq)
            for chunk in batch.prefill:
                self.prefix_cache.register(chunk.seq)
        self.scheduler.drop_passed_blocks([*batch.decode, *(chunk.seq for chunk in batch.prefill)])
        if result is None:
            return []
        now = time.time()
        outputs = [
            append_token(seq, tok, lp, now, self.eos_token_ids, self.max_model_len)
            for seq, tok, lp in zip(sampled, result.token_ids, result.logprobs, strict=True)
        ]
        for out in outputs:
            if out.finished:
                self._remove(self._seqs.pop(out.request_id))
        return outputs

    # ----------------------------------------------------------------- counters

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def kv_blocks_used(self) -> int:
        """Blocks held by running sequences."""
        return self.pool.num_used

    @property
    def kv_blocks_total(self) -> int:
        return self.pool.num_blocks

    def num_admittable(self, tokens_per_request: int | None = None) -> int:
        """How many more requests the engine can start now (rose.engine.scheduler.Scheduler.num_admittable): what
        a queue worker's intake asks before taking jobs."""
        return self.scheduler.num_admittable(tokens_per_request)

    def get_stats(self) -> dict[str, int | float]:
        prefix = self.prefix_cache.get_stats() if self.prefix_cache is not None else {}
        if self._structured is not None:
            prefix.update(self._structured.get_stats())
        return {
            **prefix,
            "num_steps": self._num_steps,
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
            "num_preemptions": self.scheduler.num_preemptions,
            "kv_blocks_used": self.kv_blocks_used,
            "kv_blocks_free": self.pool.num_free,
            "kv_blocks_total": self.kv_blocks_total,
            "kv_block_size": self.block_size,
            "kv_tokens_used": sum(
                s.num_computed_tokens - s.num_dropped_blocks * self.block_size for s in self.scheduler.running
            ),
            "kv_tokens_total": self.pool.num_blocks * self.block_size,
        }

    def get_request(self, request_id: str) -> Sequence | None:
        seq = self._seqs.get(request_id)
        return seq if seq is not None and seq.status is not SequenceStatus.FINISHED else None
