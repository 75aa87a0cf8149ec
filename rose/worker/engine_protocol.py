"""What rose-worker uses of an engine: `WorkerEngine`, every call and attribute, and nothing else.

rose.engine.engine.Engine is the engine a worker runs (rose.worker.cli builds it); rose.bench.sim_engine.SimEngine
(the fleet simulation) and the tests' fakes (tests/worker/worker_helpers.FakeEngine) stand in for it. The worker
reads each of these members as it is, with no default: a stand-in has them all. It calls every method from its
loop's thread, and never closes the engine: whoever built it does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from rose.engine.lora import LoRARequest
    from rose.engine.outputs import RequestOutput, StepOutput
    from rose.engine.sampling_params import SamplingParams


@runtime_checkable
class WorkerEngine(Protocol):
    """A continuous-batching engine as the job loop (rose.worker.loop), the worker (rose.worker.worker) and its
    metrics (rose.worker.metrics) use it."""

    # ---- requests: the job loop ---------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | dict[str, Any],
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        deadline: float | None = None,
    ) -> None:
        """Queue a request (the job's id), with the job's LoRA adapter (None: the base model; rose.worker.adapters)
        and deadline (Unix time: earliest first among waiting requests of one priority).
        Raises ValueError for one that can never run: the job fails without retry; anything else fails it with
        RQ's Retry."""

    def abort(self, request_id: str) -> RequestOutput | None:
        """Drop a request now, freeing what it holds (its job was canceled, stopped, failed or let go)."""

    def step(self) -> list[StepOutput]:
        """One batched forward: each request's new tokens, and its final output once finished. A step that raises
        leaves every request as it was (rose.worker.isolate looks for the requests that make it raise)."""

    def has_unfinished(self) -> bool:
        """Requests queued or running: the loop steps, and does not block on the queues, while there are."""

    def num_admittable(self) -> int:
        """How many more requests it can start now (its free KV blocks): how many jobs the intake takes."""

    @property
    def tokenizer(self) -> Any:
        """Renders a job's chat messages (GenerateRequest.engine_prompt); None without one."""

    # ---- what it is: the worker's info hash, /metrics labels, the start-up log line ------------------------------

    @property
    def model_name(self) -> str: ...

    @property
    def device(self) -> object: ...

    @property
    def dtype(self) -> object:
        """A torch dtype, or None for a stand-in (written as "")."""

    @property
    def max_num_seqs(self) -> int:
        """Requests it runs at once: the most jobs a worker holds."""

    @property
    def max_model_len(self) -> int: ...

    # ---- counters: the info hash and the gauges, read after each step and at each heartbeat ----------------------

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def kv_blocks_used(self) -> int: ...

    @property
    def kv_blocks_total(self) -> int:
        """The paged store's blocks; 0 for a stand-in with none (no KV-usage gauge then)."""

    def get_stats(self) -> Mapping[str, float]:
        """Cumulative counters; the worker reads `num_preemptions`, `prefix_cache_query_tokens` and
        `prefix_cache_hit_tokens` (rose.worker.metrics), `lora_loads/NAME` and `lora_evictions/NAME` by adapter
        (rose.worker.adapters) where present."""
