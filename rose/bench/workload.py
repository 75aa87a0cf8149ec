"""A seeded random workload: prompt token ids and per-request `max_tokens`, the same for every system measured."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

# Ids the presets reserve for <eos>, <bos>, <pad>; prompts never contain them (see rose.engine.presets).
RESERVED_IDS = 3


@dataclass(frozen=True)
class BenchRequest:
    """One request of the workload: its prompt and how many tokens it asks for (generation ignores EOS)."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class Workload:
    requests: list[BenchRequest]
    seed: int
    prompt_len_range: tuple[int, int]
    output_len_range: tuple[int, int]
    vocab_size: int
    meta: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_len for r in self.requests)

    @property
    def requested_tokens(self) -> int:
        """Tokens the requests asked for in total: the only generated tokens any system is credited with."""
        return sum(r.max_tokens for r in self.requests)

    @property
    def max_total_len(self) -> int:
        return max((r.prompt_len + r.max_tokens for r in self.requests), default=0)

    def head(self, n: int, id_prefix: str = "") -> Workload:
        """The first `n` requests (ids prefixed with `id_prefix`), e.g. to warm a system up."""
        reqs = [
            BenchRequest(id_prefix + r.request_id, r.prompt_token_ids, r.max_tokens)
            for r in self.requests[:n]
        ]
        return Workload(reqs, self.seed, self.prompt_len_range, self.output_len_range, self.vocab_size)

    def describe(self) -> dict[str, Any]:
        return {
            "num_requests": len(self.requests),
            "seed": self.seed,
            "prompt_len_range": list(self.prompt_len_range),
            "output_len_range": list(self.output_len_range),
            "vocab_size": self.vocab_size,
            "prompt_tokens": self.prompt_tokens,
            "requested_tokens": self.requested_tokens,
            "max_total_len": self.max_total_len,
        }


def _check_range(name: str, rng: tuple[int, int]) -> tuple[int, int]:
    lo, hi = int(rng[0]), int(rng[1])
    if lo < 1 or hi < lo:
        raise ValueError(f"{name} must be (lo, hi) with 1 <= lo <= hi, got {rng!r}")
    return lo, hi


def make_workload(
    num_requests: int,
    prompt_len_range: tuple[int, int] = (16, 128),
    output_len_range: tuple[int, int] = (16, 128),
    *,
    vocab_size: int = 8192,
    seed: int = 0,
) -> Workload:
    """`num_requests` requests, prompt lengths and max_tokens uniform in the (inclusive) ranges, token ids uniform
    over the vocabulary minus the special ids. Deterministic for a given seed; touches no global RNG."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    p_lo, p_hi = _check_range("prompt_len_range", prompt_len_range)
    o_lo, o_hi = _check_range("output_len_range", output_len_range)
    if vocab_size <= RESERVED_IDS:
        raise ValueError(f"vocab_size must be > {RESERVED_IDS}, got {vocab_size}")
    rng = random.Random(seed)
    requests = []
    for i in range(num_requests):
        prompt_len = rng.randint(p_lo, p_hi)
        max_tokens = rng.randint(o_lo, o_hi)
        prompt = [rng.randrange(RESERVED_IDS, vocab_size) for _ in range(prompt_len)]
        requests.append(BenchRequest(f"req-{i}", prompt, max_tokens))
    return Workload(requests, seed, (p_lo, p_hi), (o_lo, o_hi), vocab_size)
