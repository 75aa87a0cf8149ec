"""Model coverage: does rose's engine give transformers' exact greedy tokens for a model, in every engine mode?

The oracle is transformers' own `generate` (greedy, its own KV cache and attention) on an identical copy of the
model, one prompt at a time. The engine runs the same prompts in each mode of `MODES`:
- `batched`: every prompt admitted at once, whole-prompt prefill, the default attention backend (on CPU float32:
  the numba decode kernels);
- `chunked`: two sequences at a time, blocks of 4 positions and a small step budget, so prompts are prefilled in
  chunks beside decoding sequences and blocks are reused as requests finish; prefix caching on, with prompts that
  share prefixes, so cached blocks are shared;
- `sdpa`: as `batched` with the other decode backend (SDPA over gathered blocks instead of the kernels);
- `chunked_sdpa`: as `chunked` with SDPA, the path CUDA and low precision take;
- `preempt`: every prompt added at once, for a pool of 10 blocks of 4 positions, far fewer than the prompts and
  their tokens take (over 40 blocks at their longest), so decoding sequences preempt others, which are recomputed
  (prompt and generated tokens, in chunks, finding their own cached blocks) when readmitted; the default backend.
  (Models windowed in every layer give passed blocks back and may fit: tests/engine/test_sliding_window_blocks.py
  preempts them.)

A mode's verdict is `exact` when every token matches; where tokens first differ, the reference's own logits decide
whether it was a tie (the engine picked a token within `Target.tie_tolerance` times the best logit of it):
`exact (n ties)` then, the rest of that prompt unchecked; anything else is `wrong`. A model the engine refuses at construction is `refused`
with the engine's message, which is what rose promises for what it cannot serve exactly.
"""

from __future__ import annotations

import copy
import os
import random
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig, PreTrainedModel

from rose.engine.engine import Engine
from rose.engine.loader import resolve_dtype
from rose.engine.model_probe import UnsupportedModelError
from rose.engine.sampling_params import SamplingParams

MODES = ("batched", "chunked", "sdpa", "chunked_sdpa", "preempt")
TIE_TOLERANCE = 1e-4  # of the best logit's magnitude (at least 1): float32 rounding is ~1e-7 of it
LOW_PRECISION_TIE_TOLERANCE = 2**-6  # two bf16 steps: bf16 / fp16 kernels round differently
PROMPT_LENGTHS = (3, 9, 17, 26, 6, 13)  # past the tiny configs' windows and chunks (8 tokens)
MAX_TOKENS = 12
SHARED_PREFIX = 12  # the last two prompts start with the first prompt of at least this length


@dataclass(frozen=True)
class Target:
    """Where both sides run: the engine and transformers' reference, on the same device in the same dtype. In
    float32 the tokens must match exactly; a first difference whose logit gap is within `tie_tolerance` times the
    reference's best logit (at least 1) is a tie: rounding, not a defect (in bf16 / fp16 two attention kernels round
    differently, and so do a projection's matmul kernels for a batch of decode rows and for `generate`'s one row:
    PyTorch runs a matmul of at most 16**3 multiply-adds in its own kernel, a larger one in oneDNN; so low precision
    takes LOW_PRECISION_TIE_TOLERANCE)."""

    device: str = "cpu"
    dtype: str = "float32"
    tie_tolerance: float = TIE_TOLERANCE


@dataclass
class ModeResult:
    status: str  # "exact", "wrong" or "crash"
    ties: int = 0
    detail: str = ""
    prefix_hits: int = 0
    preemptions: int = 0
    # every layer windowed: passed blocks are given back, so a tight pool may not preempt
    windowed: bool = False

    def __str__(self) -> str:
        if self.status == "exact":
            return "exact" + (f" ({self.ties} tie{'s' * (self.ties > 1)})" if self.ties else "")
        return self.status


@dataclass
class Verdict:
    name: str
    status: (
        str  # "exact", "refused", "wrong", "crash" (the engine failed on a model it accepted) or "skipped"
    )
    modes: dict[str, ModeResult] = field(default_factory=dict)
    detail: str = ""
    seconds: float = 0.0


