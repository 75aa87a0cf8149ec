"""An engine stand-in that generates at a GPU's pace, for the fleet simulation (rose.bench.fleet): what the worker
asks of an engine (`add_request`, `step`, `abort`, `num_admittable`, ...), with no model.

Each step gives every running request one token, and steps come at most `steps_per_s` times a second (the step
sleeps out the rest: a GPU step leaves the CPU free), so a worker runs `max_num_seqs` sequences at `steps_per_s`
tokens per second each, as a worker on a GPU would. Tokens look like real ones on the wire: a few characters of
text, ids below 152k; a request whose prompt starts with `LATENCY_PROMPT` gets as token ids the wall-clock time it
was produced at (milliseconds, modulo 1e9), so that a reader can tell how late each token reaches the stream.
"""

from __future__ import annotations

import random
import time
from typing import Any

from rose.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, StepOutput

LATENCY_PROMPT = "latency probe"
_WORDS = ("the", " model", " writes", " a", " token", ",", " then", " another", ".", " and")


def produced_ms(now: float) -> int:
    """The id a latency probe's token carries: its production time in ms, modulo 1e9."""
    return int(now * 1000) % 1_000_000_000


class SimEngine:
    def __init__(self, max_num_seqs: int = 256, steps_per_s: float = 20.0, seed: int = 0) -> None:
        self.max_num_seqs = max_num_seqs
        self.steps_per_s = steps_per_s
        self.model_name = "sim"
        self.device = "sim"
        self.dtype = None
        self.tokenizer = None
        self.max_model_len = 1 << 20
        self._rng = random.Random(seed)
        self._requests: dict[str, dict[str, Any]] = {}
        self._next_step = 0.0
        self.tokens = 0  # generated so far

    # ---- what the worker asks ------------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: Any,
        params: Any = None,
        *,
        priority: int = 0,
        lora_request: Any = None,
        deadline: float | None = None,
    ) -> None:
        if request_id in self._requests:
            raise ValueError(f"duplicate request id {request_id}")
        text = (
            prompt
            if isinstance(prompt, str)
            else str(prompt.get("prompt", ""))
            if isinstance(prompt, dict)
            else ""
        )
        ids = prompt if isinstance(prompt, list) else [1] * max(1, len(text.split()))
        self._requests[request_id] = {
            "prompt_ids": list(ids),
            "max_tokens": (params.max_tokens if params is not None else None) or 16,
            "probe": text.startswith(LATENCY_PROMPT),
            "ids": [],
            "texts": [],
            "metrics": RequestMetrics(arrival_time=time.time(), num_prompt_tokens=len(ids)),
        }

    def abort(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    @property
    def num_running(self) -> int:
        return min(len(self._requests), self.max_num_seqs)

    @property
    def num_waiting(self) -> int:
        return max(0, len(self._requests) - self.max_num_seqs)

    def num_admittable(self) -> int:
        return max(0, self.max_num_seqs - len(self._requests))

    kv_blocks_used = kv_blocks_total = 0  # no paged store

    def get_stats(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        pass

    def step(self) -> list[StepOutput]:
        now = time.monotonic()
        if self._next_step > now:
            time.sleep(self._next_step - now)
        self._next_step = max(now, self._next_step) + 1.0 / self.steps_per_s
        wall = time.time()
        outs: list[StepOutput] = []
        for rid in list(self._requests)[: self.max_num_seqs]:
            req = self._requests[rid]
            token = produced_ms(wall) if req["probe"] else self._rng.randrange(100, 151_000)
            text = self._rng.choice(_WORDS)
            req["ids"].append(token)
            req["texts"].append(text)
            metrics = req["metrics"]
            metrics.first_token_time = metrics.first_token_time or wall
            done = len(req["ids"]) >= req["max_tokens"]
            out = StepOutput(
                request_id=rid,
                new_token_ids=[token],
                new_text=text,
                finished=done,
                finish_reason="length" if done else None,
            )
            if done:
                metrics.finished_time = wall
                out.output = RequestOutput(
                    request_id=rid,
                    prompt=None,
                    prompt_token_ids=req["prompt_ids"],
                    outputs=[CompletionOutput(0, "".join(req["texts"]), list(req["ids"]), "length")],
                    metrics=metrics,
                )
                del self._requests[rid]
            outs.append(out)
        self.tokens += len(outs)
        return outs
