"""`SamplingParams.bad_words` (vLLM's) through the engine: the words' token sequences, and generation with a real
tokenizer (Qwen2.5's) that would write a word and does not once it is banned."""

from __future__ import annotations

import pytest
from engine_helpers import drain, greedy
from real_tokenizers import load_tokenizer, tiny_model

from rose.engine.bad_words import bad_words_token_ids
from rose.engine.engine import Engine
from rose.engine.sampling_params import SamplingParams


class FakeTokenizer:
    """Encodes with a fixed table; records the calls (text, add_special_tokens)."""

    def __init__(self, table: dict[str, list[int]]) -> None:
        self.table = table
        self.calls: list[tuple[str, bool]] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.calls.append((text, add_special_tokens))
        return self.table[text]


def test_each_word_is_encoded_bare_and_after_a_space_without_special_tokens():
    tok = FakeTokenizer(
        {
            "ab": [1, 2],
            " ab": [3, 2],  # a word token of its own: kept
            "cd": [4],
            " cd": [4],  # the same first token: no second sequence
            "ef": [5],
            " ef": [6, 7],  # another length: dropped (vLLM's rule)
            "gh": [8],
            " gh": [],  # nothing: skipped
        }
    )
    assert bad_words_token_ids(["  ab", "cd", "ef", "gh"], tok, 10) == [[1, 2], [3, 2], [4], [5], [8]]
    # leading whitespace stripped, special tokens never added
    assert tok.calls[:2] == [("ab", False), (" ab", False)]
    with pytest.raises(ValueError, match=r"bad_words: token ids must be in \[0, 3\).*\[3\]"):
        bad_words_token_ids(["ab"], tok, 3)
    with pytest.raises(ValueError, match="bad_words: 'x' gives no token"):
        bad_words_token_ids(["x"], FakeTokenizer({"x": [], " x": [1]}), 10)


@pytest.fixture(scope="module")
def qwen_engine() -> Engine:
    tok = load_tokenizer("qwen2.5-instruct")
    return Engine(tiny_model(tok), tok, device="cpu", dtype="float32", max_num_seqs=4, max_model_len=128)


def test_qwen_words_give_their_bare_and_spaced_tokens(qwen_engine):
    tok = qwen_engine.tokenizer
    ids = bad_words_token_ids(["hello hello", " world"], tok, qwen_engine.vocab_size)
    assert [tok.decode(seq) for seq in ids] == ["hello hello", " hello hello", "world", " world"]


def test_a_word_the_model_would_write_is_not_written_once_banned(qwen_engine):
    """Only ' hello' and ' world' may be sampled and ' hello' is all but forced: the model writes ' hello hello ...'.
    With "hello hello" banned, ' hello' is banned right after ' hello' only: the text alternates."""
    tok = qwen_engine.tokenizer
    forced = greedy(
        6, allowed_token_ids=tok.encode(" hello world"), logit_bias={tok.encode(" hello")[0]: 100}
    )
    qwen_engine.add_request("plain", [9707], forced)
    qwen_engine.add_request(
        "banned", [9707], SamplingParams(**{**forced.to_dict(), "bad_words": ["hello hello"]})
    )
    run = drain(qwen_engine)
    assert run.outputs["plain"].text == " hello" * 6
    assert run.outputs["banned"].text == " hello world" * 3


def test_greedy_generation_avoids_a_banned_word_it_would_write(qwen_engine):
    """The random model's greedy output holds a word; banned, it never appears, and everything before it is as
    it was (the ban changes the logits of that token alone)."""
    tok = qwen_engine.tokenizer
    prompt = tok.encode("The capital of France is")
    qwen_engine.add_request("plain", prompt, greedy(16))
    plain = drain(qwen_engine).outputs["plain"].token_ids
    # the first generated token that its own text, as a bad word, bans
    k, word, banned = next(
        (k, word, {seq[0] for seq in ids})
        for k, t in enumerate(plain)
        if (word := tok.decode([t]).strip())
        and [t] in (ids := bad_words_token_ids([word], tok, qwen_engine.vocab_size))
    )
    qwen_engine.add_request("banned", prompt, greedy(16, bad_words=[word]))
    out = drain(qwen_engine).outputs["banned"].token_ids
    assert out[:k] == plain[:k] and out[k] != plain[k]
    assert not banned & set(out), (word, tok.decode(out))
