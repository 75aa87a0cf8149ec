"""What happens to a production Redis, with real processes: redis-server stopped with SIGTERM, killed with SIGKILL
or frozen with SIGSTOP mid-run (an append-only file keeps its data), full (its maxmemory reached under noeviction:
every write refused for a while), and a Sentinel failover (the primary SIGKILLed, its replica promoted). Two real
rose-workers (tiny-llama on CPU) and a producer on plain RQ / rose.Client.

Whatever the fault: no job lost, none stored twice (rose.harness.job_audit: one result, a stream ending with exactly
one terminal event after its last reset, streamed text = stored text), every job seen finished has its complete
stream within a second of being seen so (rose.harness.job_audit.EndWatch, polling from outside all along), and a
stop command sent right after Redis answers again stops its job."""

from __future__ import annotations

import os
import signal
import time

import pytest
import redis
from rq import Queue
from rq.command import send_stop_job_command
from rq.job import Job
from rq.serializers import JSONSerializer
from worker_helpers import TinyWorker

from rose.harness.job_audit import EndWatch, audit, stream_events
from rose.harness.worker_process import wait_for
from rose.jobs import keys
from rose.jobs.client import Client

pytestmark = pytest.mark.timeout(400)

ARGS = ("--max-model-len", "512", "--max-num-seqs", "8", "--heartbeat-timeout", "10")


def submit(client: Client, n: int) -> list[str]:
    """`n` jobs of 40 to 160 tokens, EOS ignored; every fourth one not streamed."""
    jobs = client.submit_many(
        [
            {"prompt": f"job {i}", "max_tokens": 40 + 13 * (i % 10), "ignore_eos": True, "stream": i % 4 != 0}
            for i in range(n)
        ]
    )
    return [j.id for j in jobs]


def statuses(r: redis.Redis, ids: list[str]) -> dict[str, str]:
    with r.pipeline(transaction=False) as pipe:
        for job_id in ids:
            pipe.hget(Job.key_for(job_id), "status")
        return {i: (s or b"").decode() for i, s in zip(ids, pipe.execute(), strict=True)}


def watch_until(watch: EndWatch, done, timeout: float, what: str) -> None:
    """Poll the EndWatch every 50 ms until `done()`."""

    def step():
        watch.poll()
        try:
            return done()
        except (redis.ConnectionError, redis.TimeoutError):
            return False

    wait_for(step, timeout, what, interval=0.05)


def stop_one_running(r: redis.Redis, ids: list[str], exclude: set[str], procs: list[TinyWorker]) -> str:
    """Send a stop command for a job running now, once every worker listens to its command channel again; returns
    the job id. The command must act: the job ends `stopped` (not finished) within a few seconds.

    Redis may still say `started` of a job its worker has finished: one that ended during the outage is stored
    only once Redis answers, and a short one ends within half a second. A stop then finds nothing to stop (RQ's
    worker ignores it too), and the worker logs so; only then is another job tried. A lost command fails."""
    t0 = time.monotonic()
    for proc in procs:
        channel = f"rq:pubsub:{proc.name}"
        wait_for(
            lambda c=channel: r.pubsub_numsub(c)[0][1] >= 1, 2, f"{proc.name} listening to its commands again"
        )
    listening_after = time.monotonic() - t0
    tried: set[str] = set()
    for _ in range(3):
        # read just before sending: a job picked before the wait above may have ended during it
        running = started_by(r, ids, exclude | tried)
        assert running, "no job running right after the outage"
        job_id, owner = running[-1]
        tried.add(job_id)
        if stop_acted(r, job_id, next(p for p in procs if p.name == owner)):
            break
    else:
        pytest.fail(f"jobs {sorted(tried)} had all ended on their workers before their stop commands")
    wait_for(  # its terminal event follows the stored stop within a second
        lambda: [e["type"] for e in stream_events(r, job_id)][-1:] == ["canceled"],
        1,
        f"job {job_id}'s canceled event",
    )
    assert stream_events(r, job_id)[-1]["reason"] == "stopped"
    assert listening_after < 1.0, f"the command channels came back {listening_after:.2f} s after Redis"
    return job_id


def started_by(r: redis.Redis, ids: list[str], exclude: set[str]) -> list[tuple[str, str]]:
    """(job id, worker name) of the jobs Redis says are started, in `ids` order, less `exclude`."""
    with r.pipeline(transaction=False) as pipe:
        for job_id in ids:
            pipe.hmget(Job.key_for(job_id), "status", "worker_name")
        replies = pipe.execute()
    return [
        (job_id, (worker or b"").decode())
        for job_id, (status, worker) in zip(ids, replies, strict=True)
        if status == b"started" and job_id not in exclude
    ]


