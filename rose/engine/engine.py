"""The step loop: add requests, run one batched forward per step, sample, detokenize, retire finished requests."""

from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedModel

from rose.engine import loader, model_probe
from rose.engine.bad_words import bad_words_token_ids
from rose.engine.block_pool import BlockPool
from rose.engine.config import EngineConfig
from rose.engine.host_malloc import tune_malloc
from rose.engine.kv_budget import plan_store
from rose.engine.kv_cache import KVCache
from rose.engine.kv_cache_manager import KVCacheManager
from rose.engine.layer_spec import first_needed
from rose.engine.logprobs import prompt_logprobs
from rose.engine.lora import LoRARequest, lora_manager
from rose.engine.model_runner import ModelRunner, model_context
from rose.engine.outputs import RequestOutput, StepOutput
from rose.engine.parallel_sampling import ParallelSampling, child_id, child_params
from rose.engine.prompts import room_to_generate, tokenize_prompt
from rose.engine.sampler import Sampler, SamplerOutput, checks_after
from rose.engine.sampling_params import SamplingParams
from rose.engine.scheduler import ScheduledBatch, Scheduler
from rose.engine.sequence import Placement, PromptShare, Sequence, new_sequence
from rose.engine.stopping import eos_token_ids, request_output, sampled_vocab
from rose.engine.structured_outputs import resolve_backend

if TYPE_CHECKING:
    from rose.engine.grammar import StructuredOutputManager

logger = logging.getLogger(__name__)


