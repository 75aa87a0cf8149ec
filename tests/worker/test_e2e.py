"""End to end: the real `rose-worker` process (tiny-llama preset on CPU), driven from outside as a user would:
plain RQ producers, pub/sub subscribers, rq commands, signals, kill -9."""

from __future__ import annotations

import json
import os
import signal
import socketserver
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from rq import Queue, Worker
from rq.job import Job
from rq.registry import StartedJobRegistry
from rq.serializers import JSONSerializer
from worker_helpers import TinyWorker, stream_events

from rose.harness import worker_process
from rose.harness.worker_process import wait_for
from rose.jobs import keys
from rose.jobs.client import Client, JobCanceled, JobFailed

# Generous bounds: the machine's speed varies a lot (2 shared cores), and long jobs are sized by the context
# (max_tokens=None) so that they cannot finish early on a fast machine.
pytestmark = pytest.mark.timeout(400)


def e2e_worker(server, log_path, *args: str, name: str | None = None) -> TinyWorker:
    """The real rose-worker on tiny-llama, logging to `log_path`."""
    name = name or f"e2e-{os.getpid()}-{time.monotonic_ns()}"
    return TinyWorker(server, log_path, name, "--max-model-len", "512", *args)


@pytest.fixture
def server(new_redis_server):
    """A Redis of its own: these tests keep a worker process connected across steps, no flushing under it."""
    return new_redis_server


@pytest.fixture
def spawn(server, tmp_path):
    procs: list[TinyWorker] = []

    def start(*args: str, name: str | None = None) -> TinyWorker:
        p = e2e_worker(server, tmp_path / f"worker{len(procs)}.log", *args, name=name)
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.kill()


def enqueue(q: Queue, **kwargs):
    rq_opts = {k: kwargs.pop(k) for k in list(kwargs) if k in ("job_timeout", "result_ttl")}
    return q.enqueue("rose.jobs.generate", kwargs=kwargs, **rq_opts)


def finished(r, job_id: str, timeout: float = 150) -> dict:
    wait_for(
        lambda: r.hget(Job.key_for(job_id), "status") in (b"finished", b"failed"),
        timeout,
        interval=0.1,
        what=f"job {job_id} done",
    )
    job = Job.fetch(job_id, connection=r, serializer=JSONSerializer)
    assert job.get_status() == "finished", job.latest_result().exc_string
    return job.return_value()


def current_attempt_text(r, job_id: str) -> str:
    wait_for(lambda: stream_events(r, job_id)[-1]["type"] == "done", 10, what="done event")
    events = stream_events(r, job_id)
    resets = [i for i, e in enumerate(events) if e["type"] == "reset"]
    current = events[resets[-1] + 1 :] if resets else events
    tokens = [e for e in current if e["type"] == "token"]
    assert [e["seq"] for e in current] == list(range(len(current)))
    return "".join(e["text"] for e in tokens)


