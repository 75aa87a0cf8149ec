"""LoRA adapters from the producer's commands: `rose submit --lora NAME`, `rose batch` lines with the job field `lora`,
and OpenAI batch lines whose body.model names an adapter (`--lora-model NAME`), run by a real rose-worker started
with `--enable-lora --lora-modules`; each job's tokens are the offline engine's for the same adapter. `rose status`
shows the tokens generated per adapter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_helpers import checkout_env, wait_for
from rq.job import Job
from rq.serializers import JSONSerializer

from rose import LLM, SamplingParams
from rose.cli.openai_batch import CHAT_URL, COMPLETIONS_URL, OpenAIFormat
from rose.engine.lora import LoRARequest
from rose.harness.lora_adapters import make_adapter
from rose.harness.worker_process import WorkerProcess

pytestmark = pytest.mark.timeout(400)

QUEUE = "cli-lora"  # served by this module's worker only
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, LoRARequest]:
    root = tmp_path_factory.mktemp("cli-adapters")
    paths = {
        "sql": make_adapter(root / "sql", ["q_proj", "v_proj"], rank=4, seed=1),
        "chat": make_adapter(root / "chat", ["q_proj", "k_proj", "o_proj", "down_proj"], rank=8, seed=2),
    }
    return {name: LoRARequest(name, i, path) for i, (name, path) in enumerate(paths.items(), start=1)}


@pytest.fixture(scope="module")
def lora_worker(cli_redis, adapters, tmp_path_factory):
    args = ["--model", "tiny-llama", "--device", "cpu", "--max-model-len", "256", "--queue", QUEUE]
    args += ["--enable-lora", "--max-loras", "2", "--heartbeat-timeout", "10", "--lora-modules"]
    args += [f"{r.lora_name}={r.lora_path}" for r in adapters.values()]
    log = tmp_path_factory.mktemp("cli-lora-worker") / "worker.log"
    worker = WorkerProcess(cli_redis.url, "cli-lora", args, log_path=log, env=checkout_env())
    worker.wait_ready(180)
    yield worker
    worker.stop()


@pytest.fixture(scope="module")
def offline(adapters):
    """Greedy token ids of PROMPT (4 tokens) on the base model ("base") and each adapter, as LLM gives them."""
    llm = LLM("tiny-llama", device="cpu", max_model_len=256, enable_lora=True, max_loras=2)
    try:
        names = [None, *adapters]
        outs = llm.generate(
            [PROMPT] * len(names),
            SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
            lora_request=[adapters.get(n) for n in names],
        )
    finally:
        llm.engine.close()
    tokens = {name or "base": out.outputs[0].token_ids for name, out in zip(names, outs, strict=True)}
    assert len({tuple(t) for t in tokens.values()}) == 3  # the adapters change the output
    return tokens


def result(cli_redis, job_id: str) -> dict:
    return Job.fetch(job_id, connection=cli_redis.client(), serializer=JSONSerializer).return_value()


def test_submit_lora(rose, cli_redis, lora_worker, offline) -> None:
    args = ("submit", "--queue", QUEUE, "--max-tokens", "4", "--temperature", "0", "--ignore-eos", PROMPT)
    for name in ("sql", "chat", "base"):
        res = rose(*args, *(["--lora", name] if name != "base" else []))
        assert res.returncode == 0, res.stderr
        job_id = res.stdout.splitlines()[0]
        assert result(cli_redis, job_id)["token_ids"] == offline[name], name
    res = rose(*args, "--lora", "sequel")
    assert res.returncode == 1
    assert "unknown LoRA adapter 'sequel': this worker serves sql, chat" in res.stderr

    def per_adapter() -> dict:
        status = json.loads(rose("status", "--json", "--queue", QUEUE).stdout)
        (worker,) = status["workers"]
        return worker.get("lora_tokens") or {}

    # the tokens each adapter generated (other tests of this module's worker may add theirs)
    wait_for(lambda: min(per_adapter().get(n, 0) for n in ("sql", "chat")) >= 4, 15, "heartbeat")
    table = rose("status", "--queue", QUEUE).stdout
    assert "LoRA adapters" in table and "sql" in table


def write_lines(path: Path, lines: list[dict]) -> None:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_batch_lines_run_with_their_adapter(rose, cli_redis, tmp_path, lora_worker, offline) -> None:
    plain, out = tmp_path / "plain.jsonl", tmp_path / "plain-out.jsonl"
    write_lines(
        plain,
        [{"id": "sql", "prompt": PROMPT, "lora": "sql"}, {"id": "base", "prompt": PROMPT}]
        + [{"id": "chat", "prompt": PROMPT, "lora": "chat"}, {"id": "bad", "prompt": PROMPT, "lora": "x"}],
    )
    flags = ("--queue", QUEUE, "--max-tokens", "4", "--temperature", "0", "--ignore-eos", "--no-progress")
    res = rose("batch", str(plain), "-o", str(out), *flags)
    assert res.returncode == 1, res.stderr  # the unknown adapter's line failed
    lines = {line["id"]: line for line in map(json.loads, out.read_text().splitlines())}
    assert "unknown LoRA adapter 'x'" in lines.pop("bad")["error"]
    assert {i: line["job_id"] and line["usage"]["completion_tokens"] for i, line in lines.items()} == {
        "sql": 4,
        "base": 4,
        "chat": 4,
    }
    for name in ("sql", "base", "chat"):
        assert result(cli_redis, lines[name]["job_id"])["token_ids"] == offline[name], name

    def body(model: str, custom_id: str, url: str = COMPLETIONS_URL) -> dict:
        return {
            "custom_id": custom_id,
            "method": "POST",
            "url": url,
            "body": {"model": model, "prompt": PROMPT},
        }

    oai, oai_out = tmp_path / "openai.jsonl", tmp_path / "openai-out.jsonl"
    write_lines(oai, [body("sql", "s"), body("chat", "c"), body("tiny-llama", "b")])
    res = rose("batch", str(oai), "-o", str(oai_out), *flags, "--lora-model", "sql,chat")
    assert res.returncode == 0, res.stderr
    done = {line["custom_id"]: line["response"] for line in map(json.loads, oai_out.read_text().splitlines())}
    assert {k: v["body"]["model"] for k, v in done.items()} == {"s": "sql", "c": "chat", "b": "tiny-llama"}
    texts = {k: v["body"]["choices"][0]["text"] for k, v in done.items()}
    assert texts["b"] == lines["base"]["text"] and texts["s"] == lines["sql"]["text"]
    assert texts["c"] == lines["chat"]["text"] and len(set(texts.values())) == 3

    res = rose("batch", str(plain), "-o", str(tmp_path / "x.jsonl"), "--lora-model", "sql")
    assert res.returncode == 2 and "--lora-model reads body.model" in res.stderr


def test_openai_lines_carry_lora_only_for_the_named_models() -> None:
    def parse(fmt: OpenAIFormat, model: str, url: str = CHAT_URL):
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
        if url == COMPLETIONS_URL:
            body = {"model": model, "prompt": "hi"}
        line = {"custom_id": "x", "method": "POST", "url": url, "body": body}
        return fmt.parse(1, json.dumps(line), {})

    fmt = OpenAIFormat({"sql": "q-sql"}, frozenset({"sql", "chat"}))
    entry = parse(fmt, "sql")
    assert entry.request["lora"] == "sql" and entry.queue == "q-sql"
    assert parse(fmt, "chat", COMPLETIONS_URL).request["lora"] == "chat"
    assert "lora" not in parse(fmt, "qwen").request  # the base model
    assert "lora" not in parse(OpenAIFormat(), "sql").request  # without --lora-model: body.model only echoed


GENERATE = (
    "generate",
    "--device",
    "cpu",
    "--max-model-len",
    "256",
    "--temperature",
    "0",
    "--max-tokens",
    "4",
)


def test_generate_with_an_adapter(rose, tmp_path, capsys) -> None:
    """`rose generate --lora NAME=PATH`: the offline LLM's output with that adapter. Its rank (32) is above the
    default max_lora_rank (16): the engine is sized by the adapter's adapter_config.json. The first run is the real
    command; the others go through the same `main` in this process (each subprocess costs seconds of imports)."""
    from rose.cli import main

    path = make_adapter(tmp_path / "wide", ["q_proj", "v_proj", "down_proj"], rank=32, seed=3)
    request = LoRARequest("wide", 1, path)
    llm = LLM("tiny-llama", device="cpu", max_model_len=256, enable_lora=True, max_lora_rank=32)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    try:
        (wide, base) = (llm.generate(PROMPT, params, lora_request=r)[0].outputs[0] for r in (request, None))
        messages = [{"role": "user", "content": PROMPT}]
        reply = llm.chat(messages, params, lora_request=request)[0].outputs[0].text
    finally:
        llm.engine.close()
    assert wide.token_ids != base.token_ids

    res = rose(*GENERATE, "--ignore-eos", "--lora", f"wide={path}", PROMPT)
    assert res.returncode == 0, res.stderr
    assert res.stdout == f"[0] {PROMPT!r} -> length, 4 tokens\n{wide.text}\n"
    capsys.readouterr()
    # --stream and --chat take it too, and so does the JSON form of --lora-modules
    assert main([*GENERATE, "--ignore-eos", "--stream", "--lora", f"wide={path}", PROMPT]) == 0
    assert capsys.readouterr().out == PROMPT + wide.text + "\n"
    as_json = json.dumps({"name": "wide", "path": path, "base_model_name": "tiny-llama"})
    assert main([*GENERATE, "--ignore-eos", "--chat", "--stream", "--lora", as_json, PROMPT]) == 0
    assert capsys.readouterr().out == reply + "\n"

    # an adapter above an explicit --max-lora-rank is refused before any output, naming it
    assert main([*GENERATE, "--lora", f"wide={path}", "--max-lora-rank", "16", PROMPT]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert f"rose generate: error: LoRA adapter 'wide' ({path}): rank 32 is above max_lora_rank 16" in err


def test_generate_lora_flags_are_checked_before_the_model_loads(capsys) -> None:
    from rose.cli import main

    assert main([*GENERATE, "--lora", "wide", PROMPT]) == 2
    assert "rose generate: error: --lora: want NAME=PATH or a JSON object" in capsys.readouterr().err
    assert main([*GENERATE, "--max-lora-rank", "8", PROMPT]) == 2
    assert "rose generate: error: --max-lora-rank: needs --lora" in capsys.readouterr().err
