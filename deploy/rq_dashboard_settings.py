"""rq-dashboard settings for queues that rose-worker serves: start rq-dashboard with
`RQ_DASHBOARD_SETTINGS=/path/to/rq_dashboard_settings.py` (its CLI and its WSGI app factory both load it, with
Flask's `config.from_pyfile`). It needs rq and rq-dashboard only, not rose.

rose jobs are stored with RQ's JSONSerializer. rq-dashboard's `--json` (`RQ_DASHBOARD_JSON`,
`RQ_DASHBOARD_JSON_SERIALIZER`) covers its job and queue pages, but not its workers list: `/<n>/data/workers.json`
(rq-dashboard 0.9.0 and earlier) reads workers with `Worker.all(connection=...)`, so on RQ 3 the job a busy worker
runs is fetched with RQ's default serializer, pickle, and `job.get_call_string()` raises `DeserializationError`:
HTTP 500 while any rose-worker is busy (its Workers tab fails to load). This file makes rq-dashboard read
workers, as well as jobs, with the JSON serializer. See docs/operations.md ("rq-dashboard").
"""

from rq import Worker
from rq.serializers import JSONSerializer


class JSONWorker(Worker):
    """RQ's `Worker`, read back (`Worker.all`, `Worker.find_by_key`) with RQ's JSONSerializer unless a serializer is
    given: its `get_current_job()` then reads a rose job as rose-worker does."""

    @classmethod
    def find_by_key(cls, worker_key, connection, job_class=None, queue_class=None, serializer=None):
        return super().find_by_key(
            worker_key,
            connection,
            job_class=job_class,
            queue_class=queue_class,
            serializer=serializer or JSONSerializer,
        )


try:
    import rq_dashboard.web as _dashboard
except ImportError:  # loaded outside rq-dashboard (a test): nothing to set
    _dashboard = None

if _dashboard is not None:
    _dashboard.Worker = JSONWorker  # what its worker pages call (`Worker.all(connection=...)`)
    if hasattr(_dashboard, "config"):  # what `--json` sets, for the job pages (rq-dashboard >= 0.6.7)
        _dashboard.config.serializer = JSONSerializer
