"""rose: a queue-driven LLM batch-job worker.

Names load lazily: `import rose.jobs` (producers, a stock RQ worker resolving `rose.jobs.generate`) never pays for
torch and transformers; `from rose import LLM` does.
"""

import importlib
import os
from typing import TYPE_CHECKING, Any

# Before torch loads OpenMP: idle intra-op threads sleep instead of spinning. On a host shared with other
# processes (a worker beside its Redis, tests beside a worker) spinning threads steal the core a descheduled peer
# needs, and steps slow down by 5-20x. Set OMP_WAIT_POLICY yourself to override.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "rose.engine.llm",
    "Engine": "rose.engine.engine",
    "EngineConfig": "rose.engine.config",
    "SamplingParams": "rose.engine.sampling_params",
    "LoRARequest": "rose.engine.lora",
    "RequestOutput": "rose.engine.outputs",
    "StepOutput": "rose.engine.outputs",
    "UnsupportedModelError": "rose.engine.model_probe",
    "Client": "rose.jobs.client",
    "AsyncClient": "rose.jobs.async_client",
    "JobFailed": "rose.jobs.client",
    "JobCanceled": "rose.jobs.client",
    "InvalidRequest": "rose.jobs.client",
}

__all__ = [
    "LLM",
    "AsyncClient",
    "Client",
    "Engine",
    "EngineConfig",
    "InvalidRequest",
    "JobCanceled",
    "JobFailed",
    "LoRARequest",
    "RequestOutput",
    "SamplingParams",
    "StepOutput",
    "UnsupportedModelError",
    "__version__",
]

if TYPE_CHECKING:
    from rose.engine.config import EngineConfig
    from rose.engine.engine import Engine
    from rose.engine.llm import LLM
    from rose.engine.lora import LoRARequest
    from rose.engine.model_probe import UnsupportedModelError
    from rose.engine.outputs import RequestOutput, StepOutput
    from rose.engine.sampling_params import SamplingParams
    from rose.jobs.async_client import AsyncClient
    from rose.jobs.client import Client, InvalidRequest, JobCanceled, JobFailed


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'rose' has no attribute {name!r}")
