"""IncrementalDetokenizer on its own: deltas, partial UTF-8, stop strings, held-back text, the slow fallback."""

from __future__ import annotations

import pytest
from engine_helpers import byte_token_ids

from rose.engine.detokenizer import IncrementalDetokenizer, _SlowStream

PROMPT = "the queue worker"


class SlowTokenizer:
    """A tokenizer with no Rust backend (only `decode`), which sends the detokenizer down `_SlowStream`."""

    def __init__(self, fast) -> None:
        self._fast = fast

    def decode(self, ids, skip_special_tokens=True):
        return self._fast.decode(ids, skip_special_tokens=skip_special_tokens)


def feed(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    deltas = []
    for t in ids:
        deltas.append(detok.update(t))
        if detok.stop_reason is not None:
            break
    deltas.append(detok.finish())
    return deltas


@pytest.fixture(params=["fast", "slow"])
def tok(request, tokenizer):
    return tokenizer if request.param == "fast" else SlowTokenizer(tokenizer)


def make(tok, tokenizer, **kwargs) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(tok, tokenizer.encode(PROMPT), **kwargs)


def test_slow_tokenizer_takes_the_fallback_path(tokenizer):
    assert not isinstance(make(tokenizer, tokenizer)._stream, _SlowStream)
    assert isinstance(make(SlowTokenizer(tokenizer), tokenizer)._stream, _SlowStream)


@pytest.mark.parametrize(
    "text", [" hello world, bonjour merci.", " é à ü 中文 日本語 🌹 Ω!", "\nrose\n\n queue"]
)
def test_deltas_concatenate_to_the_decoded_text(tok, tokenizer, text):
    ids = tokenizer.encode(text)
    detok = make(tok, tokenizer)
    deltas = feed(detok, ids)
    assert "".join(deltas) == detok.text == tokenizer.decode(ids) == text
    assert detok.stop_reason is None


def test_partial_utf8_is_held_until_the_character_is_complete(tok, tokenizer):
    ids = tokenizer.encode(" a") + byte_token_ids(tokenizer, "🌹") + tokenizer.encode(" b")
    detok = make(tok, tokenizer)
    deltas = [detok.update(t) for t in ids]
    assert deltas[0] == " a"
    assert deltas[1:4] == ["", "", ""]  # first three bytes of a four-byte character
    assert deltas[4] == "🌹"
    assert "".join(deltas) + detok.finish() == " a🌹 b"


def test_incomplete_bytes_at_the_end_are_flushed_as_replacement_chars(tok, tokenizer):
    ids = tokenizer.encode(" the") + byte_token_ids(tokenizer, "中")[:2]
    detok = make(tok, tokenizer)
    deltas = [detok.update(t) for t in ids]
    assert deltas == [" the", "", ""]
    tail = detok.finish()
    assert tail and set(tail) == {"\ufffd"}
    assert "".join(deltas) + tail == detok.text == tokenizer.decode(ids)


def test_stop_string_inside_one_token_cuts_the_text(tok, tokenizer):
    ids = tokenizer.encode(" the queue worker reads")
    detok = make(tok, tokenizer, stop=["ueu"])
    deltas = feed(detok, ids)
    assert detok.stop_reason == "ueu"
    assert detok.text == "".join(deltas) == " the q"


def test_stop_string_spanning_tokens(tok, tokenizer):
    ids = tokenizer.encode(" the queue worker reads")
    assert tokenizer.decode(ids[:2]) == " the queue"  # so "e w" spans the " queue" / " worker" boundary
    detok = make(tok, tokenizer, stop=["e w"])
    deltas = feed(detok, ids)
    assert detok.stop_reason == "e w"
    assert "".join(deltas) == detok.text == " the queu"


def test_include_stop_str_in_output(tok, tokenizer):
    ids = tokenizer.encode(" the queue worker reads")
    detok = make(tok, tokenizer, stop=["e w"], include_stop_str_in_output=True)
    deltas = feed(detok, ids)
    assert "".join(deltas) == detok.text == " the queue w"


def test_earliest_of_several_stop_strings_wins(tok, tokenizer):
    ids = tokenizer.encode(" the queue worker reads a batch")
    detok = make(tok, tokenizer, stop=["batch", "work", "ueue w"])
    deltas = feed(detok, ids)
    assert detok.stop_reason == "ueue w"
    assert "".join(deltas) == detok.text == " the q"


def test_earliest_stop_wins_when_both_complete_in_the_same_token(tok, tokenizer):
    ids = tokenizer.encode(" the queue")
    detok = make(tok, tokenizer, stop=["ue", "qu"])
    deltas = feed(detok, ids)
    assert detok.stop_reason == "qu"
    assert "".join(deltas) == " the "


def test_text_that_may_begin_a_stop_string_is_held_back(tok, tokenizer):
    ids = tokenizer.encode(" the queue worker")
    assert [tokenizer.decode([i]) for i in ids] == [" the", " queue", " worker"]
    detok = make(tok, tokenizer, stop=["queue!"])
    assert detok.update(ids[0]) == " the"
    assert detok.update(ids[1]) == " "  # "queue" could still become "queue!"
    assert detok.update(ids[2]) == "queue worker"
    assert detok.stop_reason is None
    assert detok.finish() == ""


def test_held_back_text_is_released_at_finish(tok, tokenizer):
    ids = tokenizer.encode(" the queue")
    detok = make(tok, tokenizer, stop=["queue worker"])
    deltas = [detok.update(t) for t in ids]
    assert deltas == [" the", " "]
    assert detok.emitted_text == " the "
    assert detok.finish() == "queue"
    assert detok.text == " the queue"
    assert detok.stop_reason is None


def test_stop_string_completed_by_later_token_after_holding_back(tok, tokenizer):
    ids = tokenizer.encode(" the queue worker")
    detok = make(tok, tokenizer, stop=["queue wor"])
    deltas = feed(detok, ids)
    assert deltas[:2] == [" the", " "]
    assert detok.stop_reason == "queue wor"
    assert "".join(deltas) == detok.text == " the "


def test_check_stop_false_defers_stop_strings(tok, tokenizer):
    ids = tokenizer.encode(" the queue worker reads")
    detok = make(tok, tokenizer, stop=["queue"])
    assert detok.update(ids[0], check_stop=False) == " the"
    detok.update(ids[1], check_stop=False)  # "queue" appears while stop strings are not checked yet
    assert detok.stop_reason is None
    rest = [detok.update(t) for t in ids[2:]] + [detok.finish()]
    assert detok.stop_reason is None
    assert detok.text == " the queue worker reads"
    assert detok.emitted_text == detok.text
    assert rest[-1] == "" or "queue" not in rest[-1]


def test_decode_false_skips_the_token_text(tok, tokenizer):
    ids = tokenizer.encode(" the queue")
    detok = make(tok, tokenizer)
    assert detok.update(ids[0]) == " the"
    assert detok.update(ids[1], decode=False) == ""
    assert detok.finish() == ""
    assert detok.text == " the"


def test_special_tokens_are_skipped_or_kept(tokenizer):
    ids = tokenizer.encode(" the") + [0] + tokenizer.encode(" queue")
    skip = make(tokenizer, tokenizer, skip_special_tokens=True)
    keep = make(tokenizer, tokenizer, skip_special_tokens=False)
    assert "".join(feed(skip, ids)) == " the queue"
    assert "".join(feed(keep, ids)) == " the<|endoftext|> queue"


def test_first_token_spacing_matches_a_full_decode(tok, tokenizer):
    """The prompt tail is decoder context: the first generated token keeps its leading space."""
    prompt = tokenizer.encode("hello")
    ids = tokenizer.encode(" world merci")
    detok = IncrementalDetokenizer(tok, prompt)
    assert "".join(feed(detok, ids)) == " world merci"


def test_multibyte_stop_string_split_across_byte_tokens(tok, tokenizer):
    ids = tokenizer.encode(" the") + byte_token_ids(tokenizer, "中🌹") + tokenizer.encode(" queue")
    detok = make(tok, tokenizer, stop=["🌹 q"])
    deltas = feed(detok, ids)
    assert detok.stop_reason == "🌹 q"
    assert "".join(deltas) == detok.text == " the中"
    assert all("\ufffd" not in d for d in deltas)


def test_prompt_ending_mid_character_does_not_leak_prompt_text(tok, tokenizer):
    """A token-id prompt cut inside a character (e.g. a continuation of a truncated generation).

    The first generated byte completes the prompt's last character. Whether that character is counted as
    output or not, the prompt's earlier text (" the") must not reappear in the generated text.
    """
    e_bytes = byte_token_ids(tokenizer, "é")
    prompt = tokenizer.encode(" the") + e_bytes[:1]
    generated = e_bytes[1:] + tokenizer.encode(" queue")
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.update(t) for t in generated] + [detok.finish()]
    assert "".join(deltas) == detok.text
    assert detok.text in ("é queue", " queue"), detok.text


