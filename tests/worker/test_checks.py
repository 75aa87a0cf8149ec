"""rose.worker.checks: running jobs are checked every check_interval, not at every step, and a job canceled while it
runs is never stored as finished, whatever path its result takes (batched retirement, RQ's handler, a callback)."""

from __future__ import annotations

import logging

import pytest
import redis
from rq import Callback
from rq.command import send_stop_job_command
from rq.job import Job
from rq.serializers import JSONSerializer
from worker_helpers import (
    FakeEngine,
    check_stream,
    enqueue,
    registered_worker,
    status,
    stream_events,
    wait_for,
    wait_status,
)

from rose.worker import intake, probe

pytestmark = pytest.mark.timeout(60)

NEVER = 3600  # a check_interval no test outlives: only the first step's probe, and the checks forced later
succeeded: list[str] = []


def on_success(job, connection, result, *args, **kwargs):
    succeeded.append(job.id)


def cancel_after_tokens(r, job, tokens: int = 3) -> None:
    wait_status(r, job, "started")
    wait_for(lambda: len(stream_events(r, job.id)) >= tokens, what="tokens")
    Job.fetch(job.id, connection=r, serializer=JSONSerializer).cancel()


def assert_canceled_not_stored(r, job) -> None:
    check_stream(r, job.id, "canceled")
    assert status(r, job) == "canceled"
    assert Job.fetch(job.id, connection=r, serializer=JSONSerializer).latest_result() is None


def test_probe_goes_out_once_per_interval_and_a_cancel_still_wins(run_worker, r, q, monkeypatch):
    """The job is canceled between two checks and finishes: the retirer reads its status before writing, hands it
    back, and the loop's check cancels it."""
    probed: list[int] = []
    real_send = probe.InFlightProbe.send

    def send(self, runs):
        if runs:  # not the queue-lengths question
            probed.append(len(runs))
        return real_send(self, runs)

    monkeypatch.setattr(probe.InFlightProbe, "send", send)
    engine = FakeEngine(max_num_seqs=4, step_delay=0.01)
    job = enqueue(q, prompt="x", max_tokens=40)
    run_worker(engine=engine, check_interval=NEVER)
    cancel_after_tokens(r, job)  # unseen until the job finishes
    assert_canceled_not_stored(r, job)
    assert engine.steps >= 40 and job.id not in engine.aborted  # generation ran to its end
    # the first step's probe; then the one the retirer's hand-back forced (sent before a step, or at once when
    # the engine is idle, which is not counted here)
    assert probed[0] == 1 and len(probed) <= 2, probed


def test_a_handed_back_job_waits_for_its_check_while_the_engine_is_busy(run_worker, r, q):
    engine = FakeEngine(max_num_seqs=4, step_delay=0.01)
    long = enqueue(q, prompt="y", max_tokens=60)
    short = enqueue(q, prompt="x", max_tokens=30)
    run_worker(engine=engine, check_interval=NEVER)
    cancel_after_tokens(r, short)
    assert_canceled_not_stored(r, short)
    assert status(r, long) == "started"  # the engine was busy all along
    wait_status(r, long, "finished")


def test_a_job_with_a_success_callback_is_checked_before_rqs_handler(run_worker, r, q):
    succeeded.clear()
    job = q.enqueue(
        "rose.jobs.generate",
        kwargs={"prompt": "x", "max_tokens": 40},
        on_success=Callback("test_checks.on_success"),
    )
    done = q.enqueue(
        "rose.jobs.generate",
        kwargs={"prompt": "x", "max_tokens": 5},
        on_success=Callback("test_checks.on_success"),
    )
    run_worker(engine=FakeEngine(max_num_seqs=4, step_delay=0.01), check_interval=NEVER)
    cancel_after_tokens(r, job)
    assert_canceled_not_stored(r, job)
    wait_status(r, done, "finished")
    assert succeeded == [done.id]


def test_stop_commands_act_at_once_whatever_the_interval(run_worker, r, q):
    engine = FakeEngine(max_num_seqs=4, step_delay=0.02)
    job = enqueue(q, prompt="x", max_tokens=60)
    run_worker(engine=engine, check_interval=NEVER)
    wait_for(lambda: len(stream_events(r, job.id)) >= 3, what="tokens")
    send_stop_job_command(r, job.id, serializer=JSONSerializer)
    wait_status(r, job, "stopped")
    assert check_stream(r, job.id, "canceled")[-1]["reason"] == "stopped"
    assert job.id in engine.aborted and engine.steps < 60


def test_recovery_never_takes_jobs_whose_results_are_being_stored(run_worker, r, q, caplog):
    """Jobs in a retirement batch are not in `running` but still this worker's: a recovery scan must not requeue
    them (the WATCH on their hashes would then drop the finished job and it would run again)."""
    caplog.set_level(logging.WARNING)
    engine = FakeEngine(max_num_seqs=8, step_delay=0.005)
    jobs = [enqueue(q, prompt="x", max_tokens=3 + i % 7) for i in range(60)]
    run_worker(engine=engine, recovery_interval=0.02)
    for job in jobs:
        wait_status(r, job, "finished", timeout=30)
    assert len(engine.added) == len(jobs)
    assert not [m for m in caplog.messages if "requeued" in m or "dropping our copy" in m], caplog.messages


@pytest.fixture
def worker(redis_server, request):
    w = registered_worker(redis_server, f"checks-{request.node.name}")
    yield w
    w.publisher.close(timeout=1)
    w.connection.close()


def started_run(worker, q):
    job = enqueue(q, prompt="x", max_tokens=5)
    (run,) = intake.start(worker, intake.take(worker, 1))
    worker._admit(run)
    assert worker.running[job.id] is run
    return run


def test_a_stop_command_hit_by_a_redis_error_is_tried_again(worker, r, q, monkeypatch):
    run = started_run(worker, q)
    worker._stop_job_ids.append(run.id)
    real = type(worker).handle_job_failure

    def blip(self, *args, **kwargs):
        monkeypatch.setattr(type(worker), "handle_job_failure", real)  # once
        raise redis.ConnectionError("blip")

    monkeypatch.setattr(type(worker), "handle_job_failure", blip)
    worker._redis("checks", worker._apply_stops)
    assert worker.running[run.id] is run and list(worker._stop_job_ids) == [run.id]
    worker._apply_stops()
    assert not worker.running and status(r, run.job) == "stopped"


def test_shutdown_applies_pending_stop_commands(worker, r, q):
    run = started_run(worker, q)
    worker._stop_job_ids.append(run.id)
    worker._shutdown()
    assert status(r, run.job) == "stopped"
    assert r.llen(q.key) == 0  # stopped, not requeued


def test_no_queue_length_questions_while_suspended(worker, q):
    started_run(worker, q)
    worker._suspended = True
    worker._ask_lengths()
    assert not worker._lengths_probe.pending
    worker._suspended = False
    worker._ask_lengths()
    assert worker._lengths_probe.pending
    worker._lengths_probe.abandon()
