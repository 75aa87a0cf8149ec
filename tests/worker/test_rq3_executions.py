"""RQ 3's view of a rose-worker: every running job is an execution of the worker (Worker.all(),
get_current_executions(), current_execution_count), the state is busy while any runs, and both RQ stop commands
(send_stop_job_command, send_stop_execution_command) stop a job. Seen from another process's point of view: a
fresh connection, RQ's public API only."""

from __future__ import annotations

import pytest
from rq import Worker
from rq.command import send_stop_execution_command, send_stop_job_command
from rq.serializers import JSONSerializer
from worker_helpers import FakeEngine, check_stream, enqueue, wait_for, wait_status

pytestmark = pytest.mark.timeout(60)


def _rq_view(r, name: str) -> Worker:
    (worker,) = [w for w in Worker.all(connection=r, serializer=JSONSerializer) if w.name == name]
    return worker


def test_running_jobs_are_the_workers_executions_and_it_is_busy(run_worker, r, q):
    engine = FakeEngine(max_num_seqs=4, step_delay=0.02)
    jobs = [enqueue(q, prompt="x", max_tokens=40) for _ in range(3)]
    wt = run_worker(engine=engine)
    for job in jobs:
        wait_status(r, job, "started")
    seen = _rq_view(r, wt.worker.name)
    assert seen.get_state() == "busy"
    executions = seen.get_current_executions()
    assert sorted(e.job_id for e in executions) == sorted(j.id for j in jobs)
    assert seen.current_execution_count == 3
    assert all(e.worker_name == wt.worker.name for e in executions)
    for job in jobs:
        wait_status(r, job, "finished")
    wait_for(lambda: _rq_view(r, wt.worker.name).current_execution_count == 0, what="executions gone")
    wait_for(lambda: _rq_view(r, wt.worker.name).get_state() == "idle", what="worker idle")
    assert _rq_view(r, wt.worker.name).get_current_executions() == []


def test_both_rq_stop_commands_stop_a_job(run_worker, r, q):
    engine = FakeEngine(max_num_seqs=4, step_delay=0.02)
    a = enqueue(q, prompt="x", max_tokens=60)
    b = enqueue(q, prompt="x", max_tokens=60)
    wt = run_worker(engine=engine)
    wait_status(r, a, "started")
    wait_status(r, b, "started")
    send_stop_job_command(r, a.id, serializer=JSONSerializer)
    (execution,) = [e for e in _rq_view(r, wt.worker.name).get_current_executions() if e.job_id == b.id]
    send_stop_execution_command(r, b.id, execution.id)
    wait_status(r, a, "stopped")
    wait_status(r, b, "stopped")
    for job in (a, b):
        assert check_stream(r, job.id, "canceled")[-1]["reason"] == "stopped"
    wait_for(lambda: {a.id, b.id} <= set(engine.aborted), timeout=2, what="both jobs aborted")
    wait_for(lambda: _rq_view(r, wt.worker.name).current_execution_count == 0, what="executions gone")
