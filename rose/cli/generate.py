"""`rose generate`: offline generation on this machine, no Redis needed."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING, Any

from rose.cli.request_args import add_request_args, chat_kwargs, constraint_kwargs
from rose.cli.sampling_args import add_sampling_args, sampling_kwargs
from rose.engine.config import DEFAULTS

if TYPE_CHECKING:
    from rose.engine.lora import LoRARequest


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text for prompts on this machine (no Redis)",
        description="Generate text for one or more prompts with the offline engine. With --chat, each PROMPT is "
        "the user message of a conversation of its own, rendered with the model's chat template.",
    )
    p.add_argument("prompts", nargs="+", metavar="PROMPT", help="prompt text (one or more)")
    p.add_argument(
        "--model",
        default="tiny-llama",
        help="preset (tiny-llama, tiny-qwen2, tiny-gpt2), checkpoint directory or hub id",
    )
    p.add_argument("--tokenizer", default=None, help="tokenizer path or name (default: the model's)")
    p.add_argument("--device", default=DEFAULTS.device, help="auto, cpu, cuda, cuda:N (default: auto)")
    p.add_argument("--dtype", default=DEFAULTS.dtype, help="auto, float32, bfloat16, float16 (default: auto)")
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=DEFAULTS.max_num_seqs,
        help=f"most requests decoding at once (a batch cap; default: {DEFAULTS.max_num_seqs})",
    )
    p.add_argument("--max-model-len", type=int, default=None, help="context length per request")
    p.add_argument(
        "--stream", action="store_true", help="print tokens as they are generated (one prompt at a time)"
    )
    p.add_argument(
        "--chat",
        action="store_true",
        help="each PROMPT is one user message of its own conversation, rendered with the chat template; the "
        "output is the assistant's reply",
    )
    p.add_argument("--system", default=None, metavar="TEXT", help="with --chat: a system message first")
    p.add_argument(
        "--lora",
        default=None,
        metavar="NAME=PATH",
        help="generate every prompt with this LoRA adapter: PATH a PEFT adapter directory (or a hub id in the "
        "local Hugging Face cache), NAME its name, as rose-worker's --lora-modules takes it (its JSON form too); "
        "default: the base model",
    )
    p.add_argument(
        "--max-lora-rank",
        type=int,
        default=None,
        metavar="RANK",
        help="with --lora: the highest adapter rank the engine serves (vLLM's --max-lora-rank); default: the "
        "adapter's rank, read from its adapter_config.json",
    )
    add_sampling_args(p)
    add_request_args(p)
    p.set_defaults(func=run)


def _conversations(args: argparse.Namespace) -> list[list[dict[str, Any]]]:
    system = [{"role": "system", "content": args.system}] if args.system is not None else []
    return [[*system, {"role": "user", "content": prompt}] for prompt in args.prompts]


def _lora(args: argparse.Namespace) -> tuple[LoRARequest | None, dict[str, Any]]:
    """--lora NAME=PATH -> its LoRARequest (id 1) and the LLM's options to serve it: enable_lora, and
    max_lora_rank (--max-lora-rank, else the adapter's rank as its adapter_config.json gives it; an adapter that
    cannot be read is left to the engine's register, which names what is wrong)."""
    from rose.config import parse_lora_module

    if args.lora is None:
        if args.max_lora_rank is not None:
            raise ValueError("--max-lora-rank: needs --lora (the adapter to serve)")
        return None, {}
    try:
        name, path = parse_lora_module(args.lora)
    except ValueError as exc:
        raise ValueError(f"--lora: {exc}") from None
    from rose.engine.lora import LoRAError, LoRARequest, adapter_dir  # torch: only once the flags are good

    request = LoRARequest(name, 1, os.path.expanduser(path))
    rank = args.max_lora_rank
    if rank is None:
        rank = DEFAULTS.max_lora_rank
        try:
            config = json.loads(
                (adapter_dir(request.lora_path, f"--lora {args.lora}") / "adapter_config.json").read_text()
            )
        except (LoRAError, OSError, ValueError):
            config = {}
        if isinstance(config, dict) and isinstance(config.get("r"), int) and config["r"] >= 1:
            rank = config["r"]
    return request, {"enable_lora": True, "max_lora_rank": rank}


def run(args: argparse.Namespace) -> int:
    # the flags are checked before torch and transformers load (seconds): a bad one fails at once
    from rose.engine.chat import ChatOptions
    from rose.engine.sampling_params import SamplingParams

    chat = chat_kwargs(args)
    if not args.chat and (chat or args.system is not None):
        given = ["--system"] if args.system is not None else []
        given += ["--" + name.replace("_", "-") for name in chat if name != "add_generation_prompt"]
        given += ["--no-add-generation-prompt"] if chat.get("add_generation_prompt") is False else []
        raise ValueError(f"{', '.join(given)}: needs --chat (chat options apply to chat messages only)")
    params = SamplingParams(**sampling_kwargs(args), **constraint_kwargs(args))
    if args.stream and params.n > 1:
        raise ValueError("--stream prints one text per prompt: --n > 1 needs the printing of whole choices")
    options = ChatOptions(**chat) if args.chat else None  # checked before the model loads
    lora, lora_options = _lora(args)
    from rose import LLM
    from rose.engine.chat import render_chat

    llm = LLM(
        args.model,
        args.tokenizer,
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        **lora_options,
    )
    if lora is not None:
        llm.engine.lora.register(lora)  # read and checked now: a bad adapter fails before any output
    prompts: list[Any] = list(args.prompts)
    if options is not None:
        # Rendered here (not by LLM.chat) so that --stream and the batch path take the same prompts.
        rendered = [render_chat(llm.get_tokenizer(), conv, options) for conv in _conversations(args)]
        prompts = [{"prompt": r.prompt, "prompt_token_ids": r.prompt_token_ids} for r in rendered]
    out = sys.stdout
    if args.stream:
        for shown, prompt in zip(args.prompts, prompts, strict=True):
            # a chat prints only the reply (its prompt is the rendered template); a plain prompt is echoed
            if not args.chat:
                out.write(shown)
            for delta in llm.stream(prompt, params, lora_request=lora):
                out.write(delta)
                out.flush()
            out.write("\n")
        return 0
    for i, (shown, res) in enumerate(
        zip(args.prompts, llm.generate(prompts, params, lora_request=lora), strict=True)
    ):
        for choice in res.outputs:
            if i or choice.index:
                out.write("\n")
            label = f"[{i}]" if len(res.outputs) == 1 else f"[{i}.{choice.index}]"
            tokens = len(choice.token_ids)
            out.write(f"{label} {shown!r} -> {choice.finish_reason}, {tokens} tokens\n{choice.text}\n")
    return 0
