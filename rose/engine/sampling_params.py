"""Sampling parameters, with vLLM's names and meanings."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from rose.engine.structured_outputs import StructuredOutputsParams

_GREEDY_EPS = 1e-5  # vLLM treats temperatures below this as greedy
# Integers reach torch as int64: a larger one (top_k=2**63) passed validation and made the engine step raise for
# the whole batch. Bounded here, where the message can name the field.
INT64_MAX = 2**63 - 1
MAX_N = 128  # choices per request: OpenAI's bound on `n`
MAX_LOGPROBS = (
    20  # vLLM's default max_logprobs, OpenAI's bound on top_logprobs: an engine's default, a job's bound
)


@dataclass
class SamplingParams:
    """How one request is sampled and when it stops, with vLLM V1's semantics (vLLM >= 0.10.1).

    `min_tokens`: EOS, stop token ids and stop strings count only in the tokens generated after the first
    `min_tokens` (V0 already checked stop strings in the `min_tokens`-th). `min_p` applies right after the temperature,
    before `top_k` / `top_p` (see rose.engine.sampler).

    `n`: choices sampled from the prompt, each its own sequence (its prompt computed once: rose.engine.parallel_sampling);
    seeded, choice i draws with seed + i. `max_tokens=None` means "until the context limit". `top_k` of 0 or -1 disables top-k.
    `logprobs=N` returns, for each generated token, its log-probability and the top-N alternatives;
    `prompt_logprobs=N` the same for each prompt token after the first (vLLM's: raw logprobs, computed over the whole
    prompt, so such a request reads nothing from the prefix cache).
    `detokenize=False` returns token ids only (empty text): no incremental detokenization, so no stop strings.
    `logit_bias` (OpenAI's and vLLM's): token id -> a number in [-100, 100] added to that token's logit before the
    penalties and the temperature (-100 bans a token in practice, 100 all but forces it); ids may come as JSON's
    strings ("50256") and are kept as ints. `allowed_token_ids` (vLLM's): only these tokens may be sampled.
    `bad_words` (vLLM's): words never to generate (duplicates dropped); the engine tokenizes each as it stands and
    after a space, and bans the last token of a word whenever the generated tokens end with the rest of it.
    `structured_outputs` constrains the output to a JSON schema, regex, choice or grammar (a dict such as
    `{"json": schema}` is accepted); EOS is then allowed only where the grammar can end, and the request ends when
    the grammar does (min_tokens and ignore_eos do not reopen a finished grammar).
    """

    n: int = 1
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
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, list | tuple):
                raise ValueError(f"SamplingParams.{name} must be a list, got {value!r}")
            setattr(self, name, list(value or []))
        if self.top_k == -1:
            self.top_k = 0
        self.logit_bias = _token_biases(self.logit_bias)
        if isinstance(self.allowed_token_ids, list | tuple):  # a copy: the caller's list may change later
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.bad_words, list | tuple):  # a copy: the caller's list may change later
            words = list(self.bad_words)
            if all(isinstance(w, str) for w in words):  # duplicates dropped in order, as vLLM; [] is None
                words = list(dict.fromkeys(words)) or None
            self.bad_words = words
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"SamplingParams.{name} must be {allowed}, got {getattr(self, name)!r}")

        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise bad("n", f"an integer in [1, {MAX_N}]")
        if self.max_tokens is not None and (
            not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= INT64_MAX
        ):
            raise bad("max_tokens", "an integer in [1, 2**63) (or None for 'up to the context limit')")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= INT64_MAX:
            raise bad("min_tokens", "an integer in [0, 2**63)")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"SamplingParams.min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        if not _is_num(self.temperature) or self.temperature < 0:
            raise bad("temperature", "a finite number >= 0 (0 = greedy)")
        if not _is_int(self.top_k) or not 0 <= self.top_k <= INT64_MAX:
            raise bad("top_k", "an integer in [1, 2**63), or 0 / -1 to disable")
        if not _is_num(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "in (0, 1]")
        if not _is_num(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "in [0, 1]")
        if not _is_num(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "a finite number > 0 (1 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_num(value) or not -2 <= value <= 2:
                raise bad(name, "in [-2, 2]")
        if self.seed is not None and (not _is_int(self.seed) or not -(2**63) <= self.seed < 2**64):
            raise bad("seed", "an integer in [-2**63, 2**64) or None")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "a bool")
        if not all(isinstance(s, str) for s in self.stop) or any(s == "" for s in self.stop):
            raise bad("stop", "a list of non-empty strings")
        if self.stop and not self.detokenize:
            raise ValueError(
                "SamplingParams.stop needs detokenize=True: stop strings are matched on the text"
            )
        if not all(_is_int(t) and 0 <= t <= INT64_MAX for t in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of integers in [0, 2**63)")
        allowed = self.allowed_token_ids
        if allowed is not None and (
            not isinstance(allowed, list)
            or not allowed
            or not all(_is_int(t) and 0 <= t <= INT64_MAX for t in allowed)
        ):
            raise bad("allowed_token_ids", "a non-empty list of token ids (integers in [0, 2**63)), or None")
        words = self.bad_words
        if words is not None and (
            not isinstance(words, list) or not all(isinstance(w, str) and w for w in words)
        ):  # a str alone is refused: vLLM's server refuses it too (its engine would split it into characters)
            raise bad("bad_words", "a list of non-empty strings, or None")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= INT64_MAX):
                raise bad(name, "an integer in [0, 2**63) or None")

    def verify(self, vocab_size: int, max_logprobs: int) -> None:
        """What only an engine knows: token ids inside its vocabulary, logprobs within its max_logprobs. ValueError
        naming the field."""
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > max_logprobs:
                raise ValueError(
                    f"SamplingParams.{name} must be <= {max_logprobs} (the engine's max_logprobs), got {value}"
                )
        for name, ids in (
            ("stop_token_ids", self.stop_token_ids),
            ("logit_bias", self.logit_bias),
            ("allowed_token_ids", self.allowed_token_ids),
        ):
            outside = [t for t in ids or () if t >= vocab_size]
            if outside:
                raise ValueError(
                    f"SamplingParams.{name}: token ids must be in [0, {vocab_size}) (the model's vocabulary), "
                    f"got {outside[:5]}"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if self.structured_outputs is not None:
            out["structured_outputs"] = self.structured_outputs.to_dict()
        return out


def _token_biases(value: Any) -> dict[int, float] | None:
    """`logit_bias` with int ids (JSON's object keys are strings); None when empty. ValueError naming what is wrong."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"SamplingParams.logit_bias must be a dict of token id -> bias, got {value!r}")
    biases = {}
    for key, bias in value.items():
        token = int(key) if isinstance(key, str) and key.isascii() and key.isdecimal() else key
        if not _is_int(token) or not 0 <= token <= INT64_MAX:
            raise ValueError(f"SamplingParams.logit_bias: {key!r} is no token id (a non-negative integer)")
        if not _is_num(bias) or not -100 <= bias <= 100:
            raise ValueError(
                f"SamplingParams.logit_bias[{token}] must be a number in [-100, 100], got {bias!r}"
            )
        biases[token] = float(bias)
    return biases or None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_num(value: Any) -> bool:
    """A finite int or float: NaN and +-inf are refused (an infinite temperature or penalty is no setting)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):  # a huge int is no finite float either (math.isfinite would raise)
        return -INT64_MAX <= value <= INT64_MAX
    return isinstance(value, float) and math.isfinite(value)
