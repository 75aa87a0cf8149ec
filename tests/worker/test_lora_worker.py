"""LoRA adapters on the worker (issue 27): `--enable-lora --lora-modules NAME=PATH ...` and the job field `lora`.

In process (fake engine): each job reaches `add_request` with its adapter's LoRARequest (ids 1, 2, ... in the order
given), a job naming an adapter the worker does not serve fails alone, without retry, naming it and the served
ones; tokens are counted per adapter on /metrics, in the info hash and `rose status`. With the real rose-worker
process: a batch of plain RQ jobs mixing two adapters and the base model gives each job the tokens transformers'
`generate` gives on the PEFT model with its adapter (float32), as the offline engine does, and a bad adapter (too high
a rank, or one of modules the base model lacks) stops the worker at start with the reason.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from rq import Queue, Retry
from rq.job import Job
from rq.serializers import JSONSerializer
from test_metrics import scrape, value
from worker_helpers import FakeEngine, TinyWorker, enqueue, wait_for, wait_status

from rose import LLM, SamplingParams
from rose.cli.status import collect
from rose.engine.lora import LoRARequest
from rose.harness.lora_adapters import make_adapter, peft_greedy, tiny_phi3
from rose.jobs import keys

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "sql": make_adapter(root / "sql", ["q_proj", "v_proj"], rank=4, seed=1),
        "chat": make_adapter(root / "chat", ["gate_proj", "up_proj", "down_proj"], rank=8, seed=2),
    }


def failure(r, job) -> str:
    return Job.fetch(job.id, connection=r, serializer=JSONSerializer).latest_result().exc_string


# ---- in process: routing, failures, counters ------------------------------------------------------------------------


def test_each_job_reaches_the_engine_with_its_adapter_and_unknown_ones_fail_alone(run_worker, r, q):
    engine = FakeEngine(max_num_seqs=8)
    # the engine's counters, by adapter (rose.engine.lora.LoRAManager.get_stats)
    engine.get_stats = lambda: {
        "lora_loads": 3,
        "lora_loads/sql": 2,
        "lora_loads/chat": 1,
        "lora_evictions/sql": 1,
    }
    modules = {"sql": "/adapters/sql", "chat": "/adapters/chat"}
    wt = run_worker(
        engine=engine, enable_lora=True, lora_modules=modules, metrics_port=0, heartbeat_timeout=10
    )
    sql, chat, base = (enqueue(q, prompt="a b c", lora=lora) for lora in ("sql", "chat", None))
    sql2 = enqueue(q, prompt="d e", lora="sql", max_tokens=5)
    unknown = enqueue(q, prompt="a b c", lora="nope", retry=Retry(max=3))
    for job in (sql, chat, base, sql2):
        wait_status(r, job, "finished")
    wait_status(r, unknown, "failed")  # at once, for good: Retry does not apply
    assert "unknown LoRA adapter 'nope': this worker serves sql, chat" in failure(r, unknown)
    assert engine.loras == {
        sql.id: LoRARequest("sql", 1, "/adapters/sql"),
        chat.id: LoRARequest("chat", 2, "/adapters/chat"),
        base.id: None,
        sql2.id: LoRARequest("sql", 1, "/adapters/sql"),
    }

    samples = scrape(wt.worker.metrics_server.port)
    assert value(samples, "rose_lora_generation_tokens_total", adapter="sql") == 3 + 5
    assert value(samples, "rose_lora_generation_tokens_total", adapter="chat") == 3
    assert value(samples, "rose_generation_tokens_total") == 3 * 3 + 5  # the base model's too
    wait_for(
        lambda: value(scrape(wt.worker.metrics_server.port), "rose_lora_loads_total", adapter="sql") == 2,
        10,
        what="the engine's LoRA counters read",
    )
    samples = scrape(wt.worker.metrics_server.port)
    assert value(samples, "rose_lora_loads_total", adapter="chat") == 1
    assert value(samples, "rose_lora_evictions_total", adapter="sql") == 1
    assert ("rose_lora_evictions_total", (("adapter", "chat"),)) in samples  # 0, shown

    def status():
        (worker,) = collect(r)["workers"]
        return worker

    wait_for(lambda: status().get("lora_tokens") == {"sql": 8, "chat": 3}, 10, what="heartbeat")
    assert status()["lora_loads"] == {"sql": 2, "chat": 1}
    assert status()["lora_evictions"] == {"sql": 1, "chat": 0}


def test_a_job_with_lora_on_a_worker_without_enable_lora_fails_clearly(run_worker, r, q):
    wt = run_worker(heartbeat_timeout=10)
    job = enqueue(q, prompt="a b c", lora="sql", retry=Retry(max=3))
    base = enqueue(q, prompt="a b c")
    wait_status(r, base, "finished")
    wait_status(r, job, "failed")
    message = failure(r, job)
    assert "asks for LoRA adapter 'sql', but this worker serves no adapters" in message
    assert "--enable-lora --lora-modules sql=PATH" in message
    wait_for(lambda: r.exists(keys.worker_info_key(wt.worker.name)), 10, what="heartbeat")
    assert not any(k.startswith(b"lora_") for k in r.hkeys(keys.worker_info_key(wt.worker.name)))


def test_the_lora_field_is_validated_where_the_job_is_made(r):
    from rose.jobs.client import Client, InvalidRequest

    client = Client(r, queue="rose")
    with pytest.raises(InvalidRequest, match="'lora' is empty"):
        client.submit("hi", lora=" ")
    with pytest.raises(InvalidRequest, match="lora: Input should be a valid string"):
        client.submit("hi", lora=3)
    job = client.submit("hi", lora="sql", max_tokens=2)
    assert job.rq_job.kwargs == {"prompt": "hi", "lora": "sql", "max_tokens": 2}  # a plain RQ job's kwargs


# ---- the real worker -------------------------------------------------------------------------------------------


@pytest.fixture
def lora_worker(new_redis_server, tmp_path, adapters, unused_port):
    worker = TinyWorker(
        new_redis_server,
        tmp_path / "worker.log",
        "lora-e2e",
        "--max-model-len",
        "256",
        "--enable-lora",
        "--lora-modules",
        f"sql={adapters['sql']}",
        f"chat={adapters['chat']}",
        "--max-loras",
        "1",  # the two adapters take turns in one slot
        "--metrics-port",
        str(unused_port),
        "--heartbeat-timeout",
        "10",  # the engine's counters are read at each heartbeat too (every 10 / 6 s)
    ).wait_ready()
    worker.metrics_port = unused_port
    yield worker
    worker.kill()


def test_a_mixed_batch_gives_each_job_peft_and_the_offline_engines_tokens_for_its_adapter(
    new_redis_server, lora_worker, adapters
):
    r = new_redis_server.client()
    q = Queue("rose", connection=r, serializer=JSONSerializer)
    prompts = ["The capital of France is", "SELECT name FROM"]
    loras = [None, "sql", "chat"]
    fields = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    jobs = [
        (prompt, lora, enqueue(q, prompt=prompt, lora=lora, **fields)) for prompt in prompts for lora in loras
    ]
    unknown = enqueue(q, prompt=prompts[0], lora="sqll", **fields)
    for _, _, job in jobs:
        wait_status(r, job, "finished", timeout=150)
    wait_status(r, unknown, "failed", timeout=60)
    assert "unknown LoRA adapter 'sqll': this worker serves sql, chat" in failure(r, unknown)

    requests = {name: LoRARequest(name, i, path) for i, (name, path) in enumerate(adapters.items(), 1)}
    llm = LLM("tiny-llama", device="cpu", max_model_len=256, enable_lora=True, max_loras=2)
    try:
        offline = llm.generate(
            [prompt for prompt, _, _ in jobs],
            SamplingParams(**fields),
            lora_request=[requests.get(lora) for _, lora, _ in jobs],
        )
    finally:
        llm.engine.close()
    got = {}
    for (prompt, lora, job), want in zip(jobs, offline, strict=True):
        result = Job.fetch(job.id, connection=r, serializer=JSONSerializer).return_value()
        assert result["token_ids"] == want.outputs[0].token_ids, (prompt, lora)
        # the issue's reference: transformers' generate on the PEFT model with the job's adapter (float32)
        path = None if lora is None else adapters[lora]
        assert result["token_ids"] == peft_greedy(path, want.prompt_token_ids, fields["max_tokens"]), (
            prompt,
            lora,
        )
        got[prompt, lora] = tuple(result["token_ids"])
    for prompt in prompts:  # the adapters changed the outputs: the test tells them apart
        assert len({got[prompt, lora] for lora in loras}) == 3, prompt

    samples = scrape(lora_worker.metrics_port)
    for name in ("sql", "chat"):
        assert value(samples, "rose_lora_generation_tokens_total", adapter=name) == 2 * 6

    def evictions():
        samples = scrape(lora_worker.metrics_port)
        return sum(value(samples, "rose_lora_evictions_total", adapter=name) for name in ("sql", "chat"))

    wait_for(lambda: evictions() >= 1, 10, what="the engine's LoRA counters read")
    samples = scrape(lora_worker.metrics_port)
    for name in ("sql", "chat"):  # they took turns in one slot
        assert value(samples, "rose_lora_loads_total", adapter=name) >= 1


def test_a_bad_adapter_stops_the_worker_with_the_reason(redis_server, tmp_path, adapters):
    proc = subprocess.run(
        [sys.executable, "-m", "rose.worker.cli", "--redis-url", redis_server.url, "--name", "lora-refusal"]
        + ["--model", "tiny-llama", "--device", "cpu", "--enable-lora", "--max-lora-rank", "4"]
        + ["--lora-modules", f"sql={adapters['sql']}", f"chat={adapters['chat']}"],
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode == 2, proc.stderr
    assert (
        f"rose-worker: cannot serve LoRA adapter 'chat' ({adapters['chat']}): rank 8 is above max_lora_rank 4"
        in proc.stderr
    )
    assert "Traceback" not in proc.stderr + proc.stdout
    missing = subprocess.run(
        [sys.executable, "-m", "rose.worker.cli", "--redis-url", redis_server.url, "--name", "lora-refusal"]
        + ["--lora-modules", f"sql={adapters['sql']}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 2 and "lora_modules needs enable_lora" in missing.stderr


def test_an_adapter_of_modules_the_model_lacks_stops_the_worker_naming_the_module(redis_server, tmp_path):
    phi3 = make_adapter(tmp_path / "phi3", ["o_proj", "qkv_proj"], rank=4, seed=0, model=tiny_phi3())
    proc = subprocess.run(
        [sys.executable, "-m", "rose.worker.cli", "--redis-url", redis_server.url, "--name", "lora-refusal"]
        + ["--model", "tiny-llama", "--device", "cpu", "--enable-lora", "--lora-modules", f"phi3={phi3}"]
        + ["--burst"],  # were the adapter taken, the worker would exit at once, not wait for jobs
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode == 2, proc.stderr
    assert (
        f"rose-worker: cannot serve LoRA adapter 'phi3' ({phi3}): the base model has no linear layer "
        "'model.layers.0.self_attn.qkv_proj'" in proc.stderr
    )
    assert "Traceback" not in proc.stderr + proc.stdout
