"""Settings of the `rose-worker` daemon: `ROSE_*` environment variables, overridden by command-line flags."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ByteSize, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from rose.config.lora_modules import parse_lora_module, split_lora_modules
from rose.engine.config import DEFAULTS, EngineConfig
from rose.engine.tool_calls import TOOL_PARSERS
from rose.jobs.connection import check_scheme, is_sentinel_url, parse_sentinel_url, redact_url

LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]

LogFormat = Literal["text", "json"]


class WorkerSettings(BaseSettings):
    """Everything `rose-worker` can be told. Each field is `ROSE_<NAME>` in the environment."""

    model_config = SettingsConfigDict(env_prefix="ROSE_", extra="forbid", validate_default=True)

    redis_url: str = Field(
        "redis://localhost:6379/0",
        description="Redis to take jobs from and publish to: redis://[[user]:password@]host:port/db, rediss:// for TLS, "
        "unix:///path/to.sock, or through Redis Sentinel: "
        "redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/service_name[/db] (Sentinel port 26379 by "
        "default; rediss+sentinel:// for TLS to the data nodes; ?sentinel_password=... for the Sentinels).",
    )
    queues: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["rose"],
        description="Queues to serve, highest priority first (env: comma-separated).",
    )
    model: str = Field(
        "tiny-llama",
        description="Preset name (tiny-llama, tiny-qwen2, tiny-gpt2, qwen2.5-0.5b), a local HF checkpoint dir, a hub id "
        "(org/name: the local HF cache, else the hub unless HF_HUB_OFFLINE=1), or the path of a config.json (random "
        "weights).",
    )
    tokenizer: str | None = Field(None, description="Tokenizer dir, when it is not the model's.")
    device: str = Field(
        DEFAULTS.device, description="Torch device: auto (CUDA when present), cpu, cuda, cuda:1, ..."
    )
    dtype: str = Field(
        DEFAULTS.dtype,
        description="Weights dtype: auto (bfloat16 on CUDA, float32 on CPU), float32, float16, bfloat16.",
    )
    max_num_seqs: int = Field(
        DEFAULTS.max_num_seqs,
        ge=1,
        description="Most jobs generated at once: a batch cap (the engine's free KV blocks decide how many it takes).",
    )
    max_model_len: int | None = Field(None, ge=1, description="Context limit per job; default: the model's.")
    max_kv_cache_bytes: ByteSize | None = Field(
        None,
        description="Memory for the KV store's blocks, e.g. 4GiB (GiB, MiB: binary; GB, MB, G, M: decimal). "
        "Default: 85% of the free CUDA memory once the weights are loaded; on CPU a quarter of RAM, taken only as "
        "blocks are used.",
    )
    block_size: int | None = Field(
        None,
        ge=1,
        description="Positions per KV block. Default: 64 on CPU, 16 on CUDA, 256 where flash-attn serves the model.",
    )
    max_num_batched_tokens: int | None = Field(
        None,
        ge=1,
        description="Tokens per engine step (decodes + prompt chunks); default max(2048, max_num_seqs).",
    )
    enable_prefix_caching: bool = Field(
        DEFAULTS.enable_prefix_caching,
        description="Reuse the K/V of prompt prefixes shared with running or recently finished jobs.",
    )
    enable_lora: bool = Field(
        DEFAULTS.enable_lora,
        description="Serve LoRA adapters (vLLM's --enable-lora): a job names one in its `lora` field, and jobs of "
        "several adapters and of the base model are generated together in one batch.",
    )
    lora_modules: Annotated[dict[str, str], NoDecode] = Field(
        default_factory=dict,
        description='The adapters served, as NAME=PATH or as a JSON object {"name": NAME, "path": PATH} '
        "(vLLM's --lora-modules, both forms; its optional base_model_name is accepted and ignored): PATH a PEFT "
        "adapter directory (adapter_config.json + adapter_model.safetensors), read and checked against the model "
        "at start (a bad one stops the worker with the reason); jobs name NAME. Ids 1, 2, ... in the order given "
        "(env: items separated by spaces or commas, or a JSON array of them). Needs --enable-lora.",
    )
    max_loras: int = Field(
        DEFAULTS.max_loras,
        ge=1,
        description="LoRA adapters resident at once (vLLM's --max-loras); a job whose adapter has no free slot waits "
        "while the others run, and an adapter no running job uses gives its slot up, least recently used first.",
    )
    max_lora_rank: int = Field(
        DEFAULTS.max_lora_rank,
        ge=1,
        description="The highest LoRA rank served (vLLM's --max-lora-rank): an adapter of a higher rank stops the "
        "worker at start; the slots are sized by it.",
    )
    trust_request_chat_template: bool = Field(
        False,
        description="Let jobs bring their own Jinja chat template (the job field chat_template); off: such a job "
        "fails. Templates run in transformers' sandboxed Jinja, but a template from producers can still render "
        "any prompt, so only trust producers who may.",
    )
    structured_outputs_backend: Literal["auto", "xgrammar", "guidance"] = Field(
        DEFAULTS.structured_outputs_backend,
        description="The grammar engine of structured outputs (vLLM's names): xgrammar, guidance (llguidance), or "
        "auto (rose's choice, from its conformance corpus: docs/jobs.md).",
    )
    disable_any_whitespace: bool = Field(
        DEFAULTS.disable_any_whitespace,
        description="JSON constrained by a job's structured_outputs / response_format is written on one line, "
        "with no free whitespace between its tokens (vLLM's structured-outputs option of that name). Default: "
        "any whitespace, as vLLM; a weak model may then fill its max_tokens with whitespace.",
    )
    max_json_whitespace: int = Field(
        DEFAULTS.max_json_whitespace,
        ge=0,
        description="Whitespace between two tokens of constrained JSON, at most this many characters (with any "
        "whitespace allowed: not --disable-any-whitespace), so that a model leaning toward whitespace cannot fill "
        "its max_tokens with it; 0: no limit (vLLM's behaviour). Larger bounds make larger compiled grammars.",
    )
    grammar_compile_timeout: float = Field(
        DEFAULTS.grammar_compile_timeout,
        ge=0,
        description="Seconds a job waits for its structured-outputs grammar to compile; a grammar still compiling "
        "then fails its jobs alone, with the reason (the compile runs on and is cached). 0: no limit.",
    )
    tool_call_parser: str | None = Field(
        None,
        description="How the calls of chat jobs with tools and tool_choice 'auto' are read from the model's output "
        f"(vLLM's --tool-call-parser names: {', '.join(TOOL_PARSERS)}; none: no parser, such jobs fail). "
        "Default: the format the model's chat template shows (logged at start-up), else none. tool_choice "
        "'required' or a named function needs no parser.",
    )
    with_scheduler: bool = Field(
        False,
        description="Also run RQ's scheduler for these queues (as `rq worker --with-scheduler`): needed for "
        "enqueue_in / enqueue_at jobs and Retry(interval=...).",
    )
    name: str | None = Field(
        None,
        description="Stable worker name. Restarting with the same name requeues the jobs its previous run held at "
        "once. Default: a random name.",
    )
    drain_timeout: float = Field(
        30.0,
        ge=0,
        description="On SIGTERM/SIGINT, seconds to let running jobs finish before requeueing them.",
    )
    log_level: LogLevel = Field("INFO", description="Logging level.")
    log_format: LogFormat = Field(
        "text",
        description="Log lines as text, or json: one JSON object per line (timestamp, level, logger, message and "
        "the job fields: event, job_id, queue, token counts, timings).",
    )
    metrics_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="Serve Prometheus metrics on this port (GET /metrics) with a health check (GET /health: 200 "
        "while the loop runs and Redis answers, else 503). 0: any free port (logged). Default: off.",
    )
    metrics_host: str = Field("0.0.0.0", description="Address the metrics server listens on.")
    health_timeout: float = Field(
        60.0,
        gt=0,
        description="GET /health answers 503 once the worker loop has not come round for this many seconds.",
    )
    heartbeat_timeout: int = Field(
        60,
        ge=10,
        description="Seconds without a heartbeat after which a worker counts as dead and other workers requeue its "
        "jobs.",
    )
    max_requeues: int = Field(
        3,
        ge=0,
        description="A job requeued this many times after worker deaths fails instead (poison-job guard).",
    )
    recovery_interval: float = Field(10.0, gt=0, description="Seconds between scans for orphaned jobs.")
    check_interval: float = Field(
        0.2,
        ge=0,
        description="Seconds between a busy worker's looks for canceled jobs (the size of each queue's canceled "
        "registry: one command a queue, whatever the number of running jobs) and timeouts; 0: every engine step. "
        "Each running job's status is read every 5 s (deletions, jobs taken over), and always before its result "
        "is stored.",
    )
    deadline_policy: Literal["continue", "abort"] = Field(
        "continue",
        description="What becomes of a job whose deadline (the job field) passes while it runs: continue (it goes "
        "on to its end) or abort (it fails with 'deadline exceeded', judged every --check-interval). A job whose "
        "deadline passed before a worker started it fails so either way.",
    )
    intake_policy: Literal["fair", "fcfs"] = Field(
        "fair",
        description="How a worker picks the next jobs of a queue: fair (each tenant's jobs in turn by the tokens "
        "served to it, weighted by --tenant-weight, across the fleet; jobs with a deadline first, earliest first) "
        "or fcfs (the queue's order, as RQ). Queues keep their order either way (the first queue's jobs first).",
    )
    tenant_weights: Annotated[dict[str, float], NoDecode] = Field(
        default_factory=dict,
        description="A tenant's share of the fleet under the fair policy, as NAME=W (default 1: tenant a=2 is "
        "served twice the tokens of a tenant of weight 1 while both wait). Give every worker the same weights "
        "(env: items separated by spaces or commas).",
    )
    stream_interval: float = Field(
        0.1,
        ge=0,
        description="Seconds between a streamed job's token events: the first token goes out at once, later ones "
        "are published together, one event per job at most this often (vLLM's option of that name counts tokens; "
        "what a reader sees and what Redis pays both follow time); 0: every engine step. Jobs sent with stream: "
        "false publish no token events at all.",
    )

    @field_validator("queues", mode="before")
    @classmethod
    def _split_queues(cls, value: object) -> object:
        if isinstance(value, str):
            value = [part.strip() for part in value.split(",")]
        return value

    @field_validator("lora_modules", mode="before")
    @classmethod
    def _parse_lora_modules(cls, value: object) -> object:
        """--lora-modules items (a list, or one string of them: split_lora_modules) -> {name: path}, in order. An
        item that is a JSON array (vLLM's "JSON list format") stands for its items."""
        if isinstance(value, str):
            value = split_lora_modules(value)
        if not isinstance(value, list | tuple):
            return value
        items = [
            part
            for item in value
            for part in (
                split_lora_modules(item)
                if isinstance(item, str) and item.lstrip().startswith("[")
                else [item]
            )
        ]
        modules: dict[str, str] = {}
        for item in items:
            name, path = parse_lora_module(item)
            if name in modules:
                raise ValueError(f"adapter name {name!r} is given twice ({modules[name]} and {path})")
            modules[name] = path
        return modules

    @field_validator("tenant_weights", mode="before")
    @classmethod
    def _parse_tenant_weights(cls, value: object) -> object:
        if isinstance(value, str):
            value = value.replace(",", " ").split()
        if not isinstance(value, list | tuple):
            return value
        weights: dict[str, float] = {}
        for item in value:
            name, sep, number = str(item).partition("=")
            try:
                weight = float(number)
            except ValueError:
                weight = float("nan")
            if not sep or not name.strip() or not weight > 0 or weight == float("inf"):
                raise ValueError(f"tenant weight {item!r}: want NAME=W with W a number > 0 (e.g. team-a=2)")
            weights[name.strip()] = weight
        return weights

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, value: object) -> object:
        return value.upper() if isinstance(value, str) else value

    @field_validator("log_format", mode="before")
    @classmethod
    def _lower(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value

    @field_validator("tool_call_parser")
    @classmethod
    def _check_parser(cls, value: str | None) -> str | None:
        if value is not None and value not in (*TOOL_PARSERS, "none"):
            raise ValueError(
                f"unknown tool-call parser {value!r}: use one of {', '.join(TOOL_PARSERS)}, none"
            )
        return value

    @field_validator("redis_url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        check_scheme(value)
        if is_sentinel_url(value):
            parse_sentinel_url(value)  # a malformed one fails here, before anything starts
        return value

    @model_validator(mode="after")
    def _check_queues(self) -> WorkerSettings:
        if not self.queues or any(not q for q in self.queues):
            raise ValueError("queues must be a non-empty list of non-empty queue names")
        # Keep the priority order but drop repeats: serving a queue twice would only skew the order.
        self.queues = list(dict.fromkeys(self.queues))
        if self.lora_modules and not self.enable_lora:
            raise ValueError(
                "lora_modules needs enable_lora: start rose-worker with --enable-lora (ROSE_ENABLE_LORA=1) to serve "
                f"the adapters {', '.join(self.lora_modules)}"
            )
        return self

    def engine_config(self) -> EngineConfig:
        """The engine's options among these settings (0 means "no limit" here, None there)."""
        return EngineConfig(
            device=self.device,
            dtype=self.dtype,
            max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_kv_cache_bytes=self.max_kv_cache_bytes,
            block_size=self.block_size,
            enable_prefix_caching=self.enable_prefix_caching,
            disable_any_whitespace=self.disable_any_whitespace,
            max_json_whitespace=self.max_json_whitespace or None,
            structured_outputs_backend=self.structured_outputs_backend,
            grammar_compile_timeout=self.grammar_compile_timeout or None,
            enable_lora=self.enable_lora,
            max_loras=self.max_loras,
            max_lora_rank=self.max_lora_rank,
        )

    @property
    def heartbeat_interval(self) -> float:
        """How often the worker refreshes its key and its jobs' registry entries."""
        return max(1.0, self.heartbeat_timeout / 6)


__all__ = ["EngineConfig", "WorkerSettings", "parse_lora_module", "redact_url", "split_lora_modules"]