def stop_acted(r: redis.Redis, job_id: str, owner: TinyWorker) -> bool:
    """Send the stop command: True once the job is stopped, False if its worker logged that it no longer ran it
    (rose.worker.watch's line); neither within 10 s fails."""
    send_stop_job_command(r, job_id, serializer=JSONSerializer)
    ignored = f"stop command for job {job_id}, which is not running here: ignored"
    wait_for(
        lambda: statuses(r, [job_id])[job_id] == "stopped" or ignored in owner.output(),
        10,
        f"job {job_id} stopped by the command",
    )
    return statuses(r, [job_id])[job_id] == "stopped"


@pytest.fixture
def workers(tmp_path):
    started: list[TinyWorker] = []

    def start(server, *names: str) -> list[TinyWorker]:
        procs = [TinyWorker(server, tmp_path / f"{name}.log", name, *ARGS) for name in names]
        started.extend(procs)
        for proc in procs:
            proc.wait_ready()
        return procs

    yield start
    for proc in started:
        proc.stop(timeout=20)


@pytest.mark.parametrize("fault", ["sigterm", "sigkill", "sigstop", "full"])
def test_a_redis_restart_or_freeze_mid_run_loses_nothing_and_leaves_no_gap(
    persistent_redis_server, workers, fault
):
    server = persistent_redis_server
    r = server.client(socket_timeout=5, retry=None)
    ids = submit(Client(r), 48)
    procs = workers(server, "a", "b")
    watch = EndWatch(r, ids, grace=1.0)
    watch_until(watch, lambda: len(watch.first_seen) >= 4, 120, "the first jobs finished")
    if fault == "sigstop":
        os.kill(server.pid, signal.SIGSTOP)
        time.sleep(3)
        os.kill(server.pid, signal.SIGCONT)
    elif fault == "full":  # its maxmemory reached (noeviction): every write refused, reads answered
        r.config_set("maxmemory-policy", "noeviction")
        r.config_set("maxmemory", 1)
        time.sleep(3)
        r.config_set("maxmemory", 0)
    else:
        server.kill() if fault == "sigkill" else server.stop()
        time.sleep(3)
        server.start()
    stopped = stop_one_running(r, ids, set(watch.first_seen), procs)
    rest = [i for i in ids if i != stopped]
    watch.pending.remove(stopped) if stopped in watch.pending else None
    watch_until(watch, lambda: not watch.pending, 240, "every job finished")
    assert watch.late == [], watch.late
    assert [p for i in rest for p in audit(r, i)] == []
    assert all(proc.proc.poll() is None for proc in procs), "a worker died"
    assert r.hlen(keys.SEALS_KEY) == 0


def test_a_sentinel_failover_mid_run_loses_no_job_and_stores_none_twice(tmp_path, workers):
    """The primary is SIGKILLed mid-run and Sentinel promotes its replica. Replication is asynchronous: what the
    old primary had not passed on is gone (a result: the job runs again, its stream starting over with a reset; a
    start: the job is queued again). The workers follow the new primary through their redis+sentinel:// URL,
    reconcile what they run with what it says, and every job ends finished exactly once in the surviving data."""
    from rose.harness.sentinel import SentinelCluster
    from rose.jobs.connection import connect

    with SentinelCluster().start() as cluster:
        r = connect(cluster.url, socket_timeout=5, socket_connect_timeout=2)
        ids = submit(Client(r), 24)
        plain = Queue(
            "rose", connection=r, serializer=JSONSerializer
        )  # a plain-RQ producer, through Sentinel
        ids += [
            plain.enqueue(
                "rose.jobs.generate", kwargs={"prompt": f"rq {i}", "max_tokens": 60, "ignore_eos": True}
            ).id
            for i in range(24)
        ]
        procs = workers(cluster, "a", "b")
        watch = EndWatch(r, ids, grace=1.0)
        watch_until(watch, lambda: len(watch.first_seen) >= 4, 120, "the first jobs finished")
        old = cluster.kill_primary()
        cluster.wait_failover(old_port=old)
        stopped = stop_one_running(r, ids, set(watch.first_seen), procs)
        rest = [i for i in ids if i != stopped]
        if stopped in watch.pending:
            watch.pending.remove(stopped)
        # jobs seen finished on the old primary may be running again on the new one: judged at the end
        watch_until(
            watch,
            lambda: all(s == "finished" for s in statuses(r, rest).values()),
            240,
            "every job finished on the new primary",
        )
        assert watch.late == [], watch.late
        assert [p for i in rest for p in audit(r, i)] == []
        assert all(proc.proc.poll() is None for proc in procs), "a worker died"
        wait_for(lambda: r.hlen(keys.SEALS_KEY) == 0, 15, "no seal marker left")
