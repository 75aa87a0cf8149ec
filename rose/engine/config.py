"""The engine's options, in one place: `Engine`, `LLM`, `rose-worker`'s settings and the CLI all take them from here.

Named as vLLM names them (`EngineArgs`). Plain values only: this module imports neither torch nor transformers, so
the worker's settings (rose.config.WorkerSettings) read its defaults in a producer's install too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rose.engine.sampling_params import MAX_LOGPROBS
from rose.engine.structured_outputs import DEFAULT_MAX_JSON_WHITESPACE, GRAMMAR_COMPILE_TIMEOUT_S


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """How an engine runs its model (rose.engine.engine.Engine). Raises ValueError, naming the option, for a value
    it cannot take.

    - `device`, `dtype`: "auto" is CUDA when present, bfloat16 there and float32 on CPU.
    - `max_num_seqs` caps the running batch; how many run at once is otherwise decided by the free KV blocks.
    - `max_model_len`: the longest sequence (prompt + output), default the model's context.
    - `max_num_batched_tokens`: tokens per step (decodes + prompt chunks), default max(2048, max_num_seqs).
    - `max_kv_cache_bytes`: memory for the KV store (default: rose.engine.kv_budget);
      `num_gpu_blocks_override` (vLLM's name; on any device) sets the number of blocks instead.
    - `block_size`: positions per KV block (default: by device and attention kernel).
    - `seed`: the engine's generator for unseeded sampled requests. `max_logprobs`: the most a request may ask.
    - `enable_prefix_caching`: reuse the K/V of shared prompt prefixes.
    - `disable_any_whitespace`: JSON constrained by a schema is written on one line (vLLM's option of that name); by
      default any whitespace may separate its tokens, at most `max_json_whitespace` characters at a time (None: no
      limit). `structured_outputs_backend`: "guidance" (llguidance), "xgrammar", or "auto" (guidance).
      `grammar_compile_timeout`: seconds a request waits for its grammar to compile before it fails (None: no limit).
    - `enable_lora` (vLLM's): requests may name a LoRA adapter (rose.engine.lora); `max_loras` adapters resident at
      once (the rest loaded as slots free up), of rank at most `max_lora_rank`.
    """

    device: Any = "auto"  # str or torch.device
    dtype: Any = "auto"  # str or torch.dtype
    max_num_seqs: int = 256
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    max_kv_cache_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    block_size: int | None = None
    seed: int = 0
    max_logprobs: int = MAX_LOGPROBS
    enable_prefix_caching: bool = False
    trust_remote_code: bool = False
    disable_any_whitespace: bool = False
    max_json_whitespace: int | None = DEFAULT_MAX_JSON_WHITESPACE
    structured_outputs_backend: str = "auto"
    grammar_compile_timeout: float | None = GRAMMAR_COMPILE_TIMEOUT_S
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        for name in ("max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_model_len", "max_num_batched_tokens", "num_gpu_blocks_override", "block_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 or None (the default), got {value}")
        if self.grammar_compile_timeout is not None and not self.grammar_compile_timeout > 0:
            raise ValueError(
                f"grammar_compile_timeout must be > 0 or None (no limit), got {self.grammar_compile_timeout}"
            )
        if self.max_json_whitespace is not None and self.max_json_whitespace < 1:
            raise ValueError(
                f"max_json_whitespace must be >= 1 or None (no limit), got {self.max_json_whitespace}"
            )


DEFAULTS = EngineConfig()
