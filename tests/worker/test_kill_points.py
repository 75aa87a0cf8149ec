"""kill -9 at the worst instants of a job's end (rose.worker.faults: the real rose-worker process SIGKILLs itself at
a chosen point), then every job is audited as a producer and a subscriber see it (rose.harness.job_audit): finished
exactly once, its stream ends with exactly one terminal event after its last reset, streamed text equals stored
text (rose.worker.seal)."""

from __future__ import annotations

import time

import pytest
from rq import Queue
from rq.job import Job
from rq.serializers import JSONSerializer
from worker_helpers import TinyWorker

from rose.harness.job_audit import audit
from rose.harness.worker_process import wait_for
from rose.jobs import keys
from rose.jobs.client import Client

pytestmark = pytest.mark.timeout(400)

REPAIRED = "its end was stored but its stream did not show it"


ARGS = ("--max-model-len", "256", "--max-num-seqs", "4")


@pytest.fixture
def spawn(new_redis_server, tmp_path):
    procs: list[TinyWorker] = []

    def start(name: str, *args: str, fault: str | None = None) -> TinyWorker:
        p = TinyWorker(
            new_redis_server, tmp_path / f"worker{len(procs)}.log", name, *ARGS, *args, fault=fault
        )
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.kill()


def submit(r, n: int) -> list[str]:
    jobs = Client(r).submit_many(
        [{"prompt": f"job {i}", "max_tokens": 12 + 3 * i, "ignore_eos": True} for i in range(n)]
    )
    return [j.id for j in jobs]


def all_finished(r, ids: list[str], timeout: float = 180) -> None:
    wait_for(
        lambda: all(r.hget(Job.key_for(i), "status") == b"finished" for i in ids),
        timeout,
        interval=0.1,
        what="every job finished",
    )


def died(worker: TinyWorker) -> None:
    wait_for(lambda: worker.proc.poll() is not None, 120, interval=0.05, what="the worker's kill -9")
    assert worker.proc.returncode == -9, worker.output(3000)


def submit_with_dependents(r, n: int) -> list[str]:
    """`n` jobs, each with a dependent (so RQ's own handler stores them, and seals them), then the dependents."""
    client = Client(r)
    parents = [client.submit(f"job {i}", max_tokens=12 + 3 * i, ignore_eos=True) for i in range(n)]
    children = [client.submit(f"then {i}", max_tokens=4, depends_on=p.id) for i, p in enumerate(parents)]
    return [j.id for j in parents + children]


@pytest.mark.parametrize("count", [1, 3])
def test_killed_right_after_a_batch_stored_results_leaves_nothing_to_repair(new_redis_server, spawn, count):
    """A retirer batch writes each job's done event in the transaction that stores its result: a kill right after
    leaves every finished job's stream complete, with no seal marker."""
    r = new_redis_server.client()
    ids = submit(r, 8)
    died(spawn("batched", fault=f"result_stored:{count}"))
    done = [i for i in ids if r.hget(Job.key_for(i), "status") == b"finished"]
    assert len(done) >= count and r.hlen(keys.SEALS_KEY) == 0
    assert [p for i in done for p in audit(r, i)] == []  # complete at the kill, before any restart
    spawn("batched").wait_ready()
    all_finished(r, ids)
    wait_for(lambda: not any(audit(r, i) for i in ids), 10, what=f"{[audit(r, i) for i in ids]}")


def test_killed_after_rqs_handler_stored_a_result_before_its_done_event(new_redis_server, spawn):
    """A job with dependents is stored by RQ's handler, its done event after: the restart under the same name
    repairs the stream from the stored result at once."""
    r = new_redis_server.client()
    ids = submit_with_dependents(r, 3)
    died(spawn("sealed", fault="result_stored:1"))
    assert r.hlen(keys.SEALS_KEY) == 1  # a stored end whose terminal event never came
    restarted = spawn("sealed").wait_ready()
    all_finished(r, ids)
    wait_for(lambda: not any(audit(r, i) for i in ids), 10, what=f"{[audit(r, i) for i in ids]}")
    assert REPAIRED in restarted.output() and r.hlen(keys.SEALS_KEY) == 0


def test_killed_after_sending_the_last_tokens_before_storing_results(new_redis_server, spawn):
    """The last tokens are sent, the results not stored: the jobs run again from a reset, nothing is sealed."""
    r = new_redis_server.client()
    ids = submit(r, 6)
    died(spawn("unsealed", fault="events_sent:2"))
    spawn("unsealed").wait_ready()
    all_finished(r, ids)
    wait_for(lambda: not any(audit(r, i) for i in ids), 10, what=f"{[audit(r, i) for i in ids]}")
    restarted = [
        i for i in ids if Job.fetch(i, connection=r, serializer=JSONSerializer).meta.get(keys.META_REQUEUES)
    ]
    assert restarted  # at least the jobs that were finishing ran again


def test_another_worker_repairs_a_dead_workers_streams(new_redis_server, spawn):
    """No restart: a live worker repairs the streams once the dead worker's heartbeat has lapsed."""
    r = new_redis_server.client()
    ids = submit_with_dependents(r, 3)
    died(spawn("doomed", "--heartbeat-timeout", "10", fault="result_stored:1"))
    killed = time.monotonic()
    assert r.hlen(keys.SEALS_KEY) >= 1
    spawn("rescuer").wait_ready()
    all_finished(r, ids)
    wait_for(lambda: not any(audit(r, i) for i in ids), 60, what=f"{[audit(r, i) for i in ids]}")
    assert time.monotonic() - killed < 60 and r.hlen(keys.SEALS_KEY) == 0


def test_killed_after_storing_a_failure_before_its_error_event(new_redis_server, spawn):
    r = new_redis_server.client()
    q = Queue("rose", connection=r, serializer=JSONSerializer)  # plain RQ: rose.Client refuses the bad value
    bad = [
        q.enqueue(keys.FUNC_PATH, kwargs={"prompt": "x", "max_tokens": 4, "temperature": -1}).id
        for _ in range(3)
    ]
    good = submit(r, 3)
    died(spawn("failing", fault="failure_stored:2"))
    restarted = spawn("failing").wait_ready()
    all_finished(r, good)
    wait_for(
        lambda: not any(audit(r, i, failed=True) for i in bad), 30, what=f"{[audit(r, i, True) for i in bad]}"
    )
    assert not any(audit(r, i) for i in good)
    assert REPAIRED in restarted.output() and r.hlen(keys.SEALS_KEY) == 0
