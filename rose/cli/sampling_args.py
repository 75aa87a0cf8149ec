"""Command-line flags for every SamplingParams field, shared by the subcommands that submit work."""

from __future__ import annotations

import argparse
from typing import Any

from rose.cli.request_args import json_object_arg
from rose.engine.sampling_params import SamplingParams

_HELP = {
    "n": "choices to sample from each prompt (the result's `choices`; seeded: choice i uses seed + i)",
    "max_tokens": "most tokens to generate (default 16)",
    "min_tokens": "generate at least this many tokens before EOS / stop may end the request",
    "temperature": "sampling temperature; 0 = greedy",
    "top_k": "keep the k most likely tokens (0 or -1 = off)",
    "top_p": "nucleus sampling: keep the smallest set of tokens with this much probability",
    "min_p": "drop tokens less likely than min_p times the most likely one",
    "repetition_penalty": "penalize tokens already in the prompt or output (1 = off)",
    "presence_penalty": "penalize tokens already generated, once (0 = off)",
    "frequency_penalty": "penalize tokens by how often they were generated (0 = off)",
    "seed": "per-request seed: the same tokens alone or in any batch",
    "stop": "stop string (repeatable)",
    "stop_token_ids": "stop token id (repeatable)",
    "ignore_eos": "keep generating past EOS",
    "include_stop_str_in_output": "keep the stop string in the text",
    "skip_special_tokens": "leave special tokens out of the text",
    "logprobs": "return the log-probability of each token and the top-N alternatives",
    "prompt_logprobs": "return the log-probability of each prompt token and the top-N alternatives (vLLM's)",
    "detokenize": "return text (--no-detokenize: token ids only)",
    "allowed_token_ids": "only these token ids may be sampled (repeatable)",
    "bad_words": "a word never to generate (repeatable; vLLM's bad_words)",
    "logit_bias": "add to token logits: JSON such as '{\"50256\": -100}' (token id -> bias in [-100, 100]), or @FILE",
}
_TYPES: dict[str, Any] = {
    "n": int,
    "max_tokens": int,
    "min_tokens": int,
    "top_k": int,
    "seed": int,
    "logprobs": int,
    "prompt_logprobs": int,
    "temperature": float,
    "top_p": float,
    "min_p": float,
    "repetition_penalty": float,
    "presence_penalty": float,
    "frequency_penalty": float,
    "logit_bias": json_object_arg,
}


# fields with flags of their own elsewhere (a constraint is given as --json-schema, --regex, ...)
_NOT_FLAGS = ("structured_outputs",)


def _flag_fields() -> list[str]:
    return [n for n in SamplingParams.field_names() if n not in _NOT_FLAGS]


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling (vLLM SamplingParams; unset flags keep their defaults)")
    for name in _flag_fields():
        flag = "--" + name.replace("_", "-")
        if name in ("stop", "stop_token_ids", "allowed_token_ids", "bad_words"):
            group.add_argument(
                flag,
                action="append",
                type=str if name in ("stop", "bad_words") else int,
                dest=name,
                default=None,
                help=_HELP[name],
            )
        elif name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize"):
            group.add_argument(
                flag, action=argparse.BooleanOptionalAction, dest=name, default=None, help=_HELP[name]
            )
        else:
            group.add_argument(flag, type=_TYPES[name], dest=name, default=None, help=_HELP[name])


def sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling fields the user set on the command line."""
    return {n: getattr(args, n) for n in _flag_fields() if getattr(args, n, None) is not None}
