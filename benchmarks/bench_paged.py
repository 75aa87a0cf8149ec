#!/usr/bin/env python
"""The paged KV store vs slot-style reservation, and under memory pressure: ratios from one run.

    python benchmarks/bench_paged.py budget   [--num-requests 128 --max-kv-cache-bytes 256MiB --max-model-len 4096]
    python benchmarks/bench_paged.py pressure [--num-requests 500 --full-length-seqs 20 --max-model-len 256]

`budget`: the same KV budget, two layouts. `paged` admits by free blocks (batch cap `--max-num-seqs`); `slots`
reproduces the slot store this engine had before the paged one: every sequence reserves `max_model_len` positions,
so at most budget // (max_model_len x bytes per token) run at once (the rows the slot store could allocate); the
engine is otherwise the same, so the ratio is what reserving whole rows costs. Prints peak running sequences and
generated tok/s of each, and their ratios.

`pressure`: a budget for `--full-length-seqs` sequences of `max_model_len` and many more requests: every request
must complete, with exactly the tokens of an unconstrained run (greedy); prints the preemption count.

Model: `--model tiny-llama` (random weights; `qwen2.5-0.5b` for GPUs), `--device cpu --dtype float32` by default,
greedy, EOS ignored; workload `rose.bench.workload`
(prompts uniform in 16..128 tokens, outputs uniform in 16..128, seeded).
"""

from __future__ import annotations

import argparse
import gc
import logging
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402
from pydantic import ByteSize, TypeAdapter  # noqa: E402

from rose.bench.workload import make_workload  # noqa: E402
from rose.engine.engine import Engine  # noqa: E402
from rose.engine.presets import build_preset  # noqa: E402
from rose.engine.sampling_params import SamplingParams  # noqa: E402

logger = logging.getLogger("bench_paged")


def parse_bytes(text: str) -> int:
    """'256MiB', '1GB', '4096' -> bytes (pydantic's ByteSize, as rose-worker's --max-kv-cache-bytes)."""
    return int(TypeAdapter(ByteSize).validate_python(text))


DEVICE = {"device": "cpu", "dtype": "float32"}


def run(model_name: str, workload, **engine_kwargs) -> dict:
    """Drain the workload through a fresh engine (after an untimed warm-up); tokens, peaks and timings."""
    model, _ = build_preset(model_name)
    engine = Engine(model, None, **DEVICE, **engine_kwargs)
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, detokenize=False)
    for i in range(4):
        engine.add_request(f"warm{i}", [5 + i] * 8, warm)
    while engine.has_unfinished():
        engine.step()
    before = engine.get_stats()
    for r in workload.requests:
        params = SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True, detokenize=False)
        engine.add_request(r.request_id, r.prompt_token_ids, params)
    tokens: dict[str, list[int]] = {}
    peak_running = peak_blocks = 0
    start = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.output.token_ids
        peak_running = max(peak_running, engine.num_running)
        peak_blocks = max(peak_blocks, engine.kv_blocks_used)
    wall = time.perf_counter() - start
    stats = engine.get_stats()
    blocks = engine.kv_blocks_total
    del engine, model  # the model holds its binding to the store: free both before the next pass allocates
    gc.collect()
    generated = sum(len(t) for t in tokens.values())
    return {
        "tokens": tokens,
        "wall": wall,
        "tok_s": generated / wall,
        "peak_running": peak_running,
        "peak_blocks": peak_blocks,
        "blocks": blocks,
        "preemptions": stats["num_preemptions"] - before["num_preemptions"],
        "steps": stats["num_steps"] - before["num_steps"],
        "complete": len(tokens) == len(workload)
        and all(len(tokens[r.request_id]) == r.max_tokens for r in workload.requests),
    }


def bytes_per_token(model_name: str) -> int:
    """K/V bytes of one position in the engine's store (its dtype on its device)."""
    engine = Engine(build_preset(model_name)[0], None, **DEVICE, max_num_seqs=1, max_model_len=16)
    return engine.cache.nbytes // (engine.kv_blocks_total * engine.block_size)


