"""rq-dashboard's workers list (`/<n>/data/workers.json`) of a busy rose-worker, with deploy/rq_dashboard_settings.py.

rq-dashboard (0.9.0, the newest) reads workers with `Worker.all(connection=...)`, without a serializer: on RQ 3 a busy
worker's `get_current_job()` fetches the job it runs with pickle, and `job.get_call_string()` of a rose job (JSON)
raises DeserializationError: HTTP 500. Nothing rose-worker writes can make a pickle read of a JSON job work; the
settings file makes the dashboard read workers with the JSON serializer.

rq-dashboard is not a test dependency: `dashboard_workers` makes the calls its `list_workers` makes (rq_dashboard/web.py,
`list_workers` and `serialize_current_job`) with RQ's API, on a stand-in for its `rq_dashboard.web` module. Where
rq-dashboard is installed, the last test runs the real one (its Flask app, the settings loaded from
RQ_DASHBOARD_SETTINGS)."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from rq import Worker
from rq.exceptions import DeserializationError
from rq.serializers import DefaultSerializer, JSONSerializer
from worker_helpers import FakeEngine, enqueue, wait_status

pytestmark = pytest.mark.timeout(60)

SETTINGS = Path(__file__).resolve().parents[2] / "deploy" / "rq_dashboard_settings.py"


def load_settings(monkeypatch: pytest.MonkeyPatch, web: Any) -> types.ModuleType:
    """Load the settings file as rq-dashboard does (Flask's `Config.from_pyfile`: exec'd in a fresh module), with
    `web` as the `rq_dashboard.web` it patches."""
    package = types.ModuleType("rq_dashboard")
    package.web = web  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "rq_dashboard", package)
    monkeypatch.setitem(sys.modules, "rq_dashboard.web", web)
    module = types.ModuleType("config")
    module.__file__ = str(SETTINGS)
    exec(compile(SETTINGS.read_bytes(), str(SETTINGS), "exec"), module.__dict__)
    return module


def dashboard_workers(web: Any, conn: Any) -> list[dict[str, Any]]:
    """What rq-dashboard 0.9.0's `/<n>/data/workers.json` builds, with `web.Worker` as its module's `Worker`."""
    out = []
    for worker in web.Worker.all(connection=conn):
        job = worker.get_current_job()
        current = "idle"
        if job is not None:
            current = dict(
                job_id=job.id,
                description=job.description,
                created_at=job.created_at,
                call_string=job.get_call_string(),
            )
        out.append(
            dict(
                name=worker.name,
                pid=worker.pid,
                queues=[q.name for q in worker.queues],
                state=str(worker.get_state()),
                current_job=current,
                last_heartbeat=worker.last_heartbeat,
                birth_date=worker.birth_date,
                successful_job_count=worker.successful_job_count,
                failed_job_count=worker.failed_job_count,
                total_working_time=worker.total_working_time,
                version=getattr(worker, "version", ""),
                python_version=getattr(worker, "python_version", ""),
            )
        )
    return out


@pytest.fixture
def busy(run_worker, r, q):
    """A rose-worker running two jobs: (its name, the jobs' ids)."""
    jobs = [enqueue(q, prompt="x", max_tokens=60) for _ in range(2)]
    wt = run_worker(engine=FakeEngine(max_num_seqs=4, step_delay=0.1))
    for job in jobs:
        wait_status(r, job, "started")
    return wt.worker.name, {job.id for job in jobs}


def test_the_dashboard_lists_a_busy_rose_worker_with_the_settings_file(busy, r, monkeypatch):
    name, job_ids = busy
    web = types.SimpleNamespace(Worker=Worker, config=types.SimpleNamespace(serializer=DefaultSerializer))
    with pytest.raises(DeserializationError):  # rq-dashboard as it ships: the 500
        dashboard_workers(web, r)

    settings = load_settings(monkeypatch, web)
    assert web.Worker is settings.JSONWorker
    assert web.config.serializer is JSONSerializer  # as `--json` sets it, for the job pages
    (seen,) = [w for w in dashboard_workers(web, r) if w["name"] == name]
    assert seen["state"] == "busy" and seen["queues"] == ["rose"]
    current = seen["current_job"]
    assert current["job_id"] in job_ids
    assert current["call_string"].startswith("rose.jobs.generate(")
    json.dumps(seen, default=str)


def test_the_settings_worker_reads_as_rq_does_otherwise(busy, r, monkeypatch):
    """The patched `Worker` only changes the serializer it reads with when none is given."""
    name, job_ids = busy
    settings = load_settings(monkeypatch, types.SimpleNamespace(Worker=Worker))
    (worker,) = [w for w in settings.JSONWorker.all(connection=r) if w.name == name]
    assert worker.serializer is JSONSerializer
    assert {e.job_id for e in worker.get_current_executions()} == job_ids
    given = settings.JSONWorker.find_by_key(worker.key, r, serializer=DefaultSerializer)
    assert given.serializer is DefaultSerializer


def test_the_real_rq_dashboard_with_the_settings_file(busy, r, redis_server, monkeypatch):
    pytest.importorskip("rq_dashboard.web", reason="rq-dashboard (and six, which it imports) not installed")
    from rq_dashboard import web
    from rq_dashboard.cli import make_flask_app

    name, job_ids = busy
    monkeypatch.setattr(web, "Worker", web.Worker)  # restored after the test: the settings file patches them
    monkeypatch.setattr(web.config, "serializer", web.config.serializer)

    def workers_json():
        app = make_flask_app(None, None, None, "")
        app.config["RQ_DASHBOARD_REDIS_URL"] = redis_server.url
        web.setup_rq_connection(app)
        return app.test_client().get("/0/data/workers.json")

    monkeypatch.delenv("RQ_DASHBOARD_SETTINGS", raising=False)
    assert workers_json().status_code == 500  # rq-dashboard as it ships
    monkeypatch.setenv("RQ_DASHBOARD_SETTINGS", str(SETTINGS))
    response = workers_json()
    assert response.status_code == 200, response.get_data(as_text=True)[:2000]
    (seen,) = [w for w in response.get_json()["workers"] if w["name"] == name]
    assert seen["state"] == "busy" and seen["current_job"]["job_id"] in job_ids
    assert seen["current_job"]["call_string"].startswith("rose.jobs.generate(")
