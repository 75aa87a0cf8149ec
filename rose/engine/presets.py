"""Random-weight models and an in-memory tokenizer, so tests, demos and benchmarks run anywhere with no download.

The weights come from a fixed seed (same model every time); the tokenizer is a byte-level BPE trained in memory on a
fixed synthetic corpus. The tiny presets' vocabularies have exactly as many ids as the tokenizer, so every id the model
can emit decodes; `qwen2.5-0.5b` (a benchmark model) has a larger vocabulary than the tokenizer, see its config.
"""

from __future__ import annotations

import contextlib
import functools
import random
from collections.abc import Callable

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

VOCAB_SIZE = 8192
CONTEXT = 4096
EOS, BOS, PAD = "<|endoftext|>", "<|bos|>", "<|pad|>"
EOS_ID, BOS_ID, PAD_ID = 0, 1, 2  # special tokens come first in the trained vocabulary

_WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had by word "
    "but not what all were we when your can said there use an each which she do how their if will up other about "
    "out many then them these so some her would make like him into time has look two more write go see number no "
    "way could people my than first water been call who oil its now find long down day did get come made may part "
    "rose queue worker token batch job stream redis engine model cache prompt text hello world bonjour merci"
).split()


def _corpus(seed: int = 0):
    rng = random.Random(seed)
    syllables = [c + v for c in "bcdfghklmnprstvwz" for v in "aeiou"]
    words = _WORDS + ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(6000)]
    extras = ["é", "à", "ü", "中文", "日本語", "🌹", "Ω", ",", ".", "!", "?", "\n"]
    for _ in range(2000):
        parts = [rng.choice(words) for _ in range(50)]
        parts[rng.randrange(50)] = rng.choice(extras)
        yield " ".join(parts)


@functools.cache
def _tokenizer_json(vocab_size: int = VOCAB_SIZE) -> str:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, BOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"in-memory tokenizer has {tok.get_vocab_size()} tokens, expected {vocab_size}")
    return tok.to_str()


# A small chat template in the usual shape (BOS once, a header per turn, EOS after each finished turn), so demos and
# tests render chat messages for real. It writes plain-text headers: the presets' vocabulary has no role tokens.
# With `tools` it writes them in a system turn first, Hermes / Qwen2.5 style (the model is told to answer with
# <tool_call> blocks, which rose.engine.tool_calls' "hermes" parser reads; a system message joins that turn); an
# assistant message's tool_calls are written as such blocks (arguments as an object or as OpenAI's JSON text), and
# tool results are `tool` turns. Messages without tools or tool_calls render exactly as before.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}"
    "{{ '<|system|>\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    "{{ '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}"
    "{% for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call>' + eos_token + '\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if not (tools and loop.first and message['role'] == 'system') %}"
    "{{ '<|' + message['role'] + '|>\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% endif %}"
    "{% if message['tool_calls'] %}{% for tool_call in message['tool_calls'] %}"
    "{% set call = tool_call['function'] if tool_call['function'] is defined else tool_call %}"
    "{% if message['content'] or not loop.first %}{{ '\n' }}{% endif %}"
    "{{ '<tool_call>\n{\"name\": ' + (call['name'] | tojson) + ', \"arguments\": ' }}"
    "{% if call['arguments'] is string %}{{ call['arguments'] }}"
    "{% else %}{{ (call['arguments'] if call['arguments'] is defined else {}) | tojson }}{% endif %}"
    "{{ '}\n</tool_call>' }}"
    "{% endfor %}{% endif %}"
    "{% if not (loop.last and continue_final_message) %}{{ eos_token + '\n' }}{% endif %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def build_tokenizer(vocab_size: int = VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer built in memory (deterministic; about 0.2 s the first time, cached after), with
    the presets' chat template."""
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json(vocab_size)),
        eos_token=EOS,
        bos_token=BOS,
        pad_token=PAD,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _special_ids() -> dict:
    return {"eos_token_id": EOS_ID, "bos_token_id": BOS_ID, "pad_token_id": PAD_ID}


def tiny_llama_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=CONTEXT,
        tie_word_embeddings=False,
        **_special_ids(),
    )


def tiny_qwen2_config() -> Qwen2Config:
    return Qwen2Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=CONTEXT,
        tie_word_embeddings=True,
        **_special_ids(),
    )


