"""rose: a queue-driven LLM batch-job worker."""

import os

# Before torch loads OpenMP: idle intra-op threads sleep instead of spinning. On a host shared with other
# processes (a worker beside its Redis, tests beside a worker) spinning threads steal the core a descheduled peer
# needs, and steps slow down by 5-20x. Set OMP_WAIT_POLICY yourself to override.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from rose.engine.engine import Engine
from rose.engine.llm import LLM
from rose.engine.outputs import RequestOutput, StepOutput
from rose.engine.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "Engine", "RequestOutput", "SamplingParams", "StepOutput", "__version__"]
