"""The keyword arguments of a `rose.jobs.generate` job, validated."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from rose.engine.sampling_params import SamplingParams

__all__ = ["GenerateRequest", "ValidationError", "format_validation_error"]


class GenerateRequest(BaseModel):
    """One generation job: a prompt (text or token ids, exactly one), SamplingParams fields, optional metadata.

    Field names and meanings are vLLM's. Unknown fields are rejected (a typo must not silently do nothing).
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    prompt: str | None = Field(None, description="Text prompt (needs a tokenizer on the worker).")
    prompt_token_ids: list[int] | None = Field(None, description="Prompt as token ids.")
    metadata: dict[str, Any] | None = Field(None, description="Any JSON object, echoed into the result.")
    priority: int = Field(0, description="Engine scheduling priority among waiting jobs (lower runs first).")

    # SamplingParams (same names, defaults and checks)
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    detokenize: bool = True

    @model_validator(mode="after")
    def _check(self) -> GenerateRequest:
        if (self.prompt is None) == (self.prompt_token_ids is None):
            raise ValueError("give exactly one of 'prompt' (text) or 'prompt_token_ids' (list of int)")
        if self.prompt is not None and self.prompt == "":
            raise ValueError("'prompt' is empty")
        if self.prompt_token_ids is not None:
            if not self.prompt_token_ids:
                raise ValueError("'prompt_token_ids' is empty")
            if any(t < 0 for t in self.prompt_token_ids):
                raise ValueError("'prompt_token_ids' must hold non-negative integers")
        # SamplingParams owns the range checks; its ValueError names the field.
        self.to_sampling_params()
        return self

    @classmethod
    def sampling_field_names(cls) -> list[str]:
        return SamplingParams.field_names()

    def to_sampling_params(self) -> SamplingParams:
        return SamplingParams(**{name: getattr(self, name) for name in SamplingParams.field_names()})

    @property
    def engine_prompt(self) -> str | list[int]:
        return self.prompt if self.prompt is not None else list(self.prompt_token_ids or [])


def format_validation_error(exc: ValidationError) -> str:
    """One line per problem, naming the field: what a producer needs to fix the job."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(part) for part in err["loc"])
        if err["type"] == "extra_forbidden":
            lines.append(f"unknown field {loc!r}")
        elif loc:
            lines.append(f"{loc}: {err['msg']}")
        else:
            lines.append(err["msg"].removeprefix("Value error, "))
    return "invalid rose.jobs.generate arguments: " + "; ".join(lines)
