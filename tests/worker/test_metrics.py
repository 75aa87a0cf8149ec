"""Prometheus metrics and /health: a scrape whose counters match the jobs run (fake engine in-process, and the
real rose-worker process)."""

from __future__ import annotations

import json
import signal
import subprocess
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families
from rq import Queue
from rq.job import Job
from rq.serializers import JSONSerializer
from worker_helpers import FakeEngine, stream_events, wait_for

from rose.jobs import keys
from rose.worker import metrics as worker_metrics
from rose.worker.metrics import HealthServer, WorkerMetrics

pytestmark = pytest.mark.timeout(120)


def enqueue(q, **kwargs):
    return q.enqueue("rose.jobs.generate", kwargs=kwargs)


def http_get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels without model_name): value} from GET /metrics."""
    status, body = http_get(f"http://127.0.0.1:{port}/metrics")
    assert status == 200
    samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            samples[(s.name, labels)] = s.value
    return samples


def value(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def streamed_tokens(r, job_id: str) -> int:
    """Tokens in the job's token events (one event may carry several: --stream-interval)."""
    return sum(len(e["token_ids"]) for e in stream_events(r, job_id) if e["type"] == "token")


def test_scrape_counters_match_the_jobs_run(run_worker, r, q):
    engine = FakeEngine(max_num_seqs=4, step_delay=0.01)
    lengths = [enqueue(q, prompt=f"a b c {i}", max_tokens=3 + i) for i in range(3)]  # 4 prompt tokens each
    invalid = enqueue(q, prompt="x", max_tokens=3, temprature=1.0)
    long = enqueue(q, prompt="x", max_tokens=60)
    wt = run_worker(engine=engine, metrics_port=0, heartbeat_timeout=10)
    port = wt.worker.metrics_server.port

    status, body = http_get(f"http://127.0.0.1:{port}/health")
    assert status == 200 and json.loads(body)["status"] == "ok"

    for j in lengths:
        wait_for(lambda j=j: r.hget(j.key, "status") == b"finished", 30, what="finished")
    wait_for(lambda: r.hget(invalid.key, "status") == b"failed", 30, what="failed")
    wait_for(lambda: streamed_tokens(r, long.id) >= 2, 30, what="long job streaming")
    Job.fetch(long.id, connection=r, serializer=JSONSerializer).cancel()
    wait_for(lambda: stream_events(r, long.id)[-1]["type"] == "canceled", 30, what="canceled event")

    # the running gauge catches up at the next heartbeat (no engine step after the cancel)
    def settled():
        samples = scrape(port)
        return samples if value(samples, "rose_num_requests_running") == 0 else None

    samples = wait_for(settled, 30, interval=0.2, what="gauges back to 0")
    generated = sum(streamed_tokens(r, j.id) for j in [*lengths, long])
    assert generated == 3 + 4 + 5 + streamed_tokens(r, long.id)
    assert value(samples, "rose_request_success_total", finished_reason="length") == 3
    assert value(samples, "rose_request_success_total", finished_reason="stop") == 0
    assert value(samples, "rose_request_failure_total") == 1
    assert value(samples, "rose_request_canceled_total") == 1
    assert value(samples, "rose_request_requeued_total") == 0
    assert value(samples, "rose_generation_tokens_total") == generated
    assert value(samples, "rose_prompt_tokens_total") == 3 * 4
    assert value(samples, "rose_request_queue_time_seconds_count") == 5  # every job taken
    assert value(samples, "rose_time_to_first_token_seconds_count") == 4  # every job that got a token
    assert value(samples, "rose_e2e_request_latency_seconds_count") == 3
    assert value(samples, "rose_inter_token_latency_seconds_count") == generated - 4
    assert value(samples, "rose_engine_step_time_seconds_count") == engine.steps
    assert value(samples, "rose_num_requests_waiting") == 0
    assert value(samples, "rose_kv_cache_usage_perc") == 0
    info = [k for k in samples if k[0] == "rose_worker_info"]
    assert len(info) == 1 and ("name", wt.worker.name) in info[0][1] and ("queues", "rose") in info[0][1]

    # the info hash read by `rose status`
    fields = {k.decode(): v.decode() for k, v in r.hgetall(keys.worker_info_key(wt.worker.name)).items()}
    assert fields["queues"] == "rose" and fields["model"] == "fake" and fields["version"]
    assert float(fields["tokens_per_s"]) >= 0 and float(fields["started_at"]) > 0
    assert {"dtype", "running_jobs", "max_num_seqs", "updated_at"} <= set(fields)

    wt.stop()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)