def test_ids_past_the_tokenizer_decode_to_nothing(tok, tokenizer):
    """A model whose vocabulary is larger than its tokenizer (the `qwen2.5-0.5b` benchmark preset): an id the
    tokenizer lacks, in the prompt or generated, adds no text and breaks nothing around it."""
    past = len(tokenizer) + 100
    detok = IncrementalDetokenizer(tok, [*tokenizer.encode(PROMPT), past])
    ids = [*tokenizer.encode(" a"), past, *tokenizer.encode(" b")]
    deltas = feed(detok, ids)
    assert "".join(deltas) == detok.text == " a b"


@pytest.mark.parametrize(
    ("stop", "pieces", "min_tokens", "expected"),
    [
        # the example: vLLM V1 checks stop strings only in tokens after the first min_tokens
        (["Q"], [" a", "Q", " b", "Q", " a", "Q", " b"], 2, " aQ b"),
        (["Q"], [" a", "Q", " b", "Q", " a", "Q", " b"], 0, " a"),
        # a stop string inside the deferred text never counts later, even while it is held back as the start of
        # a longer one; one that starts in deferred text and ends in checked text does
        (["Qx", "Q"], [" a", "Q", " b", "Q", "x"], 2, " aQ b"),
        (["Q b"], [" a", "Q", " b", "Q", "x"], 2, " a"),
    ],
)
def test_stop_strings_are_checked_after_min_tokens(tok, tokenizer, stop, pieces, min_tokens, expected):
    ids = [tokenizer.encode(p)[0] for p in pieces]
    assert [tokenizer.decode([i]) for i in ids] == pieces
    detok = IncrementalDetokenizer(tok, tokenizer.encode("hello"), stop=stop)
    emitted = ""
    for k, token in enumerate(ids, 1):
        emitted += detok.update(token, check_stop=k > min_tokens)
        if detok.stop_reason is not None:
            break
    emitted += detok.finish()
    assert detok.text == emitted == expected
