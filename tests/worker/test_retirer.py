"""rose.worker.retirer: the jobs of a step retired as one batch in two pipelined rounds, leaving Redis exactly as RQ's
own handle_job_success does; dependents, a WATCH abort and Redis errors fall back to RQ's handler."""

from __future__ import annotations

import time

import pytest
import redis
from rq.job import Job, JobStatus
from rq.registry import FinishedJobRegistry, StartedJobRegistry
from rq.results import Result
from rq.serializers import JSONSerializer
from worker_helpers import registered_worker

from rose.engine.outputs import RequestMetrics, RequestOutput
from rose.jobs.client import Client
from rose.worker import intake

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def worker(redis_server, r):
    w = registered_worker(redis_server, "retirer")
    yield w
    w.connection.close()


def finished_runs(worker, r, n: int, **submit):
    client = Client(r, queue="rose")
    jobs = [client.submit(f"prompt {i}", max_tokens=2, **submit) for i in range(n)]
    runs = intake.start(worker, intake.take(worker, n))
    assert [run.id for run in runs] == [job.id for job in jobs]
    for run in runs:
        assert intake.validate(worker, run) is None
        run.text, run.token_ids = ["a", "b"], [5, 6]
        run.output = RequestOutput(
            request_id=run.id,
            prompt=None,
            prompt_token_ids=[1, 2],
            text="ab",
            token_ids=[5, 6],
            finish_reason="length",
            metrics=RequestMetrics(arrival_time=time.time(), num_prompt_tokens=2),
        )
    return runs


def job_state(r, run) -> dict:
    """What RQ stored about a finished job, minus what differs between any two jobs (ids, times)."""
    job = Job.fetch(run.id, connection=r, serializer=JSONSerializer)
    result = Result.fetch_latest(job, serializer=JSONSerializer)
    fields = {k.decode(): v for k, v in r.hgetall(job.key).items()}
    volatile = {
        "created_at",
        "enqueued_at",
        "started_at",
        "ended_at",
        "last_heartbeat",
        "data",
        "description",
    }
    return {
        "status": job.get_status(),
        "fields": sorted(set(fields) - volatile),
        "worker_name": fields.get("worker_name"),
        "ttl": r.ttl(job.key) > 0,
        "result_type": result.type if result else None,
        "result_keys": sorted(result.return_value) if result else None,
        "finished": run.id in FinishedJobRegistry("rose", connection=r),
        "started": any(
            m.startswith(run.id.encode())
            for m in r.zrange(StartedJobRegistry("rose", connection=r).key, 0, -1)
        ),
        "execution": r.exists(run.execution.key),
    }


def test_a_batch_leaves_redis_as_rqs_handler_does(worker, r):
    by_handler, *batch = finished_runs(worker, r, 4)
    worker.running = {run.id: run for run in [by_handler, *batch]}
    worker._succeed(by_handler)  # RQ's handle_job_success
    for run in batch:
        worker.running.pop(run.id)
    worker._retirer.submit(batch)
    assert worker._retirer.busy
    worker._retirer.advance(wait=True)  # WATCH + SMEMBERS read, MULTI/EXEC sent
    assert worker._retirer.busy
    worker._retirer.advance(wait=True)  # EXEC read
    assert not worker._retirer.busy and worker._retirer.batched_jobs == 3
    expected = job_state(r, by_handler)
    assert expected["status"] == JobStatus.FINISHED and expected["finished"] and not expected["started"]
    for run in batch:
        assert job_state(r, run) == expected
        assert Client(r, queue="rose").job(run.id).result(timeout=1)["token_ids"] == [5, 6]
    counts = r.hmget(worker.key, "successful_job_count", "total_working_time")
    assert int(counts[0]) == 4 and float(counts[1]) > 0
    assert worker.completed == 4 and not worker.running
    done = [e for e in worker._outbox if '"type":"done"' in e.data.replace(" ", "")]
    assert len(done) == 4