def test_requeued_on_shutdown_is_counted(run_worker, r, q):
    engine = FakeEngine(max_num_seqs=2, step_delay=0.02)
    jobs = [enqueue(q, prompt="x", max_tokens=60) for _ in range(2)]
    wt = run_worker(engine=engine, drain_timeout=60)
    wait_for(lambda: all(streamed_tokens(r, j.id) >= 1 for j in jobs), 30, what="both generating")
    wt.stop(force=True)
    reg = wt.worker.metrics.registry
    assert reg.get_sample_value("rose_request_requeued_total", {"model_name": "fake"}) == 2
    assert wt.worker.metrics_server is None  # no --metrics-port: no server


def test_health_is_503_when_the_loop_stalls_or_redis_is_down():
    class Stub:
        name, running, draining, stopped, redis_ok = "w", {}, False, False, True
        loop_beat = worker_metrics.time.monotonic()

        class settings:
            health_timeout = 30.0

    stub = Stub()
    assert worker_metrics.health(stub)[0]
    stub.redis_ok = False
    ok, body = worker_metrics.health(stub)
    assert not ok and body["redis_ok"] is False
    stub.redis_ok, stub.loop_beat = True, stub.loop_beat - 60
    assert not worker_metrics.health(stub)[0]

    m = WorkerMetrics(name="w", model="m", device="cpu", dtype="float32", queues=["q"], version="0")
    body = {"status": "unhealthy", "loop_alive": True}
    server = HealthServer(m.registry, lambda: (False, body), "127.0.0.1", 0).start()
    try:
        status, got = http_get(f"http://127.0.0.1:{server.port}/health")
        assert status == 503 and json.loads(got) == body
        assert http_get(f"http://127.0.0.1:{server.port}/health/live")[0] == 200  # Redis down, loop alive
        assert http_get(f"http://127.0.0.1:{server.port}/metrics")[0] == 200
    finally:
        server.close()


def test_prefix_cache_and_preemption_counters_follow_engine_stats():
    class Engine(FakeEngine):
        num_running, num_waiting, kv_blocks_used, kv_blocks_total = 3, 1, 3, 4
        stats = {"prefix_cache_query_tokens": 100, "prefix_cache_hit_tokens": 40, "num_preemptions": 2}

        def get_stats(self):
            return dict(self.stats)

    m = WorkerMetrics(name="w", model="m", device="cpu", dtype="float32", queues=["q"], version="0")
    engine = Engine()
    m.on_step(engine, 0.01, 3, 0, 1000.0)
    engine.stats = {"prefix_cache_query_tokens": 150, "prefix_cache_hit_tokens": 90, "num_preemptions": 5}
    m.on_step(engine, 0.01, 3, 3, 1000.5)  # within a second: stats not read again
    m.on_step(engine, 0.01, 3, 3, 1001.5)
    get = m.registry.get_sample_value
    assert get("rose_prefix_cache_queries_total", {"model_name": "m"}) == 150
    assert get("rose_prefix_cache_hits_total", {"model_name": "m"}) == 90
    assert get("rose_num_preemptions_total", {"model_name": "m"}) == 5
    assert get("rose_kv_cache_usage_perc", {"model_name": "m"}) == 0.75
    assert get("rose_num_requests_waiting", {"model_name": "m"}) == 1
    assert get("rose_generation_tokens_total", {"model_name": "m"}) == 9
    assert get("rose_inter_token_latency_seconds_count", {"model_name": "m"}) == 6
    assert get("rose_inter_token_latency_seconds_bucket", {"model_name": "m", "le": "0.5"}) == 3
    assert get("rose_inter_token_latency_seconds_sum", {"model_name": "m"}) == pytest.approx(4.5)
    # two workers in one process: registries of their own
    WorkerMetrics(name="w2", model="m", device="cpu", dtype="float32", queues=["q"], version="0")