def qwen2_5_0_5b_config() -> Qwen2Config:
    """Qwen2.5-0.5B's published dimensions (494M parameters) with random weights: a benchmark model (GPU roofline,
    `rose bench step --model qwen2.5-0.5b --device cuda --dtype bfloat16`), not a language model.

    Its vocabulary (151,936 ids, as published) is larger than the in-memory tokenizer's 8,192 tokens, as Qwen's own
    151,936-row embedding is larger than its 151,665-token tokenizer: an engine given this tokenizer treats ids past
    it as padding rows (never sampled, rejected in prompts), and the detokenizer decodes an unknown id to "" rather
    than failing. Benchmark it on token ids (`detokenize=False`, or no tokenizer at all, as vLLM's
    `skip_tokenizer_init`), so the LM head and the sampler work over the full published vocabulary. The special ids
    are the in-memory tokenizer's (0, 1, 2), not Qwen's.
    """
    return Qwen2Config(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=True,
        use_sliding_window=False,
        **_special_ids(),
    )


def tiny_gpt2_config() -> GPT2Config:
    return GPT2Config(
        vocab_size=VOCAB_SIZE,
        n_embd=256,
        n_layer=4,
        n_head=8,
        n_positions=CONTEXT,
        **_special_ids(),
    )


_PRESETS: dict[str, tuple[Callable[[], PretrainedConfig], type[PreTrainedModel]]] = {
    "tiny-llama": (tiny_llama_config, LlamaForCausalLM),
    "tiny-qwen2": (tiny_qwen2_config, Qwen2ForCausalLM),
    "tiny-gpt2": (tiny_gpt2_config, GPT2LMHeadModel),
    "qwen2.5-0.5b": (qwen2_5_0_5b_config, Qwen2ForCausalLM),
}

PRESET_NAMES = tuple(_PRESETS)


def is_preset(name: object) -> bool:
    return isinstance(name, str) and name in _PRESETS


def preset_config(name: str) -> PretrainedConfig:
    """The preset's config alone (no weights): e.g. to build it on the meta device or read its dimensions."""
    if name not in _PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets are {', '.join(PRESET_NAMES)}")
    return _PRESETS[name][0]()


def model_from_config(
    config: PretrainedConfig,
    model_cls: type[PreTrainedModel] | None = None,
    seed: int = 0,
    device: str | torch.device | None = None,
):
    """Random weights for `config` (float32), the same for the same seed and device type.

    `device` builds the weights there directly (None: CPU): a 0.5B model initialised on a GPU takes a fraction of a
    second instead of seconds on the host. CUDA's generator differs from the CPU's, so the weights differ too."""
    from transformers import AutoModelForCausalLM

    dev = torch.device("cpu") if device is None else torch.device(device)
    # fork_rng restores the RNG state of the devices it is given; the CPU's is always restored
    fork = [dev.index if dev.index is not None else torch.cuda.current_device()] if dev.type == "cuda" else []
    with torch.random.fork_rng(devices=fork):
        torch.manual_seed(seed)
        # the CPU path stays exactly as it always was: no device mode installed
        with torch.device(dev) if dev.type != "cpu" else contextlib.nullcontext():
            if model_cls is None:  # float32 whatever the config's `dtype` (real configs name bfloat16)
                return AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            return model_cls(config)


def build_preset(
    name: str, seed: int = 0, device: str | torch.device | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """The preset's model (float32, eval mode, on `device`: None for the CPU) and its tokenizer."""
    return preset_model(name, seed=seed, device=device), build_tokenizer()


def preset_model(name: str, seed: int = 0, device: str | torch.device | None = None) -> PreTrainedModel:
    """The preset's model alone (float32, eval mode, on `device`: None for the CPU)."""
    return model_from_config(preset_config(name), _PRESETS[name][1], seed=seed, device=device).eval()


def lean_toward(
    model: PreTrainedModel, tokenizer, texts: Callable[[str], bool], bias: float = 30.0
) -> list[int]:
    """Make `model` strongly prefer the tokens whose decoded text satisfies `texts` (a hook adds `bias` to their
    logits), as real models lean toward whitespace in JSON mode: to show what a constraint does with a model
    pushing against it. Returns the ids it leans toward."""
    vocab = model.config.vocab_size
    ids = [i for i in range(vocab) if texts(tokenizer.decode([i]))]
    if not ids:
        raise ValueError("no token of the tokenizer matches")
    logits_bias = torch.zeros(vocab)
    logits_bias[ids] = bias
    model.get_output_embeddings().register_forward_hook(lambda module, args, out: out + logits_bias.to(out))
    return ids
