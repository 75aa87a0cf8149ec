"""rose.worker.watch: running jobs are checked every check_interval, not at every step, and a job canceled while it
runs is never stored as finished, whatever path its result takes (batched retirement, RQ's handler, a callback),
Redis errors included."""

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
    probe_target,
    registered_rq_worker,
    start_jobs,
    status,
    stream_events,
    wait_for,
    wait_status,
)

from rose.jobs.client import Client
from rose.worker import probe, rq_store
from rose.worker.running import Phase, Running
from rose.worker.watch import Verdict, Watch

pytestmark = pytest.mark.timeout(60)

NEVER = 3600  # a check_interval no test outlives: only the first step's probe, and the checks forced later
succeeded: list[str] = []


def on_success(job, connection, result, *args, **kwargs):
    succeeded.append(job.id)


def enqueue_with_callback(q, max_tokens: int):
    return q.enqueue(
        "rose.jobs.generate",
        kwargs={"prompt": "x", "max_tokens": max_tokens},
        on_success=Callback("test_checks.on_success"),
    )


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

    def send(self, runs, signals=False):
        if runs:  # not the queue-lengths question
            probed.append(len(runs))
        return real_send(self, runs, signals)

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
    job = enqueue_with_callback(q, 40)
    done = enqueue_with_callback(q, 5)
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


def fail_once(monkeypatch, module, name: str, after: bool = False) -> list[str]:
    """`module.name` raises a Redis ConnectionError on its first call (after doing its work if `after`: a reply
    lost on the way back); returns the ids of the jobs it was called for."""
    real, calls = getattr(module, name), []

    def once(*args, **kwargs):
        run = next(a for a in args if isinstance(a, Running))
        calls.append(run.id)
        if len(calls) > 1:
            return real(*args, **kwargs)
        if after:
            real(*args, **kwargs)
        raise redis.ConnectionError("blip")

    monkeypatch.setattr(module, name, once)
    return calls


def test_a_cancel_hit_by_a_redis_error_is_checked_again(run_worker, r, q, monkeypatch):
    """The job is canceled while it runs and owes a check when it finishes (a success callback): the cancel's
    write fails once, and the check is owed until it goes through."""
    succeeded.clear()
    calls = fail_once(monkeypatch, rq_store, "cancel")
    job = enqueue_with_callback(q, 40)
    run_worker(engine=FakeEngine(max_num_seqs=4, step_delay=0.01), check_interval=NEVER)
    cancel_after_tokens(r, job)
    assert_canceled_not_stored(r, job)
    assert calls == [job.id, job.id] and succeeded == []


def test_a_result_stored_by_rqs_handler_whose_reply_is_lost_is_stored_once(run_worker, r, q, monkeypatch):
    """RQ's handler stores the job (it has a dependent) but the reply is lost: the check that follows finds the job
    finished by this worker, and the worker announces it without storing it again."""
    calls = fail_once(monkeypatch, rq_store, "succeed", after=True)
    parent = enqueue(q, prompt="x", max_tokens=3)
    child = q.enqueue("rose.jobs.generate", kwargs={"prompt": "y", "max_tokens": 2}, depends_on=parent)
    run_worker(engine=FakeEngine(max_num_seqs=4, step_delay=0.01))
    wait_status(r, child, "finished")
    check_stream(r, parent.id, "done")
    assert calls == [parent.id]  # RQ's handler ran once for it (the child, with no dependents, was batched)
    assert len(Job.fetch(parent.id, connection=r, serializer=JSONSerializer).results()) == 1


def test_a_stop_command_hit_by_a_redis_error_is_tried_again(run_worker, r, q, monkeypatch):
    calls = fail_once(monkeypatch, rq_store, "stop")
    engine = FakeEngine(max_num_seqs=4, step_delay=0.02)
    job = enqueue(q, prompt="x", max_tokens=60)
    run_worker(engine=engine)
    wait_for(lambda: len(stream_events(r, job.id)) >= 3, what="tokens")
    send_stop_job_command(r, job.id, serializer=JSONSerializer)
    wait_status(r, job, "stopped")
    assert check_stream(r, job.id, "canceled")[-1]["reason"] == "stopped"
    assert calls == [job.id, job.id] and job.id in engine.aborted and engine.steps < 60


@pytest.fixture
def rq(redis_server):
    worker = registered_rq_worker(redis_server, "watcher")
    yield worker
    worker.connection.close()


def test_a_check_never_reads_a_probe_sent_before_the_job_owed_it(rq, r):
    """A job handed back for RQ's handler after the probe went out is not covered by that probe's answer."""
    for i in range(2):
        Client(r).submit(f"p{i}", max_tokens=5)
    generating, finished = start_jobs(rq, 2)
    generating.phase, finished.phase = Phase.GENERATING, Phase.FINISHED
    running = {generating.id: generating, finished.id: finished}
    watch = Watch(probe_target(rq), check_interval=NEVER)
    watch.before_step(running)  # sent before a step
    finished.phase = Phase.CHECKING  # handed back by the retirer meanwhile...
    Client(r).cancel(finished.id)  # ...and canceled
    assert watch.due(running, engine_busy=True)
    first = watch.check(running)
    assert first.checked == [] and watch.due(running, engine_busy=False)  # still owed a check of its own
    watch.before_step(running)  # owed: sent at once despite the interval
    second = watch.check(running)
    assert second.checked == [finished] and not watch.due(running, engine_busy=True)
    assert [(f.run, f.verdict) for f in second.findings] == [(finished, Verdict.CANCELED)]


def test_timeouts_are_judged_at_each_check(rq, r):
    Client(r).submit("p", max_tokens=5, job_timeout=1)
    (run,) = start_jobs(rq, 1)
    run.phase = Phase.GENERATING
    watch = Watch(probe_target(rq), check_interval=NEVER)
    assert watch.check({run.id: run}).findings == []
    run.started_mono -= 2
    assert [f.verdict for f in watch.check({run.id: run}).findings] == [Verdict.TIMED_OUT]
    run.phase = Phase.FINISHED  # a finished job's result is stored, however late
    assert watch.check({run.id: run}).findings == []


def test_stop_commands_name_a_job_and_optionally_its_execution(rq, r):
    for i in range(2):
        Client(r).submit(f"p{i}", max_tokens=5)
    a, b = start_jobs(rq, 2)
    running = {a.id: a, b.id: b}
    watch = Watch(probe_target(rq), check_interval=NEVER)
    watch.stop_command(a.id)
    watch.stop_command(b.id, "another-execution")
    watch.stop_command("unknown-job")
    assert [(f.run, f.verdict) for f in watch.stops(running)] == [(a, Verdict.STOP)]
    watch.stop_command(b.id, b.execution.id)
    assert [f.run for f in watch.stops(running)] == [b] and watch.stops(running) == []
    # a job whose generation ended keeps its result (waiting to be stored, e.g. while Redis is full), as RQ's
    # worker lets a job that returned be stored
    a.phase = Phase.FINISHED
    watch.stop_command(a.id)
    assert watch.stops(running) == []
