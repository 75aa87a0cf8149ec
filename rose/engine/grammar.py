"""Structured outputs as vLLM V1 does them (StructuredOutputManager + a grammar backend: xgrammar or llguidance,
rose.engine.grammar_backends, where everything touching either library lives).

* `StructuredOutputManager` is built once per engine from its tokenizer (vocabulary = the engine's sampled
  vocabulary, stop tokens = the engine's EOS ids, so a grammar lets EOS through only where it can end).
* `make_request` parses a request's constraint on the caller's thread (fast; an invalid schema / regex / grammar
  raises ValueError there), then compiles it on a small thread pool (both backends release the GIL while
  compiling): the request holds a future. Compiled grammars are cached by `StructuredOutputsParams.key`; a cache
  hit is a future that is already done.
* Each request's `StructuredOutputRequest` owns its matcher (created on first use, once the grammar is compiled).
* `apply_grammar_bitmask` fills the next-token bitmask of the constrained rows of a step and sets their disallowed
  logits to -inf; unconstrained rows are not touched. `mask_or_defer` does so only for the rows that need their
  mask before the draw, and returns a `GrammarCheck` that the sampler asks about the others' drawn tokens
  (rose.engine.sampler: a mask only for a refused token; `mask_first` turns that off).

A compile that fails on the pool (rare: the grammar already parsed at add time) leaves the request's
`StructuredOutputRequest.error` set; the engine then finishes that request with finish_reason "error".
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import torch

from rose.engine.grammar_backends import Backend, clean_error, make_backend
from rose.engine.logits_mask import LogitsMasker
from rose.engine.structured_outputs import (
    DEFAULT_MAX_JSON_WHITESPACE,
    GRAMMAR_COMPILE_TIMEOUT_S,
    StructuredOutputsParams,
    resolve_backend,
)

logger = logging.getLogger(__name__)

_CACHE_ENTRIES = 512  # compiled grammars kept (least recently used dropped first)
# ... and at most this much memory in them: a grammar's token masks grow with the vocabulary and with the JSON
# whitespace bound (xgrammar keeps a mask per counted position: ~7 MB for a 4-field schema at 128k tokens and 20)
CACHE_BYTES = 512 << 20
SAMPLES = 100_000  # mask calls whose costs are kept for take_step_samples


@dataclass
class StructuredOutputStats:
    requests: int = 0  # constrained requests added
    compiles: int = 0  # grammars compiled (cache misses)
    cache_hits: int = 0
    compile_seconds: float = 0.0  # total, on the pool
    compile_errors: int = 0
    mask_calls: int = 0  # calls that masked at least one row (a step may make two: rows masked first, then
    # rows whose drawn token was refused)
    masked_rows: int = 0  # rows masked, over those steps
    mask_seconds: float = 0.0  # bitmask fill + apply, on the loop thread
    fill_seconds: float = 0.0  # of which the backend's bitmask fill
    checked_rows: int = 0  # rows drawn unmasked, then checked against their grammar
    refused_rows: int = 0  # of which the grammar refused the token: masked and drawn again
    check_seconds: float = 0.0  # asking the grammars about drawn tokens, on the loop thread


class StructuredOutputRequest:
    """One request's constraint: its compiled grammar (a future until the pool is done) and its matcher."""

    __slots__ = ("params", "future", "backend", "timeout", "deadline", "_matcher", "refused")

    def __init__(
        self, params: StructuredOutputsParams, future: Future, backend: Backend, timeout: float | None = None
    ) -> None:
        self.params = params
        self.future = future
        self.backend = backend
        self.timeout = timeout
        # time.monotonic() by which the compile must be done (None: no limit, or done already)
        self.deadline = None if timeout is None or future.done() else time.monotonic() + timeout
        self._matcher: Any = None
        self.refused: int | None = None  # a sampled token the grammar refused (see advance)

    @property
    def is_ready(self) -> bool:
        """Compiled without error: the request may be scheduled."""
        return self.future.done() and not self.future.cancelled() and self.future.exception() is None

    @property
    def error(self) -> str | None:
        """Why the grammar could not be compiled, once the pool has given up on it or its time is up."""
        if not self.future.done():
            if self.deadline is not None and time.monotonic() > self.deadline:
                return (
                    f"structured_outputs.{self.params.kind}: compiling it took longer than {self.timeout:g} s"
                )
            return None
        if self.future.cancelled():
            return f"structured_outputs.{self.params.kind}: the compile was cancelled (engine closed)"
        exc = self.future.exception()
        return None if exc is None else f"structured_outputs.{self.params.kind}: {clean_error(exc)}"

    def wait(self, timeout: float | None = None) -> None:
        """Block until the grammar is compiled (TimeoutError after `timeout` s); ValueError if it failed."""
        wait([self.future], timeout=timeout)
        if not self.future.done():
            raise TimeoutError(f"structured_outputs.{self.params.kind}: still compiling after {timeout} s")
        if self.error is not None:
            raise ValueError(self.error)

    @property
    def matcher(self) -> Any:
        """The request's matcher (its position in the grammar), made on first use: only once `is_ready`."""
        if self._matcher is None:
            self._matcher = self.backend.matcher(self.future.result())
        return self._matcher

    def advance(self, token: int, request_id: str = "") -> bool:
        """Feed the sampled token to the matcher; True once the grammar has ended (it accepted a stop token).

        A token the grammar refuses cannot come from the masked sampler; should one come anyway, it is kept in
        `refused` and the request ends here (the engine finishes it with finish_reason "error") rather than go on
        unconstrained.
        """
        if not self.backend.accept(self.matcher, token):
            logger.error("request %s: the grammar refused sampled token %d", request_id, token)
            self.refused = token
            return True
        return self.backend.ended(self._matcher, token)

    def allows(self, token: int) -> bool:
        """Whether the grammar would accept `token` now (the matcher is left as it was)."""
        return self.backend.allows(self.matcher, token)


