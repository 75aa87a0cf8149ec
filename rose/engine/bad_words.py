"""`SamplingParams.bad_words` as token id sequences: vLLM's `SamplingParams.update_from_tokenizer`.

Each word is encoded without special tokens twice, with its leading whitespace stripped: as it stands (a word at the
start of the text) and after one space (a word inside the text, for the tokenizers that fold the space into the
word's token). The spaced form is kept only when its first token differs from the bare form's and it has as many
tokens (vLLM's rule: otherwise it is no separate word token); the bare form must give at least one token, an empty
spaced form is skipped. The sampler (rose.engine.sampler.apply_bad_words) bans a sequence's last token whenever the
tokens generated so far end with the rest of it (a one-token word: always).
"""

from __future__ import annotations

from typing import Any

# vLLM's VLLM_MAX_NUM_BAD_WORDS default: token sequences per request, after tokenization (each step checks them all)
MAX_BAD_WORD_SEQUENCES = 128


def bad_words_token_ids(words: list[str], tokenizer: Any, vocab_size: int) -> list[list[int]]:
    """The token id sequences to ban for `words`. Raises ValueError naming `bad_words` (a word that gives no token,
    more than MAX_BAD_WORD_SEQUENCES sequences, an id outside [0, vocab_size), a word that is no Unicode text)."""
    sequences: list[list[int]] = []
    for word in words:
        try:
            word.encode("utf-8")
        except UnicodeEncodeError as exc:  # the tokenizer would raise a bare TypeError
            raise ValueError(
                f"SamplingParams.bad_words: {word!a} is not valid Unicode text (a lone surrogate at index "
                f"{exc.start})"
            ) from None
        bare = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not bare:
            raise ValueError(
                f"SamplingParams.bad_words: {word!r} gives no token; each word must give at least one"
            )
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        for ids in (bare, spaced):
            if ids is spaced and not (spaced and spaced[0] != bare[0] and len(spaced) == len(bare)):
                continue
            sequences.append(ids)
            if len(sequences) > MAX_BAD_WORD_SEQUENCES:
                raise ValueError(
                    f"SamplingParams.bad_words: too many words: they give more than {MAX_BAD_WORD_SEQUENCES} token "
                    "sequences (each word gives one or two)"
                )
    outside = [t for ids in sequences for t in ids if not 0 <= t < vocab_size]
    if outside:
        raise ValueError(
            f"SamplingParams.bad_words: token ids must be in [0, {vocab_size}) (the model's vocabulary), "
            f"got {outside[:5]}"
        )
    return sequences
