"""`rose status`: a real subprocess against a real redis-server and rose-worker."""

from __future__ import annotations

import json
import subprocess

import pytest
from cli_helpers import SERVED, rose_cmd, wait_for
from rq import Queue
from rq.serializers import JSONSerializer

pytestmark = pytest.mark.timeout(300)


def test_status_counts_queues_and_lists_the_worker(rose, cli_redis, cli_worker) -> None:
    r = cli_redis.client()
    served = Queue("cli-status", connection=r, serializer=JSONSerializer)
    for i in range(2):
        res = rose("submit", "--queue", "cli-status", "--max-tokens", "3", f"hi {i}")
        assert res.returncode == 0, res.stderr
    bad = served.enqueue(
        "rose.jobs.generate", kwargs={"prompt": "x", "temprature": 1.0}
    )  # fails on the worker
    wait_for(lambda: served.failed_job_registry.get_job_count(cleanup=False) == 1, 60, f"job {bad.id} failed")
    idle = Queue("cli-status-idle", connection=r, serializer=JSONSerializer)
    for _ in range(3):
        idle.enqueue("rose.jobs.generate", kwargs={"prompt": "x"})

    res = rose("status", "--json")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    queues = {q["name"]: q for q in data["queues"]}
    assert queues["cli-status"] == {
        "name": "cli-status",
        "queued": 0,
        "running": 0,
        "finished": 2,
        "failed": 1,
        "canceled": 0,
    }
    assert queues["cli-status-idle"]["queued"] == 3 and queues["cli-status-idle"]["running"] == 0
    (worker,) = [w for w in data["workers"] if w["name"] == cli_worker.name]
    assert worker["rose"] is True
    assert worker["model"] == "tiny-llama" and worker["device"] == "cpu"
    assert worker["max_num_seqs"] == 16
    assert set(worker["queues"]) == set(SERVED)
    assert worker["uptime_s"] >= 0
    assert worker.get("num_running", 0) >= 0

    only = json.loads(rose("status", "--json", "--queue", "cli-status-idle").stdout)
    assert [q["name"] for q in only["queues"]] == ["cli-status-idle"]
    assert only["workers"] == []  # nobody serves it

    table = rose("status")
    assert table.returncode == 0, table.stderr
    assert "cli-status-idle" in table.stdout and cli_worker.name in table.stdout


def test_status_running_counts_a_running_job(rose, cli_worker) -> None:
    proc = subprocess.Popen(
        rose_cmd("submit", "--stream", "--max-tokens", "4000", "--ignore-eos", "a long one"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=rose.env,
    )
    try:
        job_id = proc.stdout.readline().strip()
        assert proc.stdout.read(1)  # streaming: it runs
        data = json.loads(rose("status", "--json", "--queue", "rose").stdout)
        assert data["queues"][0]["running"] >= 1
        # the worker's count is read from RQ's started registry now, not from its last heartbeat (seconds old)
        worker = next(w for w in data["workers"] if w["name"] == cli_worker.name)
        assert worker["running_jobs"] >= 1
        assert rose("cancel", job_id).returncode == 0
        assert proc.wait(120) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_status_unreachable_redis(unused_port) -> None:
    res = subprocess.run(
        rose_cmd("status", "--redis-url", f"redis://127.0.0.1:{unused_port}/0"),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert res.returncode != 0 and "cannot reach Redis" in res.stderr and "Traceback" not in res.stderr


def test_a_dead_workers_registration_does_not_count_as_serving(r) -> None:
    """A worker killed with SIGKILL leaves its name in the queue's worker set; its own key expires. rose submit's
    "no worker serves" warning must still come."""
    from rq import Worker

    from rose.cli.common import workers_serving

    worker = Worker([Queue("ghost", connection=r)], connection=r, name="ghost-worker")
    worker.register_birth()
    assert workers_serving(r, "ghost") == 1
    r.delete(worker.key)  # what expiry leaves after a SIGKILL: no death registered
    assert workers_serving(r, "ghost") == 0


def test_the_lora_table_has_a_row_per_adapter(capsys) -> None:
    from rose.cli.status import render

    lora = {
        "lora_tokens": {"sql": 80, "chat": 3},
        "lora_loads": {"sql": 2, "chat": 5},
        "lora_evictions": {"sql": 1},
    }
    plain = {"name": "w2", "state": "busy", "rose": True, "queues": ["rose"]}
    render({"queues": [], "workers": [{**plain, "name": "w1", **lora}, plain]})
    table = capsys.readouterr().out.split("LoRA adapters", 1)[1]
    rows = [line.replace("│", " ").split() for line in table.splitlines() if "w1" in line]
    assert rows == [["w1", "sql", "80", "2", "1"], ["w1", "chat", "3", "5"]]  # no eviction of chat reported
    assert "w2" not in table  # a worker without --enable-lora has no row
