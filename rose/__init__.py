"""rose: a queue-driven LLM batch-job worker."""

from rose.engine.engine import Engine
from rose.engine.llm import LLM
from rose.engine.outputs import RequestOutput, StepOutput
from rose.engine.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "Engine", "RequestOutput", "SamplingParams", "StepOutput", "__version__"]
