"""`rose generate`: offline generation on this machine, no Redis needed."""

from __future__ import annotations

import argparse
import sys

from rose.cli.sampling_args import add_sampling_args, sampling_kwargs


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text for prompts on this machine (no Redis)",
        description="Generate text for one or more prompts with the offline engine.",
    )
    p.add_argument("prompts", nargs="+", metavar="PROMPT", help="prompt text (one or more)")
    p.add_argument(
        "--model",
        default="tiny-llama",
        help="preset (tiny-llama, tiny-qwen2, tiny-gpt2), checkpoint directory or hub id",
    )
    p.add_argument("--tokenizer", default=None, help="tokenizer path or name (default: the model's)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N (default: auto)")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16 (default: auto)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="most requests decoding at once")
    p.add_argument("--max-model-len", type=int, default=None, help="context length per request")
    p.add_argument(
        "--stream", action="store_true", help="print tokens as they are generated (one prompt at a time)"
    )
    add_sampling_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rose import LLM, SamplingParams

    params = SamplingParams(**sampling_kwargs(args))
    llm = LLM(
        args.model,
        args.tokenizer,
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
    )
    out = sys.stdout
    if args.stream:
        for prompt in args.prompts:
            out.write(prompt)
            for delta in llm.stream(prompt, params):
                out.write(delta)
                out.flush()
            out.write("\n")
        return 0
    for i, res in enumerate(llm.generate(args.prompts, params)):
        if i:
            out.write("\n")
        out.write(f"[{i}] {res.prompt!r} -> {res.finish_reason}, {len(res.token_ids)} tokens\n{res.text}\n")
    return 0
