"""`n` choices of one prompt against n separate requests of it, in one run: time, prompt positions computed, and
the most KV blocks held at once.

    python benchmarks/bench_n.py [--n 8 --prompt-len 1024 --max-tokens 64 --repeats 3]

Both sides sample the same tokens (choice i is the request with seed + i: checked). The separate requests run with
prefix caching off, rose's default, so they compute the prompt n times; `n` computes it once and shares its full
blocks (rose.engine.parallel_sampling). Runs alternate (n, separate, n, ...); the medians are compared.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from rose import LLM, SamplingParams


def run(llm: LLM, prompt: list[int], params: list[SamplingParams]) -> tuple[float, int, int, list[list[int]]]:
    """(seconds, prompt positions computed, most KV blocks held, each choice's tokens)."""
    engine = llm.engine
    before = engine.get_stats()["num_prefill_tokens"]
    if len(params) == 1:
        engine.add_request("r", prompt, params[0])
    else:
        for i, p in enumerate(params):
            engine.add_request(f"r{i}", prompt, p)
    peak, finals = 0, {}
    start = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.output
        peak = max(peak, engine.kv_blocks_used)
    seconds = time.perf_counter() - start
    if len(params) == 1:
        tokens = [c.token_ids for c in finals["r"].outputs]
    else:
        tokens = [finals[f"r{i}"].token_ids for i in range(len(params))]
    return seconds, engine.get_stats()["num_prefill_tokens"] - before, peak, tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    prompt = [rng.randrange(3, 8192) for _ in range(args.prompt_len)]
    llm = LLM(
        args.model,
        device="cpu",
        max_num_seqs=args.n,
        max_model_len=args.prompt_len + args.max_tokens,
        block_size=16,
    )
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))  # warm-up
    base = dict(max_tokens=args.max_tokens, temperature=1.0, ignore_eos=True)
    together = [SamplingParams(n=args.n, seed=1, **base)]
    separate = [SamplingParams(seed=1 + i, **base) for i in range(args.n)]
    results: dict[str, list[tuple[float, int, int, list[list[int]]]]] = {"n": [], "separate": []}
    for _ in range(args.repeats):
        for name, params in (("n", together), ("separate", separate)):
            results[name].append(run(llm, prompt, params))
    generated = args.n * args.max_tokens
    print(
        f"{args.model}, prompt {args.prompt_len} tokens, {args.n} choices x {args.max_tokens} tokens, "
        f"{args.threads} threads, median of {args.repeats}"
    )
    print(f"{'':10} {'seconds':>8} {'tok/s':>8} {'prompt positions':>17} {'peak KV blocks':>15}")
    medians = {}
    for name, rows in results.items():
        seconds = statistics.median(r[0] for r in rows)
        medians[name] = seconds
        print(f"{name:10} {seconds:8.2f} {generated / seconds:8.0f} {rows[0][1]:17d} {rows[0][2]:15d}")
    same = all(r[3] == results["separate"][0][3] for rows in results.values() for r in rows)
    print(f"n / separate: {medians['separate'] / medians['n']:.2f}x throughput; same tokens: {same}")


if __name__ == "__main__":
    main()
