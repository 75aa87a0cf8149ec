"""Job lifecycle log lines and `--log-format json`."""

from __future__ import annotations

import io
import json
import logging

import pytest
from rq.job import Job
from rq.serializers import JSONSerializer
from worker_helpers import FakeEngine, stream_events, wait_for

from rose.config import WorkerSettings
from rose.worker.cli import build_parser, load_settings
from rose.worker.logs import JsonFormatter, setup_logging

pytestmark = pytest.mark.timeout(60)


def enqueue(q, **kwargs):
    return q.enqueue("rose.jobs.generate", kwargs=kwargs)


def test_json_formatter_one_object_per_line_with_extra_fields():
    record = logging.LogRecord("rose.worker.x", logging.INFO, __file__, 1, "job %s done", ("j1",), None)
    record.__dict__.update({"event": "finished", "job_id": "j1", "ttft_s": 0.25})
    line = JsonFormatter().format(record)
    assert "\n" not in line
    entry = json.loads(line)
    assert (
        entry["message"] == "job j1 done" and entry["level"] == "INFO" and entry["logger"] == "rose.worker.x"
    )
    assert entry["event"] == "finished" and entry["job_id"] == "j1" and entry["ttft_s"] == 0.25
    assert entry["timestamp"].endswith("+00:00")
    try:
        raise ValueError("boom\nline 2")
    except ValueError:
        import sys

        record.exc_info = sys.exc_info()
    assert "boom" in json.loads(JsonFormatter().format(record))["exc_info"]


def test_setup_logging_json_and_text():
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    try:
        out = io.StringIO()
        setup_logging("INFO", "json", stream=out)
        logging.getLogger("rose.worker.t").info("hello %d", 1, extra={"job_id": "a"})
        logging.getLogger("rose.worker.t").debug("hidden")
        (line,) = out.getvalue().splitlines()
        assert json.loads(line)["job_id"] == "a"
        out = io.StringIO()
        setup_logging("DEBUG", "text", stream=out)
        logging.getLogger("rose.worker.t").debug("plain")
        assert out.getvalue().rstrip().endswith("DEBUG rose.worker.t: plain")
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])


def test_flags_and_env(monkeypatch):
    monkeypatch.setenv("ROSE_LOG_FORMAT", "JSON")
    monkeypatch.setenv("ROSE_METRICS_PORT", "9400")
    settings, _ = load_settings([])
    assert settings.log_format == "json" and settings.metrics_port == 9400
    settings, _ = load_settings(["--log-format", "text", "--metrics-port", "9500"])
    assert settings.log_format == "text" and settings.metrics_port == 9500
    monkeypatch.delenv("ROSE_METRICS_PORT")
    assert WorkerSettings().metrics_port is None
    text = build_parser().format_help()
    assert "--metrics-port" in text and "--log-format" in text and "ROSE_METRICS_PORT" in text


def test_rose_worker_version_and_a_misspelled_flag(capsys):
    with pytest.raises(SystemExit) as ended:
        load_settings(["--version"])
    assert ended.value.code == 0 and capsys.readouterr().out.startswith("rose-worker ")
    with pytest.raises(SystemExit) as ended:
        load_settings(["--modle", "tiny-llama"])
    assert ended.value.code == 2
    assert (
        "unrecognized arguments: --modle tiny-llama (--modle: did you mean --model?)"
        in capsys.readouterr().err
    )


def test_one_line_per_job_lifecycle_event(run_worker, r, q, caplog):
    caplog.set_level(logging.INFO, logger="rose.worker")
    engine = FakeEngine(max_num_seqs=3, step_delay=0.02)
    ok = enqueue(q, prompt="a b", max_tokens=3)
    bad = enqueue(q, prompt="x", max_tokens=3, temprature=1.0)
    canceled = enqueue(q, prompt="x", max_tokens=60)
    requeued = enqueue(q, prompt="x", max_tokens=60)
    wt = run_worker(engine=engine, drain_timeout=60)
    wait_for(lambda: r.hget(ok.key, "status") == b"finished", 30, what="finished")
    wait_for(lambda: len(stream_events(r, canceled.id)) >= 2, 30, what="streaming")
    Job.fetch(canceled.id, connection=r, serializer=JSONSerializer).cancel()
    wait_for(lambda: stream_events(r, canceled.id)[-1]["type"] == "canceled", 30, what="canceled")
    wait_for(lambda: len(stream_events(r, requeued.id)) >= 1, 30, what="streaming")
    wt.stop(force=True)

    entries = [json.loads(JsonFormatter().format(rec)) for rec in caplog.records]
    by_job: dict[str, list[dict]] = {}
    for e in entries:
        if "job_id" in e:
            by_job.setdefault(e["job_id"], []).append(e)
    assert [e["event"] for e in by_job[ok.id]] == ["taken", "first_token", "finished"]
    assert [e["event"] for e in by_job[bad.id]] == ["taken", "failed"]
    assert [e["event"] for e in by_job[canceled.id]] == ["taken", "first_token", "canceled"]
    assert [e["event"] for e in by_job[requeued.id]] == ["taken", "first_token", "requeued"]
    assert all(e["queue"] == "rose" and e["level"] in ("INFO", "WARNING") for e in entries if "job_id" in e)
    done = by_job[ok.id][-1]
    assert done["finish_reason"] == "length" and done["prompt_tokens"] == 2 and done["completion_tokens"] == 3
    assert {"queue_s", "ttft_s", "generation_s"} <= set(done)
    assert by_job[ok.id][1]["ttft_s"] >= 0 and by_job[ok.id][0]["queue_s"] >= 0
    assert "unknown field" in by_job[bad.id][-1]["error"] and by_job[bad.id][-1]["level"] == "WARNING"
    assert (
        by_job[canceled.id][-1]["completion_tokens"] >= 1 and by_job[canceled.id][-1]["reason"] == "canceled"
    )
    assert by_job[requeued.id][-1]["reason"] == "shutdown"
