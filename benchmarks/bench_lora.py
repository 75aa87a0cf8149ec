"""What serving LoRA adapters costs: 8 adapters mixed at batch 64 against the base model alone, in one run; and how
long an adapter takes to read from disk and to swap into a slot.

    python benchmarks/bench_lora.py [--adapters 8 --batch 64 --max-tokens 32 --rank 16 --repeats 3]
    python benchmarks/bench_lora.py --shape small       # a wider model (hidden 512, 4 layers, 8k vocabulary)
    python benchmarks/bench_lora.py --shape qwen2.5-0.5b  # a real model's shape (random weights)

Adapters are random PEFT adapters (q/k/v/o and gate/up/down, rank --rank) written to a temporary directory. Three
runs alternate: the base model alone (an engine without LoRA), the same engine with LoRA enabled but every request
on the base model, and the batch spread over the adapters (request i on adapter i % N, `max_loras` = N). Greedy,
ignore_eos, token ids only; the medians of the repeats are compared. The target (issue 27): the mixed batch >= 0.85
of the base model alone.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from rose import LLM, LoRARequest, SamplingParams
from rose.bench.common import small_llama
from rose.engine.presets import build_preset
from rose.harness.lora_adapters import make_adapter

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


SHAPES = {
    "tiny": "tiny-llama (hidden 256, 4 layers)",
    "small": "Llama hidden 512, 4 layers",
    "qwen2.5-0.5b": "Qwen2.5-0.5B's shape (hidden 896, 24 layers, 151k vocabulary; random weights)",
    # a GPU's step on a 0.5B model is host-bound (benchmarks/README.md): its time is the kernels launched, not their
    # arithmetic. Qwen2.5-0.5B's 24 layers at widths that make each kernel's arithmetic negligible on a CPU: what
    # each extra kernel and line of Python a layer costs, the CPU's stand-in for that regime
    "host": "host-bound stand-in (24 layers as Qwen2.5-0.5B, hidden 64, 8k vocabulary)",
}


def base_model(shape: str):
    if shape in ("small", "host"):
        _, tokenizer = build_preset("tiny-llama")
        if shape == "host":
            thin = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=24, num_attention_heads=4)
            return small_llama(len(tokenizer), **thin, num_key_value_heads=2), tokenizer
        return small_llama(len(tokenizer)), tokenizer
    return build_preset("tiny-llama" if shape == "tiny" else shape)


def write_adapters(model, root: Path, count: int, rank: int) -> list[LoRARequest]:
    return [
        LoRARequest(f"a{i}", i + 1, make_adapter(root / f"a{i}", TARGETS, rank, seed=100 + i, model=model))
        for i in range(count)
    ]


def timed(
    llm: LLM, prompts: list[list[int]], params: SamplingParams, loras: list | None
) -> tuple[float, int]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=loras)
    return time.perf_counter() - start, sum(len(o.token_ids) for o in outs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--shape", choices=SHAPES, default="tiny")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--kernel", choices=("runs", "masked"), default=None, help="LoRALinear's form (default: runs)"
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 8000) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True, detokenize=False)
    common = dict(device=args.device, dtype=args.dtype, max_num_seqs=args.batch, max_model_len=256)
    with tempfile.TemporaryDirectory() as tmp:
        plain = LLM(*base_model(args.shape), **common)
        requests = write_adapters(plain.engine.model, Path(tmp), args.adapters + 1, args.rank)
        requests, extra = requests[:-1], requests[-1]  # the extra one: the swap below
        lora = LLM(
            *base_model(args.shape),
            **common,
            enable_lora=True,
            max_loras=args.adapters,
            max_lora_rank=args.rank,
        )
        manager = lora.engine.lora
        manager.kernel = args.kernel or manager.kernel
        start = time.perf_counter()
        for r in requests:
            manager.register(r)
        read_ms = (time.perf_counter() - start) * 1e3 / len(requests)
        mixed = [requests[i % len(requests)] for i in range(args.batch)]
        timed(plain, prompts[:4], params, None)  # warm-up
        timed(lora, prompts[:4], params, mixed[:4])
        runs: dict[str, list[float]] = {
            "base alone": [],
            "LoRA engine, base requests": [],
            "mixed adapters": [],
        }
        for _ in range(args.repeats):
            for name, llm, loras in (
                ("base alone", plain, None),
                ("LoRA engine, base requests", lora, None),
                ("mixed adapters", lora, mixed),
            ):
                seconds, tokens = timed(llm, prompts, params, loras)
                runs[name].append(tokens / seconds)
        # a swap: every slot holds an idle adapter; one more adapter takes the least recently used slot
        manager.register(extra)
        start = time.perf_counter()
        slot = manager.acquire(extra.lora_name)
        swap_ms = (time.perf_counter() - start) * 1e3
        manager.release(extra.lora_name)
    base = statistics.median(runs["base alone"])
    print(
        f"{SHAPES[args.shape]}, batch {args.batch}, {args.adapters} adapters of rank {args.rank} on {len(TARGETS)} "
        f"modules a layer, kernel {manager.kernel}, prompt {args.prompt_len} + {args.max_tokens} tokens, "
        f"{args.device} {args.dtype}, {args.threads} threads, "
        f"{args.repeats} repeats (medians)"
    )
    print("| run | tok/s | passes | vs base alone |\n|---|---:|---|---:|")
    for name, values in runs.items():
        med = statistics.median(values)
        passes = " / ".join(f"{v:,.0f}" for v in values)
        print(f"| {name} | {med:,.0f} | {passes} | {med / base:.3f} |")
    ratio = statistics.median(runs["mixed adapters"]) / base
    print(f"target: mixed >= 0.85 x base alone: {'PASS' if ratio >= 0.85 else 'FAIL'} ({ratio:.3f})")
    print(
        f"adapter read from disk and checked: {read_ms:.1f} ms each; swap into slot {slot} (LRU): {swap_ms:.2f} ms"
    )
    print(f"loads {manager.num_loads}, evictions {manager.num_evictions}")


if __name__ == "__main__":
    main()