class _Evil:
    """Unpickling this runs a shell command: proof that the worker never unpickles."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_producer_subscriber_bad_inputs_cancel_timeout(server, spawn, tmp_path):
    r = server.client()
    q = Queue("rose", connection=r, serializer=JSONSerializer)
    worker = spawn("--max-num-seqs", "8", "--max-model-len", "4096").wait_ready()

    # plain RQ producer + pub/sub subscriber, subscribed before the jobs are enqueued
    sub = r.pubsub()
    sub.psubscribe(keys.tokens_channel("*"))
    assert sub.get_message(timeout=5)["type"] == "psubscribe"
    jobs = [
        enqueue(q, prompt=f"hello {i}", max_tokens=6 + i, temperature=0.0, metadata={"i": i})
        for i in range(6)
    ]
    heard: dict[str, list[dict]] = {j.id: [] for j in jobs}
    stop = threading.Event()

    def listen():
        while not stop.is_set():
            msg = sub.get_message(timeout=0.2)
            if msg and msg["type"] == "pmessage":
                event = json.loads(msg["data"])
                heard.setdefault(keys.job_id_of_channel(msg["channel"]), []).append(event)

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()

    unknown = enqueue(q, prompt="x", max_tokens=4, temprature=1.0)
    too_long = enqueue(q, prompt="x", max_tokens=5000)  # context: 4096
    marker = tmp_path / "unpickled"
    pickled = Queue("rose", connection=r).enqueue("rose.jobs.generate", kwargs={"prompt": _Evil(marker)})
    long_cancel = enqueue(q, prompt="cancel me", max_tokens=None, ignore_eos=True)
    long_timeout = enqueue(q, prompt="time me out", max_tokens=None, ignore_eos=True, job_timeout=2)

    for i, j in enumerate(jobs):
        result = finished(r, j.id)
        assert result["metadata"] == {"i": i}
        assert result["usage"]["completion_tokens"] == len(result["token_ids"]) <= 6 + i
        assert result["worker"] == worker.name
        assert current_attempt_text(r, j.id) == result["text"]
    wait_for(
        lambda: all(heard[j.id] and heard[j.id][-1]["type"] == "done" for j in jobs), 10, what="pub/sub done"
    )
    stop.set()
    for j in jobs:
        assert "".join(e["text"] for e in heard[j.id] if e["type"] == "token") == finished(r, j.id)["text"]
        assert [e["seq"] for e in heard[j.id]] == list(range(len(heard[j.id])))

    client = Client(r)
    with pytest.raises(JobFailed, match="unknown field 'temprature'"):
        client.job(unknown.id).result(timeout=30)
    with pytest.raises(JobFailed, match="max_tokens"):
        client.job(too_long.id).result(timeout=30)
    with pytest.raises(JobFailed, match="not JSON"):
        client.job(pickled.id).result(timeout=30)
    assert not marker.exists()

    wait_for(lambda: len(stream_events(r, long_cancel.id)) >= 3, 30, what="long job streaming")
    Job.fetch(long_cancel.id, connection=r, serializer=JSONSerializer).cancel()
    with pytest.raises(JobCanceled):
        list(client.job(long_cancel.id).stream(timeout=30))
    with pytest.raises(JobFailed, match=r"timeout value \(2 seconds\)"):
        client.job(long_timeout.id).result(timeout=60)

    # `rq info` (RQ's own CLI) lists the worker
    info = subprocess.run(
        [sys.executable, "-m", "rq.cli", "info", "--url", server.url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert worker.name in info.stdout, info.stdout + info.stderr

    # the worker kept serving through all of that
    assert finished(r, client.submit("still alive?", max_tokens=3).id)["text"] is not None
    assert worker.proc.poll() is None


def test_kill_9_mid_batch_then_restart_loses_nothing(server, spawn):
    r = server.client()
    client = Client(r)
    jobs = client.submit_many(
        [{"prompt": f"job {i}", "max_tokens": 120, "ignore_eos": True} for i in range(6)]
    )
    first = spawn("--max-num-seqs", "4", name="stable-e2e").wait_ready()
    wait_for(
        lambda: sum(len(stream_events(r, j.id)) >= 2 for j in jobs) >= 3,
        60,
        interval=0.05,
        what="jobs mid-generation",
    )
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(10)
    assert (
        StartedJobRegistry("rose", connection=r).count >= 0
    )  # rq info-style access must not fail the orphans
    assert r.zcard("rq:wip:rose") >= 3
    spawn("--max-num-seqs", "4", name="stable-e2e").wait_ready()
    for j in jobs:
        result = finished(r, j.id)
        assert len(result["token_ids"]) == 120
        assert current_attempt_text(r, j.id) == result["text"]
    requeued = [
        Job.fetch(j.id, connection=r, serializer=JSONSerializer).meta.get(keys.META_REQUEUES) for j in jobs
    ]
    assert requeued.count(1) >= 3
    assert r.zcard("rq:wip:rose") == 0
    assert r.llen("rq:failed:rose") == 0 and r.zcard("rq:failed:rose") == 0


def test_sigterm_drains_and_exits_0(server, spawn):
    r = server.client()
    client = Client(r)
    # short jobs long enough to be mid-generation when the signal comes, short enough to finish in the drain
    short = client.submit_many(
        [{"prompt": f"s {i}", "max_tokens": 200, "ignore_eos": True} for i in range(3)]
    )
    endless = client.submit("endless", max_tokens=None, ignore_eos=True)  # ~4090 tokens: outlasts the drain
    worker = spawn("--max-num-seqs", "8", "--max-model-len", "4096", "--drain-timeout", "15").wait_ready()
    # generating, not just marked started: the status is set a moment before the loop admits the jobs, and a
    # signal in between would find fewer than four running
    wait_for(
        lambda: all(stream_events(r, j.id) for j in [*short, endless]),
        60,
        interval=0.02,
        what="all four generating",
    )
    t = time.monotonic()
    worker.proc.send_signal(signal.SIGTERM)
    assert worker.wait(60) == 0, worker.output()
    assert time.monotonic() - t < 45
    for j in short:  # running jobs that could finish within --drain-timeout did
        assert r.hget(Job.key_for(j.id), "status") == b"finished", worker.output()
    assert r.hget(Job.key_for(endless.id), "status") == b"queued"
    assert r.lrange("rq:queue:rose", 0, -1) == [endless.id.encode()]
    assert StartedJobRegistry("rose", connection=r).get_job_ids() == []
    assert Worker.all(connection=r) == []
    assert "draining 4 running jobs" in worker.output()


def test_unreachable_redis_is_one_clear_line(unused_port):
    url = f"redis://127.0.0.1:{unused_port}/0"
    proc = subprocess.run(
        [*worker_process.worker_command(), "--redis-url", url], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2  # as every start-up error
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert url in lines[0] and "--redis-url" in lines[0]


def test_wrong_redis_password_is_one_clear_line_and_exit_2(server):
    checkout = str(Path(__file__).resolve().parents[2])  # this checkout's rose, not an installed one
    server.client().execute_command("ACL", "SETUSER", "rose-w", "on", ">right", "~*", "&*", "+@all")
    try:
        url = f"redis://rose-w:wrong@127.0.0.1:{server.port}/0"
        proc = subprocess.run(
            [*worker_process.worker_command(), "--redis-url", url],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([checkout, os.environ.get("PYTHONPATH", "")])},
        )
    finally:
        server.client().execute_command("ACL", "DELUSER", "rose-w")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "cannot reach Redis" in lines[0] and "wrong" not in lines[0]  # the password is redacted
    assert "invalid username-password pair" in lines[0]


class _OldRedis(socketserver.StreamRequestHandler):
    """A server that answers as a Redis 6.0 would at a client's start: HELLO, PING, INFO server, CLIENT."""

    def handle(self) -> None:
        while line := self.rfile.readline():
            args = [self.rfile.read(int(self.rfile.readline()[1:]) + 2)[:-2] for _ in range(int(line[1:]))]
            command = args[0].upper()
            if command == b"PING":
                self.wfile.write(b"+PONG\r\n")
            elif command == b"INFO":
                body = b"# Server\r\nredis_version:6.0.16\r\nredis_mode:standalone\r\n"
                self.wfile.write(b"$%d\r\n%s\r\n" % (len(body), body))
            elif command == b"HELLO":  # RESP3, as redis-py asks for it
                hello = [
                    b"server",
                    b"redis",
                    b"version",
                    b"6.0.16",
                    b"mode",
                    b"standalone",
                    b"role",
                    b"master",
                ]
                self.wfile.write(b"%%%d\r\n" % (len(hello) // 2 + 1))
                self.wfile.write(
                    b"".join(b"$%d\r\n%s\r\n" % (len(x), x) for x in hello) + b"$5\r\nproto\r\n:3\r\n"
                )
            elif command in (b"CLIENT", b"AUTH", b"SELECT"):
                self.wfile.write(b"+OK\r\n")
            else:
                self.wfile.write(b"-ERR unknown command '%s'\r\n" % args[0])


def test_a_redis_older_than_6_2_is_refused_at_start_in_one_line():
    """RQ moves ids with LMOVE from Redis 6.2 on, and so does every take of rose-worker: an older server is named
    at start, before the model is loaded, not found out by the first take's script."""
    with socketserver.ThreadingTCPServer(("127.0.0.1", 0), _OldRedis) as old:
        threading.Thread(target=old.serve_forever, daemon=True).start()
        url = f"redis://u:hunter2@127.0.0.1:{old.server_address[1]}/0"
        proc = subprocess.run(
            [*worker_process.worker_command(), "--redis-url", url], capture_output=True, text=True, timeout=60
        )
        old.shutdown()
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "runs version 6.0.16; rose-worker needs Redis 6.2 or newer" in lines[0], lines[0]
    assert "u:***@127.0.0.1" in lines[0] and "hunter2" not in lines[0]


def test_a_redis_that_evicts_keys_when_full_is_a_warning_at_start(server):
    r = server.client()
    r.config_set("maxmemory", "512mb")
    r.config_set("maxmemory-policy", "allkeys-lru")
    proc = subprocess.run(
        [*worker_process.worker_command(), "--redis-url", server.url, "--burst"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    warning = [line for line in proc.stderr.splitlines() if "evicts keys when full" in line]
    assert len(warning) == 1 and "WARNING" in warning[0], proc.stderr
    assert "(maxmemory 512.00M, maxmemory-policy allkeys-lru)" in warning[0]


def test_dead_workers_jobs_are_requeued_by_another_worker_after_heartbeat_lapse(server, spawn):
    r = server.client()
    client = Client(r)
    jobs = client.submit_many(
        [{"prompt": f"job {i}", "max_tokens": 120, "ignore_eos": True} for i in range(3)]
    )
    doomed = spawn("--max-num-seqs", "4", "--heartbeat-timeout", "10", name="doomed").wait_ready()
    wait_for(
        lambda: all(len(stream_events(r, j.id)) >= 2 for j in jobs), 60, interval=0.05, what="generation"
    )
    doomed.proc.send_signal(signal.SIGKILL)
    doomed.proc.wait(10)
    killed_at = time.monotonic()
    spawn("--max-num-seqs", "4", name="rescuer").wait_ready()
    # requeued once the dead worker's key lapses (10 s) plus one recovery scan (1 s), plus slack for a slow machine
    wait_for(
        lambda: all(r.hget(Job.key_for(j.id), "worker_name") in (b"rescuer", b"") for j in jobs),
        60,
        what="rescue",
    )
    assert time.monotonic() - killed_at < 60
    for j in jobs:
        result = finished(r, j.id)
        assert current_attempt_text(r, j.id) == result["text"]
        assert result["worker"] == "rescuer"
    assert [
        Job.fetch(j.id, connection=r, serializer=JSONSerializer).meta[keys.META_REQUEUES] for j in jobs
    ] == [1] * 3
