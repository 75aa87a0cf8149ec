"""Prefix caching: prompt processing time for requests sharing a long prefix, cache on vs off, in one run.

    python benchmarks/bench_prefix.py [--num-requests 128 --prefix-len 512 --suffix-len 32]

Each request asks for one token, so the time measured is the time to process the prompts.
"""

from __future__ import annotations

import argparse
import random
import time

from rose import LLM, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    prefix = [rng.randrange(3, 8192) for _ in range(args.prefix_len)]
    prompts = [
        prefix + [rng.randrange(3, 8192) for _ in range(args.suffix_len)] for _ in range(args.num_requests)
    ]
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    max_model_len = args.prefix_len + args.suffix_len + 8
    outputs, times = {}, {}
    for on in (False, True):
        llm = LLM(
            args.model,
            device="cpu",
            max_num_seqs=args.num_requests,
            max_model_len=max_model_len,
            enable_prefix_caching=on,
        )
        llm.generate([[5, 6, 7]], params)  # warm-up, on tokens no request shares
        before = llm.engine.get_stats()
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        times[on] = time.perf_counter() - start
        outputs[on] = [o.token_ids for o in outs]
        stats = {k: v - before.get(k, 0) for k, v in llm.engine.get_stats().items()}
        hits = (
            f", hits {stats['prefix_cache_hits']}/{stats['prefix_cache_queries']} requests, "
            f"{stats['prefix_cache_hit_tokens']}/{stats['prefix_cache_query_tokens']} tokens"
            if on
            else ""
        )
        print(f"prefix cache {'on ' if on else 'off'}: {times[on]:.2f} s{hits}")
    print(f"speed-up {times[False] / times[True]:.1f}x, identical outputs: {outputs[False] == outputs[True]}")


if __name__ == "__main__":
    main()