@pytest.mark.timeout(400)
def test_real_worker_metrics_endpoint(new_redis_server, tmp_path, unused_port):
    from test_e2e import e2e_worker

    server = new_redis_server
    r = server.client()
    q = Queue("rose", connection=r, serializer=JSONSerializer)
    done = [enqueue(q, prompt=f"hi {i}", max_tokens=4, ignore_eos=True) for i in range(2)]
    invalid = enqueue(q, prompt="x", max_tokens=3, temprature=1.0)
    long = enqueue(q, prompt="cancel me", max_tokens=None, ignore_eos=True)
    worker = e2e_worker(
        server,
        tmp_path / "worker.log",
        "--metrics-port",
        str(unused_port),
        "--log-format",
        "json",
        "--max-num-seqs",
        "4",
    ).wait_ready()
    try:
        for j in done:
            wait_for(lambda j=j: r.hget(j.key, "status") == b"finished", 150, interval=0.1, what="finished")
        wait_for(lambda: r.hget(invalid.key, "status") == b"failed", 60, what="failed")
        wait_for(lambda: streamed_tokens(r, long.id) >= 2, 60, what="long job streaming")
        Job.fetch(long.id, connection=r, serializer=JSONSerializer).cancel()
        wait_for(lambda: stream_events(r, long.id)[-1]["type"] == "canceled", 60, what="canceled event")

        status, body = http_get(f"http://127.0.0.1:{unused_port}/health")
        assert status == 200 and json.loads(body)["redis_ok"] is True
        samples = scrape(unused_port)
        assert value(samples, "rose_request_success_total", finished_reason="length") == 2
        assert value(samples, "rose_request_failure_total") == 1
        assert value(samples, "rose_request_canceled_total") == 1
        assert value(samples, "rose_generation_tokens_total") == 8 + streamed_tokens(r, long.id)
        assert value(samples, "rose_e2e_request_latency_seconds_count") == 2
        assert value(samples, "rose_engine_step_time_seconds_count") > 0
        info = next(k for k in samples if k[0] == "rose_worker_info")
        assert ("model", "tiny-llama") in info[1] and ("dtype", "float32") in info[1]

        worker.proc.send_signal(signal.SIGTERM)
        assert worker.wait(60) == 0
    finally:
        worker.kill()
    lines = [json.loads(line) for line in worker.output().splitlines() if line.startswith("{")]
    events = {(e.get("job_id"), e.get("event")) for e in lines}
    for j in done:
        assert {(j.id, "taken"), (j.id, "first_token"), (j.id, "finished")} <= events
    assert (invalid.id, "failed") in events and (long.id, "canceled") in events
    finished = next(e for e in lines if e.get("event") == "finished")
    assert finished["completion_tokens"] == 4 and finished["level"] == "INFO" and finished["queue"] == "rose"


def test_port_in_use_is_one_clear_line(new_redis_server):
    import socket

    from rose.harness.worker_process import worker_command as worker_cmd

    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = subprocess.run(
            [
                *worker_cmd(),
                "--redis-url",
                new_redis_server.url,
                "--device",
                "cpu",
                "--metrics-port",
                str(port),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert proc.returncode == 2, proc.stderr
    assert f"cannot serve metrics on port {port}" in proc.stderr