def prompts_for(id_range: tuple[int, int], seed: int = 0) -> list[list[int]]:
    """Random token ids in [lo, hi), the last two prompts sharing a prefix with an earlier one."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(*id_range) for _ in range(n)] for n in PROMPT_LENGTHS]
    base = next(p for p in prompts if len(p) >= SHARED_PREFIX)
    for i in (-2, -1):
        prompts[i] = base[:SHARED_PREFIX] + prompts[i]
    return prompts


def check_model(
    name: str,
    build: Callable[[], PreTrainedModel],
    modes: tuple[str, ...] = MODES,
    *,
    id_range: tuple[int, int] = (3, 480),
    max_tokens: int = MAX_TOKENS,
    target: Target = Target(),
) -> Verdict:
    """Build the model once, then compare each mode of the engine with transformers' greedy reference on prompts
    of token ids drawn from `id_range` (ids that are plain text tokens for every model built)."""
    start = time.perf_counter()

    def done(status: str, detail: str = "", verdict: Verdict | None = None) -> Verdict:
        verdict = verdict or Verdict(name, status)
        verdict.status, verdict.detail, verdict.seconds = status, detail, time.perf_counter() - start
        return verdict

    try:
        pristine = build().eval().to(target.device, resolve_dtype(target.dtype, torch.device(target.device)))
    except Exception as exc:  # an architecture that cannot be built tiny is reported, not hidden
        return done("skipped", f"no tiny model: {type(exc).__name__}: {exc}")
    prompts = prompts_for(id_range)
    verdict = Verdict(name, "exact")
    reference = None
    for mode in modes:
        try:
            engine_out, stats = _run_engine(copy.deepcopy(pristine), prompts, max_tokens, mode, target)
        except UnsupportedModelError as exc:
            return done("refused", str(exc))
        except Exception as exc:
            verdict.modes[mode] = ModeResult("crash", detail=f"{mode}: {type(exc).__name__}: {exc}")
            continue
        if reference is None:
            try:
                reference = _reference(pristine, prompts, max_tokens)
            except Exception as exc:
                return done("skipped", f"transformers' generate failed: {type(exc).__name__}: {exc}")
        verdict.modes[mode] = _compare(engine_out, reference, target.tie_tolerance)
        verdict.modes[mode].prefix_hits = stats.get("prefix_cache_hits", 0)
        verdict.modes[mode].preemptions = stats["num_preemptions"]
        verdict.modes[mode].windowed = stats["windowed"]
    failed = [m for m in verdict.modes.values() if m.status != "exact"]
    if not failed:
        return done("exact", verdict=verdict)
    status = "wrong" if any(m.status == "wrong" for m in failed) else "crash"
    return done(status, next(m.detail for m in failed if m.status == status), verdict)


@contextmanager
def _backend(name: str):
    old = os.environ.get("ROSE_ATTENTION_BACKEND")
    os.environ["ROSE_ATTENTION_BACKEND"] = name
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("ROSE_ATTENTION_BACKEND")
        else:
            os.environ["ROSE_ATTENTION_BACKEND"] = old


def _run_engine(model, prompts, max_tokens, mode, target: Target) -> tuple[list[list[int]], dict]:
    kwargs: dict = dict(
        device=target.device, dtype=target.dtype, max_model_len=128, max_num_seqs=len(prompts)
    )
    if mode.startswith("chunked"):
        kwargs.update(max_num_seqs=2, max_num_batched_tokens=8, enable_prefix_caching=True, block_size=4)
    elif mode == "preempt":  # 10 blocks of 4 for prompts and outputs that take over 40 at their longest
        kwargs.update(
            max_model_len=40,
            max_num_batched_tokens=16,
            block_size=4,
            num_gpu_blocks_override=10,
            enable_prefix_caching=True,
        )
    with _backend("sdpa" if mode.endswith("sdpa") else "auto"):
        engine = Engine(model, None, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, params)
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.output.token_ids
    stats = {**engine.get_stats(), "windowed": engine.kv_cache_manager.drops_passed_blocks}
    return [outputs[str(i)] for i in range(len(prompts))], stats


def _reference(model, prompts, max_tokens) -> list[tuple[list[int], torch.Tensor]]:
    """transformers' greedy tokens and the logits it chose them from, one prompt at a time."""
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_tokens,
        eos_token_id=[],  # no stop: the engine ignores EOS too
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    results = []
    with torch.inference_mode():
        for ids in prompts:
            input_ids = torch.tensor([ids], device=model.device)
            out = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                generation_config=config,
            )
            results.append(
                (out.sequences[0, len(ids) :].tolist(), torch.stack(out.logits)[:, 0].float().cpu())
            )
    return results


def _compare(engine_out, reference, tie_tolerance: float) -> ModeResult:
    ties = 0
    for i, (got, (want, logits)) in enumerate(zip(engine_out, reference, strict=True)):
        for step, (a, b) in enumerate(zip(got, want, strict=True)):
            if a == b:
                continue
            gap = float(logits[step, b] - logits[step, a])
            if gap <= tie_tolerance * max(1.0, abs(float(logits[step, b]))):
                ties += 1
                break
            return ModeResult(
                "wrong",
                detail=f"prompt {i}: token {step} is {a}, transformers gives {b} (logit gap {gap:.3g})",
            )
    return ModeResult("exact", ties=ties)
