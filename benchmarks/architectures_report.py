#!/usr/bin/env python
"""Build every causal-LM architecture of the installed transformers tiny (tests/engine/architectures.py) and
greedy-decode with transformers' own `generate`: does it build, does it generate, how clear are its greedy choices.

PYTHONPATH=. python benchmarks/architectures_report.py                 # all types
PYTHONPATH=. python benchmarks/architectures_report.py llama gemma2    # some
PYTHONPATH=. python benchmarks/architectures_report.py --json-out /tmp/arch.json

One line per type: status (ok / build failed / generate failed, with the reason), parameter count, build and
generate seconds, the smallest top-1 minus top-2 logit gap along the greedy paths of 3 prompts (5, 11, 20 random
ids, 12 new tokens each), how many attention calls one forward makes through transformers' AttentionInterface
(0: the family's attention bypasses it), and the family's distinctive features in its tiny config.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import statistics
import sys
import time
import warnings
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
sys.path.insert(0, str(ROOT / "tests" / "engine"))  # the tiny models live with the tests

from architectures import build_failure, causal_lm_types, prompt_id_range, tiny_model  # noqa: E402
from transformers import AttentionInterface  # noqa: E402
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface  # noqa: E402
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402

PROMPT_LENGTHS = (5, 11, 20)
PROBE = "rose_probe"

# Types that build and generate, but whose cached greedy tokens from transformers' `generate` differ from the
# argmax of one full forward over the same sequence (this report checks every type).
_DSA = (
    "sparse (DSA) attention: once the context exceeds index_topk (8 here), cached decoding selects other keys than "
    "a full forward (with index_topk 64 the two agree)"
)
_MASK_TOKEN = (
    "generation appends a mask token to every step's input, so a plain forward is another computation"
)
GENERATE_CAVEATS: dict[str, str] = {
    **dict.fromkeys(("axk2", "deepseek_v32", "dots3_note", "dots3_note_text", "glm_moe_dsa", "hy_v4"), _DSA),
    "blt": "dynamic entropy patching: cached decoding disagrees with a full forward; use_cache=False agrees",
    "xlm": _MASK_TOKEN,
    "xlnet": _MASK_TOKEN + " (with a permutation mask)",
    "reformer": "cached decoding disagrees with a full forward (LSH / chunked local attention; not analysed)",
    **dict.fromkeys(
        ("cpmant", "moshi", "prophetnet"), "cached decoding disagrees with a full forward (not analysed)"
    ),
}


@dataclass
class TypeResult:
    model_type: str
    status: str  # "ok" | "build failed" | "generate failed"
    reason: str = ""
    params: int = 0
    build_s: float = 0.0
    generate_s: float = 0.0
    min_gap: float = float("nan")
    full_forward_mismatches: int = 0  # prompts whose cached greedy tokens differ from a full forward's argmax
    caveat: str = ""
    interface_calls: int | None = None  # attention calls through AttentionInterface in one forward
    features: list[str] = field(default_factory=list)


def _prompts(seed: int) -> list[torch.Tensor]:
    lo, hi = prompt_id_range()
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(lo, hi, (1, n), generator=gen) for n in PROMPT_LENGTHS]


def _greedy(model: torch.nn.Module, prompts: list[torch.Tensor], max_new_tokens: int) -> tuple[float, int]:
    """The smallest top-1 minus top-2 logit gap along the greedy paths, and how many prompts' cached greedy tokens
    differ from the argmax of one full forward over the generated sequence (transformers against itself)."""
    gaps: list[float] = []
    mismatches = 0
    for ids in prompts:
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        for logits in out.logits:
            top = logits[0].float().topk(2).values
            gaps.append((top[0] - top[1]).item())
        full = _full_forward_argmax(model, out.sequences)[ids.shape[1] - 1 : -1]
        mismatches += int(not torch.equal(full, out.sequences[0, ids.shape[1] :]))
    return min(gaps), mismatches


@torch.no_grad()
def _full_forward_argmax(model: torch.nn.Module, seq: torch.Tensor) -> torch.Tensor:
    """Argmax at every position of one forward over `seq`, with generate's positions 0..n-1 where the model takes
    them (roberta-like families otherwise offset their positions by the padding id, which generate does not)."""
    mask = torch.ones_like(seq)
    try:
        logits = model(seq, attention_mask=mask, position_ids=torch.arange(seq.shape[1])[None]).logits
    except (TypeError, ValueError, RuntimeError):
        logits = model(seq, attention_mask=mask).logits
    return logits[0].argmax(-1)


def _interface_calls(model: torch.nn.Module, ids: torch.Tensor) -> int | None:
    """Attention calls one forward makes through AttentionInterface (None: the model refuses a custom one)."""
    calls = 0
    before = model.config._attn_implementation

    def probe(module, query, key, value, attention_mask, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        # delegate to what the model ran before: eager is each family's own module-level function
        own = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        attend = ALL_ATTENTION_FUNCTIONS.get(before, own)
        return attend(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(PROBE, probe)
    # the same masks as before: a custom name gets no mask by default (and DSA indexers need the 4D one)
    AttentionMaskInterface.register(
        PROBE, ALL_MASK_ATTENTION_FUNCTIONS[before if before == "sdpa" else "eager"]
    )
    try:
        model.set_attn_implementation(PROBE)
    except Exception:  # noqa: BLE001 - families that declare no attention-backend support say so by raising
        return None
    try:
        with torch.no_grad():
            model(ids, attention_mask=torch.ones_like(ids))
    finally:
        model.set_attn_implementation(before)
    return calls


def run_type(model_type: str, seed: int, max_new_tokens: int) -> TypeResult:
    known = build_failure(model_type)
    if known is not None:
        return TypeResult(model_type, "build failed", known)
    t0 = time.perf_counter()
    try:
        model = tiny_model(model_type, seed)
    except Exception as e:  # noqa: BLE001 - the report lists every failure with its reason
        return TypeResult(model_type, "build failed", _reason(e))
    result = TypeResult(
        model_type,
        "ok",
        caveat=GENERATE_CAVEATS.get(model_type, ""),
        params=sum(p.numel() for p in model.parameters()),
        build_s=time.perf_counter() - t0,
        features=features(model),
    )
    t1 = time.perf_counter()
    try:
        result.min_gap, result.full_forward_mismatches = _greedy(model, _prompts(seed), max_new_tokens)
    except Exception as e:  # noqa: BLE001
        result.status, result.reason = "generate failed", _reason(e)
    result.generate_s = time.perf_counter() - t1
    if result.status == "ok":
        try:
            result.interface_calls = _interface_calls(model, _prompts(seed)[0])
        except Exception:  # noqa: BLE001 - a probe failure says nothing about the family itself
            result.interface_calls = None
    return result


def _reason(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())[:240]


def _line(r: TypeResult) -> str:
    head = f"{r.model_type:26s} {r.status:16s}"
    if r.status == "build failed":
        return f"{head} {r.reason}"
    calls = "-" if r.interface_calls is None else str(r.interface_calls)
    body = f"params {r.params:>9,d}  build {r.build_s:5.2f}s  gen {r.generate_s:5.2f}s"
    if r.status != "ok":
        return f"{head} {body}  {r.reason}"
    check = (
        f"  cache!=full {r.full_forward_mismatches}/{len(PROMPT_LENGTHS)}"
        if r.full_forward_mismatches
        else ""
    )
    note = f"  [caveat: {r.caveat}]" if r.caveat else ""
    return f"{head} {body}  min-gap {r.min_gap:8.2e}  iface {calls:>2s}  {' '.join(r.features)}{check}{note}"


def _summary(results: list[TypeResult]) -> list[str]:
    ok = [r for r in results if r.status == "ok"]
    lines = [
        f"{len(results)} types: "
        + ", ".join(f"{n} {s}" for s, n in Counter(r.status for r in results).items())
    ]
    for status in ("build failed", "generate failed"):
        for r in (r for r in results if r.status == status):
            lines.append(f"  {status}: {r.model_type}: {r.reason}")
    if ok:
        gaps = [r.min_gap for r in ok]
        small = [r.model_type for r in ok if not r.min_gap > 1e-3]
        lines.append(
            f"min-gap median {statistics.median(gaps):.2e}; <= 1e-3 in {len(small)}: {' '.join(small)}"
        )
        slow = sorted(ok, key=lambda r: -(r.build_s + r.generate_s))[:5]
        lines.append("slowest: " + ", ".join(f"{r.model_type} {r.build_s + r.generate_s:.2f}s" for r in slow))
        big = [f"{r.model_type} {r.params:,d}" for r in ok if r.params >= 2_000_000]
        lines.append("over 2M parameters: " + (", ".join(big) or "none"))
        bypass = [r.model_type for r in ok if r.interface_calls == 0]
        refused = [r.model_type for r in ok if r.interface_calls is None]
        lines.append(f"attention not through AttentionInterface ({len(bypass)}): {' '.join(bypass)}")
        lines.append(f"custom attention refused or failed ({len(refused)}): {' '.join(refused)}")
        drift = [r.model_type for r in ok if r.full_forward_mismatches]
        unexplained = [t for t in drift if t not in GENERATE_CAVEATS]
        lines.append(f"cached generate != full forward ({len(drift)}): {' '.join(drift)}")
        lines.append(f"  of which not in GENERATE_CAVEATS ({len(unexplained)}): {' '.join(unexplained)}")
    return lines


# --- what a tiny model exercises -----------------------------------------------------------------------------

_SOFTCAPS = ("attn_logit_softcapping", "final_logit_softcapping", "logits_soft_cap", "output_logit_soft_cap")
_WINDOWS = ("sliding_window", "attention_window_size", "sliding_window_size", "window_size")
_MOE_COUNTS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")


def features(model: torch.nn.Module) -> list[str]:
    """Short tags for the distinctive features a tiny model has (layer kinds, GQA, window, soft-caps, chunks, MLA,
    MoE, sinks: what the parity sweep exercises)."""
    text = model.config.get_text_config(decoder=True)
    # to_dict, not getattr: heterogeneous configs refuse getattr of their per-layer attributes
    v = {**{k: getattr(text, k, None) for k in ("layer_types", "layers_block_type")}, **text.to_dict()}
    tags: list[str] = []
    kinds = v.get("layer_types") or v.get("layers_block_type") or v.get("block_types")
    if isinstance(kinds, list) and len(set(map(str, kinds))) > 1:
        tags.append("layers=" + ",".join(_short(k) for k in kinds))
    heads, kv = v.get("num_attention_heads"), v.get("num_key_value_heads")
    if isinstance(heads, int) and isinstance(kv, int) and kv < heads:
        tags.append(f"gqa={heads}/{kv}")
    if v.get("per_layer_config"):
        tags.append("per-layer-config")
    tags += [f"window={v[k]}" for k in _WINDOWS if isinstance(v.get(k), int) and _windowed(v)][:1]
    tags += [f"softcap:{k.split('_')[0]}={v[k]}" for k in _SOFTCAPS if v.get(k)]
    if v.get("attention_chunk_size"):
        tags.append(f"chunk={v['attention_chunk_size']}")
    if isinstance(v.get("kv_lora_rank"), int):
        tags.append(f"mla(kv_rank={v['kv_lora_rank']})")
    experts = next((v[k] for k in _MOE_COUNTS if isinstance(v.get(k), int)), None)
    if experts and experts > 1 and v.get("is_moe") is not False:  # doge declares experts it does not build
        tags.append(f"moe={experts}")
    if any("sinks" in name for name, _ in model.named_parameters()):
        tags.append("sinks")
    return tags


def _windowed(v: dict[str, Any]) -> bool:
    """Whether the window is used: qwen2-style flags, or some layer of a sliding kind."""
    if v.get("use_sliding_window") is False:
        return False
    kinds = v.get("layer_types")
    return not isinstance(kinds, list) or any("sliding" in str(k) or "local" in str(k) for k in kinds)


def _short(kind: Any) -> str:
    """'sliding_attention' -> 'sliding', 'linear_attention' -> 'linear', 'mamba' -> 'mamba'."""
    return str(kind).replace("_attention", "").replace("attention", "attn")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("types", nargs="*", help="model types (default: every causal-LM type)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--json-out", type=Path)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    results = []
    for model_type in args.types or causal_lm_types():
        with contextlib.redirect_stdout(io.StringIO()):  # reformer prints a warning per generation step
            results.append(run_type(model_type, args.seed, args.max_new_tokens))
        print(_line(results[-1]), flush=True)
    print("\n".join(_summary(results)))
    if args.json_out:
        args.json_out.write_text(json.dumps([asdict(r) for r in results], indent=1))
    return 0 if all(r.status == "ok" or build_failure(r.model_type) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