def test_rounds_wait_for_replies_unless_told_to(worker, r):
    runs = finished_runs(worker, r, 2)
    worker._retirer.submit(runs)
    batch = worker._retirer._batches[0]
    deadline = time.monotonic() + 5
    while not batch.conn.can_read(timeout=0.01):  # Redis answers while "the model runs"
        assert time.monotonic() < deadline
    worker._retirer.advance()
    assert batch.phase == 2
    deadline = time.monotonic() + 5
    while worker._retirer.busy:
        worker._retirer.advance()
        assert time.monotonic() < deadline
    assert worker._retirer.batched_jobs == 2


def test_jobs_with_dependents_go_through_rqs_handler(worker, r):
    parent, other = finished_runs(worker, r, 2)
    dependent = Client(r, queue="rose").submit("after", max_tokens=1, depends_on=parent.id)
    assert dependent.status() == "deferred"
    worker._retirer.submit([parent, other])
    worker._retirer.drain()
    assert worker._retirer.batched_jobs == 0
    assert {run.id for run in worker.running.values() if run.retire_inline} == {parent.id, other.id}
    worker._checks()  # handed back: the loop checks them first
    worker._retire()  # the loop's next retirement: RQ's handler, which enqueues the dependent
    assert not worker.running
    assert Job.fetch(dependent.id, connection=r, serializer=JSONSerializer).get_status() == JobStatus.QUEUED
    assert job_state(r, other)["status"] == JobStatus.FINISHED


def test_a_dependent_added_between_the_rounds_aborts_the_batch(worker, r):
    (run,) = finished_runs(worker, r, 1)
    worker._retirer.submit([run])
    batch = worker._retirer._batches[0]
    assert batch.conn.can_read(timeout=5)  # WATCHing, and no dependents seen...
    r.sadd(run.job.dependents_key, "late-dependent")  # ...but one comes before the transaction
    worker._retirer.advance(wait=True)  # MULTI/EXEC sent
    worker._retirer.advance(wait=True)  # the EXEC was aborted by the WATCH
    assert worker._retirer.batched_jobs == 0 and not worker._retirer.busy
    assert worker.running[run.id].retire_inline
    worker._checks()  # handed back: the loop checks them first
    worker._retire()  # RQ's handler, which sees the dependent
    assert job_state(r, run)["status"] == JobStatus.FINISHED


def test_redis_errors_hand_the_jobs_back_to_the_loop(worker, r):
    runs = finished_runs(worker, r, 2)
    worker._retirer.submit(runs)
    r.client_kill_filter(_type="normal", skipme=True)
    worker._retirer.drain()
    assert not worker._retirer.busy
    assert {run.id for run in worker.running.values() if run.retire_inline} == {run.id for run in runs}
    worker._checks()  # handed back: the loop checks them first
    worker._retire()  # the loop retries them through RQ's handler
    assert not worker.running and worker.completed == 2
    for run in runs:
        assert job_state(r, run)["status"] == JobStatus.FINISHED


def test_a_job_no_longer_ours_sends_the_batch_back_to_be_checked(worker, r):
    canceled, other = finished_runs(worker, r, 2)
    Client(r, queue="rose").cancel(canceled.id)
    worker._retirer.submit([canceled, other])
    worker._retirer.drain()
    assert worker._retirer.batched_jobs == 0 and worker._check_forced
    assert {run.id for run in worker.running.values() if run.retire_inline} == {canceled.id, other.id}
    worker._checks()  # what the loop runs first when a check is forced
    assert not worker._check_forced and set(worker.running) == {other.id}
    worker._retire()
    assert job_state(r, other)["status"] == JobStatus.FINISHED
    assert (
        job_state(r, canceled)["status"] == JobStatus.CANCELED
        and job_state(r, canceled)["result_type"] is None
    )