class Engine:
    """Continuous-batching engine over a paged KV store: a pool of fixed-size blocks, allocated as sequences grow.

    The parts, each the one owner of its state: the scheduler (rose.engine.scheduler: the requests, their status
    and progress; which tokens run next), the KV-cache manager (rose.engine.kv_cache_manager: the blocks, the prefix
    cache), the model runner (one forward over the paged store), the sampler, and the grammars of structured outputs
    (rose.engine.grammar, built for the first constrained request). docs/dev/engine.md draws the step.

    Options: rose.engine.config.EngineConfig, as keyword arguments or as `config` (keyword arguments override it).
    Single-threaded: call every method from the same thread (grammars compile on a small pool of their own).
    """

    def __init__(
        self,
        model: str | os.PathLike | PreTrainedModel,
        tokenizer: Any = None,
        config: EngineConfig | None = None,
        **options: Any,
    ) -> None:
        config = replace(config, **options) if config is not None else EngineConfig(**options)
        self.config = config
        self._structured_backend = resolve_backend(
            config.structured_outputs_backend
        )  # refused before loading
        loaded = loader.load(
            model,
            tokenizer,
            device=config.device,
            dtype=config.dtype,
            trust_remote_code=config.trust_remote_code,
        )
        self.model, self.tokenizer, self.model_name = loaded.model, loaded.tokenizer, loaded.name
        self.device, self.dtype = loaded.device, loaded.dtype
        if self.device.type == "cpu":
            tune_malloc()  # steps reuse their activation memory instead of page-faulting it in again
        self.max_num_seqs = config.max_num_seqs
        self.max_logprobs = config.max_logprobs

        # refuses, before any request, a model rose cannot serve exactly
        layers = model_probe.probe(self.model)
        # adapter slots are allocated before the KV store takes its share of the device's free memory
        self.lora = lora_manager(self.model, config)
        try:
            self._build(config, layers)
        except BaseException:
            if self.lora is not None:
                self.lora.unwrap()  # the caller's model as it was: it may build an engine again
            raise

    def _build(self, config: EngineConfig, layers: model_probe.AttentionLayers) -> None:
        """The KV store, the runner, the scheduler and the sampler, for the probed `layers`."""
        context = layers.exact_context(model_context(self.model.config), config.max_model_len)
        plan = plan_store(
            layers,
            self.device,
            self.dtype,
            context=context,
            max_num_seqs=config.max_num_seqs,
            max_model_len=config.max_model_len,
            max_kv_cache_bytes=config.max_kv_cache_bytes,
            num_gpu_blocks_override=config.num_gpu_blocks_override,
            block_size=config.block_size,
        )
        self.max_model_len, self.block_size = plan.max_model_len, plan.block_size
        self.cache = KVCache(layers.specs, plan.num_blocks, plan.block_size, self.dtype, self.device)
        logger.info(
            "KV store: %d blocks x %d tokens (%d tokens, %.1f MiB), max_model_len %d, up to %d sequences",
            plan.num_blocks,
            plan.block_size,
            plan.num_blocks * plan.block_size,
            self.cache.nbytes / 2**20,
            self.max_model_len,
            config.max_num_seqs,
        )
        # every layer windowed or chunked: blocks that all windows have passed are given back early
        visibilities = frozenset(spec.visibility for spec in layers.specs)
        windowed = (None, None) not in visibilities
        self.kv_cache_manager = KVCacheManager(
            BlockPool(plan.num_blocks, plan.block_size),
            enable_prefix_caching=config.enable_prefix_caching,
            watermark_blocks=plan.watermark_blocks,
            first_needed=functools.partial(first_needed, visibilities) if windowed else None,
        )
        self.vocab_size = vocab = sampled_vocab(self.model, self.tokenizer)
        self.eos_token_ids = eos_token_ids(self.model, self.tokenizer)
        self.scheduler = Scheduler(
            config.max_num_seqs,
            layers.exact_step_tokens(config.max_num_batched_tokens, max(2048, config.max_num_seqs)),
            self.kv_cache_manager,
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.max_model_len,
            lora=self.lora,
        )
        self.sampler = Sampler(vocab, self.device, self.eos_token_ids, seed=config.seed)
        # last: it binds the model's attention to the store (a config error above leaves the model as it was)
        self.runner = ModelRunner(self.model, layers, self.cache, self.lora)
        self._num_steps = 0  # forwards run
        self._undelivered: list[StepOutput] = []  # finished by a step that then raised (see step)
        self._structured: StructuredOutputManager | None = None  # built for the first constrained request
        self.parallel = ParallelSampling()  # requests of n > 1 choices

    # ----------------------------------------------------------------- requests

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | dict[str, Any],
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        deadline: float | None = None,
    ) -> None:
        """Queue a request. Raises ValueError (naming the problem) for one that can never run.

        `prompt`: text (encoded with the tokenizer's special tokens), token ids, or vLLM's TokensPrompt
        `{"prompt_token_ids": [...], "prompt": text}` (ids used as they are; the text, e.g. a rendered chat, is
        only echoed in the output). `lora_request`: the LoRA adapter to run with (an engine built with
        `enable_lora`; read from disk the first time its name is seen, LoRAError when it does not fit the model).
        `deadline` (Unix time): among waiting requests of one priority, those with a deadline are admitted first,
        earliest first (rose.engine.scheduler); the engine never drops a request for it.
        """
        if request_id in self.scheduler.requests or request_id in self.parallel:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        params.verify(self.vocab_size, self.max_logprobs)
        arrival = time.time() if arrival_time is None else arrival_time
        placement = Placement(priority, deadline, arrival, lora_request)  # its deadline checked
        if lora_request is not None:
            if self.lora is None:
                raise ValueError("a LoRA request needs an engine built with enable_lora=True")
            self.lora.register(lora_request)
        bad_words = None
        if params.bad_words:  # tokenized once per request (vLLM: SamplingParams.update_from_tokenizer)
            if self.tokenizer is None:
                raise ValueError(
                    "SamplingParams.bad_words needs a tokenizer to turn the words into tokens; this engine has none"
                )
            bad_words = bad_words_token_ids(params.bad_words, self.tokenizer, self.vocab_size)
        text, ids = tokenize_prompt(prompt, self.tokenizer, self.vocab_size)
        max_tokens = room_to_generate(len(ids), params.max_tokens, self.max_model_len)
        if params.n == 1:
            self.scheduler.add(
                self._sequence(request_id, text, ids, params, max_tokens, bad_words, placement)
            )
            return
        children = [child_id(request_id, i) for i in range(params.n)]
        taken = [c for c in children if c in self.scheduler.requests]
        if taken:
            raise ValueError(f"request id {taken[0]!r} (a choice of {request_id!r}) is already in the engine")
        seqs = [
            self._sequence(c, text, ids, child_params(params, i), max_tokens, bad_words, placement)
            for i, c in enumerate(children)
        ]  # all built before any is added: one that raises adds none
        share = PromptShare(pending=set(children))
        for seq in seqs:
            seq.prompt_share = share
        self.parallel.add(request_id, params.n)
        for seq in seqs:
            self.scheduler.add(seq)

    def _sequence(
        self,
        request_id: str,
        text: str | None,
        ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        bad_words: list[list[int]] | None,
        placement: Placement,
    ) -> Sequence:
        """A sequence of the request (one choice of it), its grammar's request made by this engine's manager."""
        structured = None
        if params.structured_outputs is not None:  # parsed here (invalid: ValueError), compiled on a thread
            structured = self.structured_outputs.make_request(params.structured_outputs)
        return new_sequence(
            request_id,
            text,
            ids,
            params,
            max_tokens=max_tokens,
            bad_words=bad_words,
            placement=placement,
            structured=structured,
            device=self.device,
            tokenizer=self.tokenizer,
        )

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now (every choice of it) and free its blocks. Returns its final output (finish_reason
        "abort" for what had not finished)."""
        # outputs a failed step left for the next one: the request is gone, they must not reach a request added
        # again under its id (a choice finished there still counts as finished)
        ids = {request_id, *self.parallel.children(request_id)}
        stale = [o for o in self._undelivered if o.request_id in ids]
        if stale:
            self._undelivered = [o for o in self._undelivered if o.request_id not in ids]
            done = [o.output for o in self.parallel.step_outputs(stale) if o.finished]
            if done:
                return done[-1]
        if request_id in self.parallel:
            return self.parallel.abort(request_id, self._abort_one)
        return self._abort_one(request_id)

    def _abort_one(self, request_id: str) -> RequestOutput | None:
        seq = self.scheduler.finish_request(request_id, "abort")
        return request_output(seq) if seq is not None else None

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
                disable_any_whitespace=self.config.disable_any_whitespace,
                max_json_whitespace=self.config.max_json_whitespace,
                backend=self._structured_backend,
                compile_timeout=self.config.grammar_compile_timeout,
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

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._undelivered)

    # ----------------------------------------------------------------- the step

    def step(self) -> list[StepOutput]:
        """Run one batched forward; returns what each request that produced a token got from it.

        A request's progress, tokens and retirement change only in `update_from_output`, after the forward and the
        sampler: if either raises, what scheduling did (admissions, preemptions) is consistent and every request
        can be stepped again or aborted by the caller (requests a failed grammar had already finished are reported
        by the next step)."""
        outputs, self._undelivered = self._undelivered, []
        try:
            outputs += self._grammar_errors()
            batch = self._schedule()
            if batch:
                out = self.runner.execute(batch)
                sampled = self._sample(out.logits, batch.sampled)
                prompt = [
                    (p.seq, prompt_logprobs(p.seq, p.first, p.logits, self.vocab_size)) for p in out.prompt
                ]
                outputs += self.scheduler.update_from_output(batch, sampled, prompt)
        except BaseException:
            self._undelivered = outputs
            raise
        return self.parallel.step_outputs(outputs)

    def _schedule(self) -> ScheduledBatch:
        batch = self.scheduler.schedule()
        if not batch and self.scheduler.num_waiting and self._structured is not None:
            # only requests whose grammar is compiling are left: wait for one rather than spin
            compiling = [s.structured for s in self.scheduler.waiting_for_grammar()]
            self._structured.wait_for_any(compiling, timeout=0.05)
            batch = self.scheduler.schedule()
        if batch:
            self._num_steps += 1
        return batch

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput | None:
        """Draw the next token of `seqs` (the logits' rows), through their grammars where they have one."""
        if not seqs:
            return None
        check = None
        if self.scheduler.num_constrained:  # masks that logprobs or truncation need come before the draw
            requests = [s.structured for s in seqs]
            check = self._structured.mask_or_defer(logits, requests, [checks_after(s.params) for s in seqs])
        return self.sampler(logits, seqs, check)

    def _grammar_errors(self) -> list[StepOutput]:
        """Finish the waiting requests whose grammar failed to compile or ran out of time (finish_reason "error")."""
        if self._structured is None or not self._structured.failures_due:
            return []
        steps = []
        for seq in self._structured.take_failed(self.scheduler.waiting_for_grammar()):
            error = seq.structured.error
            out = request_output(self.scheduler.finish_request(seq.request_id, "error"), error)
            steps.append(StepOutput(out.request_id, [], "", True, "error", output=out))
        return steps

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
        return self.kv_cache_manager.num_used

    @property
    def kv_blocks_total(self) -> int:
        return self.kv_cache_manager.num_blocks

    def num_admittable(self, tokens_per_request: int | None = None) -> int:
        """How many more requests the engine can start now (rose.engine.scheduler.Scheduler.num_admittable): what
        a queue worker's intake asks before taking jobs."""
        return self.scheduler.num_admittable(tokens_per_request)

    def get_stats(self) -> dict[str, int | float]:
        stats: dict[str, int | float] = dict(self.kv_cache_manager.get_stats())
        if self._structured is not None:
            stats.update(self._structured.get_stats())
        if self.lora is not None:
            stats.update(self.lora.get_stats())
        kv = self.kv_cache_manager
        return {
            **stats,
            "num_steps": self._num_steps,
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_prefill_tokens": self.scheduler.num_prefill_tokens,
            "kv_tokens_used": sum(kv.num_tokens_held(s) for s in self.scheduler.running),
        }

    def get_request(self, request_id: str) -> Sequence | None:
        """An unfinished request's state (None once it has finished)."""
        return self.scheduler.requests.get(request_id)