def budget_main(args: argparse.Namespace) -> None:
    workload = make_workload(args.num_requests, seed=args.seed)
    budget = parse_bytes(args.max_kv_cache_bytes)
    slot_rows = budget // (args.max_model_len * bytes_per_token(args.model))
    common = dict(max_model_len=args.max_model_len, max_kv_cache_bytes=budget)
    layouts = args.layouts.split(",")
    passes: dict[str, list[dict]] = {layout: [] for layout in layouts}
    for i in range(args.repeats):  # round-robin, so that a busy spell on a shared machine hits both
        for layout in layouts if i % 2 == 0 else layouts[::-1]:
            seqs = args.max_num_seqs if layout == "paged" else slot_rows
            r = run(args.model, workload, max_num_seqs=seqs, **common)
            passes[layout].append(r)
            print(
                f"pass {i + 1} {layout:>6}: max_num_seqs {seqs:4d}, pool {r['blocks']} blocks, peak running "
                f"{r['peak_running']:4d}, peak blocks {r['peak_blocks']:5d}, {r['steps']} steps, {r['wall']:.2f} s, "
                f"{r['tok_s']:.0f} tok/s, preemptions {r['preemptions']}, complete {r['complete']}",
                flush=True,
            )
    tok_s = {layout: statistics.median(r["tok_s"] for r in rs) for layout, rs in passes.items()}
    for layout in layouts:
        print(f"{layout:>6}: median {tok_s[layout]:.0f} tok/s over {args.repeats} passes")
    if {"paged", "slots"} <= set(passes):
        p, s = passes["paged"][0], passes["slots"][0]
        print(
            f"paged / slots ({args.num_requests} requests, {budget / 2**20:.0f} MiB, max_model_len "
            f"{args.max_model_len}): running sequences {p['peak_running'] / s['peak_running']:.1f}x, "
            f"throughput {tok_s['paged'] / tok_s['slots']:.2f}x (medians), identical outputs "
            f"{p['tokens'] == s['tokens']}"
        )


def pressure_main(args: argparse.Namespace) -> None:
    workload = make_workload(args.num_requests, seed=args.seed)
    budget = args.full_length_seqs * args.max_model_len * bytes_per_token(args.model)
    common = dict(max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs)
    free = run(args.model, workload, **common)  # the pool holds every request at its longest
    tight = run(args.model, workload, max_kv_cache_bytes=budget, **common)
    for name, r in (("unconstrained", free), ("pressure", tight)):
        print(
            f"{name:>13}: pool {r['blocks']} blocks, peak running {r['peak_running']}, {r['wall']:.2f} s, "
            f"{r['tok_s']:.0f} tok/s, preemptions {r['preemptions']}, every request complete {r['complete']}"
        )
    print(
        f"pressure ({args.num_requests} requests, budget for {args.full_length_seqs} x {args.max_model_len} "
        f"tokens): complete {tight['complete']}, outputs equal the unconstrained run "
        f"{tight['tokens'] == free['tokens']}, preemptions {tight['preemptions']}, "
        f"throughput {tight['tok_s'] / free['tok_s']:.2f}x of unconstrained"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="mode", required=True)
    b = sub.add_parser("budget", help="paged vs slot-style reservation at the same KV budget")
    b.add_argument("--num-requests", type=int, default=128)
    b.add_argument("--max-kv-cache-bytes", default="256MiB")
    b.add_argument("--max-model-len", type=int, default=4096)
    b.add_argument("--max-num-seqs", type=int, default=512, help="the paged engine's batch cap")
    b.add_argument("--layouts", default="slots,paged", help="which to run: slots, paged or both")
    b.add_argument("--repeats", type=int, default=1, help="passes per layout, round-robin; medians reported")
    m = sub.add_parser("pressure", help="a pool far smaller than the workload: preemption")
    m.add_argument("--num-requests", type=int, default=500)
    m.add_argument("--full-length-seqs", type=int, default=20)
    m.add_argument("--max-model-len", type=int, default=256)
    m.add_argument("--max-num-seqs", type=int, default=512)
    for sp in (b, m):
        sp.add_argument("--model", default="tiny-llama")
        sp.add_argument("--seed", type=int, default=0)
        sp.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
        sp.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto")
        sp.add_argument("--dtype", default="float32", help="float32, bfloat16, float16 or auto")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    DEVICE.update(device=args.device, dtype=args.dtype)
    budget_main(args) if args.mode == "budget" else pressure_main(args)


if __name__ == "__main__":
    main()