def test_a_job_canceled_between_the_rounds_aborts_the_batch(worker, r):
    (run,) = finished_runs(worker, r, 1)
    worker._retirer.submit([run])
    assert worker._retirer._batches[0].conn.can_read(timeout=5)  # WATCHing, and the job read as ours...
    Client(r, queue="rose").cancel(run.id)  # ...but it is canceled before the transaction
    worker._retirer.advance(wait=True)  # MULTI/EXEC sent
    worker._retirer.advance(wait=True)  # the EXEC was aborted by the WATCH on the job's hash
    assert worker._retirer.batched_jobs == 0 and worker._check_forced
    worker._checks()
    assert not worker.running
    assert job_state(r, run)["status"] == JobStatus.CANCELED and job_state(r, run)["result_type"] is None


def test_a_forced_check_interrupted_by_redis_stays_owed(worker, r, monkeypatch):
    runs = finished_runs(worker, r, 2)
    for run in runs:
        Client(r, queue="rose").cancel(run.id)
    worker._retirer.submit(runs)
    worker._retirer.drain()
    real_cancel = worker._cancel

    def blip(run, reason):
        monkeypatch.setattr(worker, "_cancel", real_cancel)  # fails once
        raise redis.ConnectionError("blip")

    monkeypatch.setattr(worker, "_cancel", blip)
    worker._redis("checks", worker._checks)  # the loop's wrapper: logs, backs off
    assert worker._check_forced
    worker._retire()  # stores nothing while the check is owed
    worker._checks()
    worker._retire()
    assert not worker.running
    assert [job_state(r, run)["status"] for run in runs] == [JobStatus.CANCELED] * 2


def test_a_forced_check_never_reads_a_probe_sent_before_the_hand_back(worker, r):
    canceled, other = finished_runs(worker, r, 2)
    other.output = None  # still generating
    worker._probe.send([other])  # sent before a step, not read yet
    Client(r, queue="rose").cancel(canceled.id)
    worker._retirer.submit([canceled])
    worker._retirer.drain()  # handed back: the probe in flight does not cover it
    worker._checks()
    worker._retire()
    assert canceled.needs_check and worker._check_forced and worker.running[canceled.id] is canceled
    worker._checks()  # the next probe covers it
    assert not worker.running and not worker._check_forced
    assert job_state(r, canceled)["status"] == JobStatus.CANCELED


def test_a_checked_job_is_stored_even_while_later_ones_wait_for_their_check(worker, r):
    """Hand-backs in every iteration must not starve the jobs already checked."""
    first, second = finished_runs(worker, r, 2)
    Client(r, queue="rose").submit("after", max_tokens=1, depends_on=first.id)
    Client(r, queue="rose").submit("after", max_tokens=1, depends_on=second.id)
    worker._retirer.submit([first])
    worker._retirer.drain()  # dependents: handed back
    worker._checks()  # first checked
    worker._retirer.submit([second])
    worker._retirer.drain()  # handed back too, not checked yet
    worker._retire()
    assert job_state(r, first)["status"] == JobStatus.FINISHED
    assert set(worker.running) == {second.id} and second.needs_check


def test_a_redis_error_in_rqs_handler_owes_a_new_check(worker, r, monkeypatch):
    (run,) = finished_runs(worker, r, 1)
    Client(r, queue="rose").submit("after", max_tokens=1, depends_on=run.id)
    worker._retirer.submit([run])
    worker._retirer.drain()
    worker._checks()
    monkeypatch.setattr(type(worker), "handle_job_success", _raise_connection_error)
    worker._redis("retire", worker._retire)
    assert run.needs_check and worker.running[run.id] is run
    monkeypatch.undo()
    Client(r, queue="rose").cancel(run.id)  # during the back-off
    worker._checks()
    worker._retire()
    assert not worker.running and job_state(r, run)["status"] == JobStatus.CANCELED


def _raise_connection_error(*args, **kwargs):
    raise redis.ConnectionError("blip")
