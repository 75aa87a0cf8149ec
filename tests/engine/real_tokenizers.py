"""Real tokenizers (tests/data/tokenizers: Qwen2.5-Instruct's 151k byte-level BPE, Phi-3-mini's 32k SentencePiece
BPE) and tiny random-weight models over their vocabularies, for tests and benchmarks that need a real vocabulary.

Only the repository's own copies are read, so a fresh clone needs nothing else and nothing is downloaded.
"""

from __future__ import annotations

import atexit
import functools
import gzip
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from rose.engine.presets import lean_toward, model_from_config

TOKENIZERS_DIR = Path(__file__).resolve().parents[1] / "data" / "tokenizers"
TOKENIZER_NAMES = ("qwen2.5-instruct", "phi-3-mini-4k-instruct")

_CLOSERS = set('"}],0123456789')
_JSON_WHITESPACE = set(" \t\n\r")

# What a pushed model leans toward (a token's decoded text -> lean?), to show what a constraint does with a model
# pushing against it: "short" prefers the tokens that end strings, arrays and objects (and digits, so numbers are
# written and left quickly), so outputs close as soon as their grammar lets them; "whitespace" prefers whitespace-only
# tokens, as real models do in JSON mode, so every gap and every free string fills with whitespace.
PUSHES: dict[str, Callable[[str], bool]] = {
    "short": lambda text: bool(text) and set(text) <= _CLOSERS,
    "whitespace": lambda text: bool(text) and set(text) <= _JSON_WHITESPACE,
}


@functools.cache
def _unpacked_root() -> Path:
    """One temporary folder for the process's unpacked tokenizers, removed at exit."""
    root = Path(tempfile.mkdtemp(prefix="rose-tokenizers-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


@functools.cache
def load_tokenizer(name: str) -> PreTrainedTokenizerBase:
    """The named tokenizer (one of TOKENIZER_NAMES), gunzipped into a temporary folder and loaded offline with
    `AutoTokenizer.from_pretrained`; one instance per name per process (callers must not modify it)."""
    from transformers import AutoTokenizer

    source = TOKENIZERS_DIR / name
    if name not in TOKENIZER_NAMES or not source.is_dir():
        raise ValueError(f"unknown tokenizer {name!r}; the tests carry {', '.join(TOKENIZER_NAMES)}")
    target = _unpacked_root() / name
    target.mkdir()
    with (
        gzip.open(source / "tokenizer.json.gz", "rb") as packed,
        open(target / "tokenizer.json", "wb") as out,
    ):
        shutil.copyfileobj(packed, out)
    shutil.copy(source / "tokenizer_config.json", target)
    return AutoTokenizer.from_pretrained(target, local_files_only=True)


def tiny_model(tokenizer: PreTrainedTokenizerBase, seed: int = 0) -> PreTrainedModel:
    """A 2-layer Llama (hidden 64, 4 heads, 2 KV heads) with random weights from `seed` over `tokenizer`'s whole
    vocabulary: `vocab_size` is len(tokenizer) rounded up to a multiple of 64, as real checkpoints pad theirs (the
    engine never samples the padding rows); special ids are the tokenizer's. Float32, eval mode, on the CPU."""
    vocab = -(-len(tokenizer) // 64) * 64
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return model_from_config(config, LlamaForCausalLM, seed=seed).eval()


def pushed_model(tokenizer: PreTrainedTokenizerBase, push: str, seed: int = 0) -> PreTrainedModel:
    """`tiny_model(tokenizer, seed)` leaning strongly toward the tokens of `push` (a key of PUSHES)."""
    model = tiny_model(tokenizer, seed)
    lean_toward(model, tokenizer, PUSHES[push])
    return model