@dataclass(slots=True)
class GrammarCheck:
    """The grammars of the rows of a step whose tokens are checked after the draw (rose.engine.sampler.TokenCheck):
    `requests[i]` is row i's, None where the row was masked before the draw or is unconstrained."""

    manager: StructuredOutputManager
    requests: list[StructuredOutputRequest | None]

    def refused(self, token_ids: list[int]) -> list[int]:
        start = time.perf_counter()
        rows = [i for i, r in enumerate(self.requests) if r is not None and not r.allows(token_ids[i])]
        stats = self.manager.stats
        stats.check_seconds += time.perf_counter() - start
        stats.checked_rows += sum(r is not None for r in self.requests)
        stats.refused_rows += len(rows)
        return rows

    def mask(self, logits: torch.Tensor, rows: list[int]) -> None:
        self.manager.apply_grammar_bitmask(logits, [self.requests[i] for i in rows])


class StructuredOutputManager:
    """Compiles and caches grammars, and masks the logits of constrained rows. Use from the engine's thread."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: set[int] | list[int],
        device: torch.device,
        max_workers: int | None = None,
        disable_any_whitespace: bool = False,
        mask_backend: str = "auto",
        max_json_whitespace: int | None = DEFAULT_MAX_JSON_WHITESPACE,
        cache_bytes: int = CACHE_BYTES,
        backend: str = "auto",
        compile_timeout: float | None = GRAMMAR_COMPILE_TIMEOUT_S,
        mask_first: bool = False,
    ) -> None:
        if tokenizer is None:
            raise ValueError("structured outputs need a tokenizer; this engine has none")
        if max_json_whitespace is not None and max_json_whitespace < 1:
            raise ValueError(
                f"max_json_whitespace must be >= 1 or None (no limit), got {max_json_whitespace}"
            )
        self.vocab_size = vocab_size
        self.device = device
        self.any_whitespace = not disable_any_whitespace
        self.max_json_whitespace = max_json_whitespace
        self.cache_bytes = cache_bytes
        self.compile_timeout = compile_timeout  # seconds a request waits for its grammar before it fails
        self.mask_first = mask_first  # every constrained row masked before the draw (no GrammarCheck)
        self._next_deadline: float | None = (
            None  # the earliest deadline of a compile not done: take_failed looks then
        )
        cpus = os.cpu_count() or 1
        # On a CPU engine, compiles share the cores with the forward: one compile at a time, on half the cores.
        on_cpu = device.type == "cpu"
        self.backend: Backend = make_backend(
            resolve_backend(backend),
            tokenizer,
            vocab_size,
            sorted(stop_token_ids),
            max(1, cpus // 2) if on_cpu else min(8, cpus),
            self.any_whitespace,
            max_json_whitespace,
        )
        # as vLLM (GPU engine): half the CPUs compile; the compile releases the GIL so the step loop keeps running
        default_workers = 1 if on_cpu else max(1, (cpus + 1) // 2)
        workers = max_workers if max_workers is not None else default_workers
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rose-grammar")
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._stats_lock = threading.Lock()  # compile figures are written on the pool
        self.stats = StructuredOutputStats()
        # (fill seconds per row, apply seconds) per mask call; on CUDA the apply is its launch (not synced)
        self.step_samples: deque[tuple[float, float]] = deque(maxlen=SAMPLES)
        self.first_compile_seconds: float | None = None
        self.failed = False  # a compile failed on the pool: the engine looks for its requests
        self.masker = LogitsMasker(vocab_size, device, mask_backend)  # rose.engine.logits_mask

    # ------------------------------------------------------------------ compile

    def make_request(self, params: StructuredOutputsParams) -> StructuredOutputRequest:
        """Start (or find) the compile of `params`. Raises ValueError at once for an invalid constraint."""
        self.stats.requests += 1
        future = self._cache.get(params.key)
        if future is not None and not (future.done() and future.exception() is not None):
            self._cache.move_to_end(params.key)
            self.stats.cache_hits += 1
        else:
            grammar = self.backend.parse(params)  # raises on this thread
            future = self._executor.submit(self._compile, grammar)
            future.add_done_callback(self._on_done)
            self._cache[params.key] = future
            self._evict()
        request = StructuredOutputRequest(params, future, self.backend, self.compile_timeout)
        if request.deadline is not None:
            self._next_deadline = min(request.deadline, self._next_deadline or request.deadline)
        return request

    def _evict(self) -> None:
        """Drop the least recently used grammars past _CACHE_ENTRIES, or past `cache_bytes` of compiled ones (the
        newest always stays). A grammar dropped here lives on in the requests that use it."""
        while len(self._cache) > _CACHE_ENTRIES:
            self._cache.popitem(last=False)
        sizes = [
            self.backend.size(f.result()) if f.done() and f.exception() is None else 0
            for f in self._cache.values()
        ]
        total = sum(sizes)
        for size in sizes[:-1]:
            if total <= self.cache_bytes:
                break
            self._cache.popitem(last=False)
            total -= size

    def _compile(self, grammar: Any) -> Any:
        start = time.perf_counter()
        compiled = self.backend.compile(grammar)
        elapsed = time.perf_counter() - start
        with self._stats_lock:
            self.stats.compiles += 1
            self.stats.compile_seconds += elapsed
            if self.first_compile_seconds is None:
                self.first_compile_seconds = elapsed
        return compiled

    def _on_done(self, future: Future) -> None:
        exc = future.exception()
        if exc is not None:
            logger.error("grammar compile failed: %s", clean_error(exc))
            with self._stats_lock:
                self.stats.compile_errors += 1
            self.failed = True

    @property
    def failures_due(self) -> bool:
        """A compile failed, or the earliest deadline of one still running has passed: `take_failed` has work."""
        return self.failed or (self._next_deadline is not None and time.monotonic() > self._next_deadline)

    def take_failed(self, waiting: list[Any]) -> list[Any]:
        """The sequences among `waiting` whose grammar failed to compile or ran out of time (each logged), once
        `failures_due`."""
        if not self.failures_due:
            return []
        self.failed = False
        failed = [seq for seq in waiting if seq.structured is not None and seq.structured.error is not None]
        for seq in failed:
            logger.error("request %s finished with an error: %s", seq.request_id, seq.structured.error)
        pending = [
            seq.structured.deadline
            for seq in waiting
            if seq not in failed and seq.structured is not None and seq.structured.deadline is not None
        ]
        self._next_deadline = min(pending, default=None)
        return failed

    def wait_for_any(self, requests: list[StructuredOutputRequest], timeout: float) -> None:
        """Block up to `timeout` seconds until one of the requests' grammars is compiled (no busy spinning)."""
        pending = {r.future for r in requests if not r.future.done()}
        if pending:
            wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ masking

    def mask_or_defer(
        self,
        logits: torch.Tensor,
        requests: list[StructuredOutputRequest | None],
        checkable: list[bool],
    ) -> GrammarCheck | None:
        """Mask the constrained rows that need their mask before the draw (`checkable[i]` False: see
        rose.engine.sampler.checks_after); the check the sampler makes of the others' tokens (None: no such row)."""
        if self.mask_first:
            checkable = [False] * len(requests)
        now = [None if ok else r for r, ok in zip(requests, checkable, strict=True)]
        self.apply_grammar_bitmask(logits, now)
        later = [r if ok else None for r, ok in zip(requests, checkable, strict=True)]
        return GrammarCheck(self, later) if any(r is not None for r in later) else None

    @torch.inference_mode()  # the logits are an inference tensor: in-place updates need the mode
    def apply_grammar_bitmask(
        self, logits: torch.Tensor, requests: list[StructuredOutputRequest | None]
    ) -> None:
        """Mask, in place, the logits of the rows whose request is constrained (`requests[i]` not None).

        `logits` is [len(requests), >= vocab]; columns from the manager's vocabulary on are left alone (the sampler
        never looks at them). Reads matcher state, never advances it. Counted in `get_stats()` (calls, rows, time).
        """
        rows = [i for i, r in enumerate(requests) if r is not None]
        if not rows:
            return
        start = time.perf_counter()
        filled = self._mask(logits, requests, rows)
        end = time.perf_counter()
        st = self.stats
        st.mask_calls += 1
        st.masked_rows += len(rows)
        st.mask_seconds += end - start
        st.fill_seconds += filled - start
        self.step_samples.append(((filled - start) / len(rows), end - filled))

    def take_step_samples(self) -> list[tuple[float, float]]:
        """(fill seconds per row, apply seconds) of each mask call since the last call (the most recent
        SAMPLES kept): what the distribution of the mask's cost is, for benchmarks."""
        samples = list(self.step_samples)
        self.step_samples.clear()
        return samples

    def _mask(
        self, logits: torch.Tensor, requests: list[StructuredOutputRequest | None], rows: list[int]
    ) -> float:
        """Fill and apply; returns the time.perf_counter() at which the fill was done."""
        bitmask = self.masker.bitmask(len(rows))
        self.backend.fill([requests[i].matcher for i in rows], bitmask)
        filled = time.perf_counter()
        self.masker.apply(logits, bitmask, rows)
        return filled

    def get_stats(self) -> dict[str, int | float]:
        with self._stats_lock:
            st = self.stats
            return {
                "structured_output_requests": st.requests,
                "structured_output_compiles": st.compiles,
                "structured_output_cache_hits": st.cache_hits,
                "structured_output_compile_errors": st.compile_errors,
                "structured_output_compile_s": round(st.compile_seconds, 6),
                "structured_output_mask_calls": st.mask_calls,
                "structured_output_masked_rows": st.masked_rows,
                "structured_output_mask_s": st.mask_seconds,
                "structured_output_fill_s": st.fill_seconds,
                "structured_output_checked_rows": st.checked_rows,
                "structured_output_refused_rows": st.refused_rows,
                "structured_output_check_s": st.check_seconds,
            }
