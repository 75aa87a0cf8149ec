"""`rose generate` driven as a user would: a real subprocess for its output and its flag checks; its other flags
through the same `rose.cli.main` in this process (a subprocess costs seconds of torch and transformers imports)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rose import LLM, SamplingParams


def rose(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rose", *args], capture_output=True, text=True, timeout=300, check=False
    )


def in_process(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    from rose.cli import main

    capsys.readouterr()
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def expected() -> str:
    llm = LLM("tiny-llama", device="cpu", max_num_seqs=2)
    return llm.generate("Hello", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].text


def test_generate_prints_the_engine_output(expected: str) -> None:
    res = rose(
        "generate", "--device", "cpu", "--temperature", "0", "--max-tokens", "8", "--ignore-eos", "Hello"
    )
    assert res.returncode == 0, res.stderr
    assert "'Hello' -> length, 8 tokens" in res.stdout
    assert expected in res.stdout


def test_generate_stream_writes_prompt_then_text(expected: str, capsys) -> None:
    greedy = "--device cpu --stream --temperature 0 --max-tokens 8 --ignore-eos".split()
    rc, out, err = in_process(capsys, "generate", *greedy, "Hello")
    assert rc == 0, err
    assert out == "Hello" + expected + "\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--top-p", "2"], "top_p must be in (0, 1]"),
        (["--system", "x"], "--system: needs --chat"),
        (["--stream", "--n", "2"], "--n > 1 needs the printing of whole choices"),
        (["--max-lora-rank", "8"], "--max-lora-rank: needs --lora"),
        (["--lora", "wide"], "--lora: want NAME=PATH"),
    ],
)
def test_a_bad_flag_fails_before_torch_and_transformers_load(args: list[str], message: str) -> None:
    """A user's typo is answered at once, not after the seconds torch and transformers take to import."""
    code = (
        "import sys; from rose.cli import main; rc = main(sys.argv[1:]); "
        "print(rc, 'torch' in sys.modules, 'transformers' in sys.modules)"
    )
    res = subprocess.run(
        [sys.executable, "-c", code, "generate", *args, "Hello"], capture_output=True, text=True, timeout=300
    )
    assert res.stdout.split() == ["2", "False", "False"], res.stderr
    assert message in res.stderr


def test_generate_takes_logit_bias_as_json(capsys) -> None:
    llm = LLM("tiny-llama", device="cpu", max_num_seqs=2)
    forced = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logit_bias={"42": 100})
    out = llm.generate("Hello", forced)[0]
    assert out.token_ids == [42] * 4
    greedy = "generate --device cpu --temperature 0 --max-tokens 4 --ignore-eos".split()
    rc, stdout, err = in_process(capsys, *greedy, "--logit-bias", '{"42": 100}', "Hello")
    assert rc == 0, err
    assert "'Hello' -> length, 4 tokens\n" + out.text + "\n" in stdout


def test_generate_takes_repeated_bad_words(capsys) -> None:
    llm = LLM("tiny-llama", device="cpu", max_num_seqs=2)
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    before = llm.generate("hello world", plain)[0]
    assert before.text.startswith("vacvac")  # this model's greedy text, whose 'vac' token the ban removes
    out = llm.generate("hello world", SamplingParams(**{**plain.to_dict(), "bad_words": ["vac", "agefa"]}))[0]
    assert before.token_ids[0] not in out.token_ids and out.text != before.text
    greedy = "generate --device cpu --temperature 0 --max-tokens 8 --ignore-eos".split()
    rc, stdout, err = in_process(capsys, *greedy, "--bad-words", "vac", "--bad-words", "agefa", "hello world")
    assert rc == 0, err
    assert "'hello world' -> length, 8 tokens\n" + out.text + "\n" in stdout
