"""The Redis ACL lines of docs/deploy.md, verbatim, against a real redis-server: each role performs its documented
operations as its own user (worker: a RoseWorker running jobs end to end; producer: enqueue, stream, cancel, stop;
operator: `rq info`, `rq requeue`, `rose status`, stop), and nothing relies on the default user."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import redis
from rq import Queue
from rq.command import send_stop_job_command
from rq.job import Job
from rq.registry import FailedJobRegistry
from rq.serializers import JSONSerializer
from worker_helpers import FakeEngine, WorkerThread, enqueue, stream_events, wait_for, wait_status

from rose.jobs.client import Client

pytestmark = pytest.mark.timeout(120)

CHECKOUT = Path(__file__).resolve().parents[2]


def documented_acl() -> dict[str, list[str]]:
    """user name -> its rules, from the fenced block of docs/deploy.md's ACL section."""
    text = (CHECKOUT / "docs" / "deploy.md").read_text()
    block = re.search(r"\*\*Authentication \(ACL\)\.\*\*.*?```\n(.*?)```", text, re.S)
    assert block, "no ACL block in docs/deploy.md"
    users = {}
    for line in block.group(1).splitlines():
        words = line.split()
        if words and words[0] == "user":
            users[words[1]] = words[2:]
    return users


@pytest.fixture
def acl(new_redis_server):
    users = documented_acl()
    assert {"rose-worker", "producer", "operator", "default"} <= set(users)
    admin = new_redis_server.client()
    admin.execute_command("ACL", "SETUSER", "test-admin", "on", ">admin", "~*", "&*", "+@all")
    admin = redis.Redis(port=new_redis_server.port, username="test-admin", password="admin")
    for name, rules in users.items():
        admin.execute_command("ACL", "SETUSER", name, "reset", *rules)
    passwords = {
        name: next(r[1:] for r in rules if r.startswith(">"))
        for name, rules in users.items()
        if name != "default"
    }
    urls = {
        name: f"redis://{name}:{pw}@127.0.0.1:{new_redis_server.port}/0" for name, pw in passwords.items()
    }
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=new_redis_server.port).ping()  # the default user is off
    yield SimpleNamespace(urls=urls, admin=admin)
    admin.close()


def rq_cli(*args: str, url: str) -> subprocess.CompletedProcess:
    rq = [sys.executable, "-c", "import sys; from rq.cli import main; sys.exit(main())"]
    return subprocess.run(
        [*rq, *args, "-u", url], capture_output=True, text=True, timeout=60, env=checkout_env()
    )


def checkout_env() -> dict[str, str]:
    """This checkout first on the path, ahead of whatever PYTHONPATH already names (a GPU machine's wheels)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(CHECKOUT), os.environ.get("PYTHONPATH", "")])}


def test_documented_acl_lines_allow_every_documented_operation(acl):
    worker_url = acl.urls["rose-worker"]
    server = SimpleNamespace(url=worker_url, client=lambda: redis.Redis.from_url(worker_url))
    engine = FakeEngine(max_num_seqs=4, step_delay=0.02)
    wt = WorkerThread(server, ["rose"], engine, name="acl-worker").start()
    producer = redis.Redis.from_url(acl.urls["producer"])
    operator = redis.Redis.from_url(acl.urls["operator"])
    q = Queue("rose", connection=producer, serializer=JSONSerializer)

    # producer: enqueue (plain RQ and rose's client), stream, cancel, stop
    done = enqueue(q, prompt="a b", max_tokens=3)
    client = Client(producer)
    streamed = client.submit("x y", max_tokens=4)
    assert "".join(streamed.stream(timeout=30)) == "w0 w1 w2 w3 "
    assert streamed.result(timeout=30)["text"] == "w0 w1 w2 w3 "
    wait_status(producer, done, "finished")
    to_cancel = client.submit("c", max_tokens=60)
    to_stop = enqueue(q, prompt="s", max_tokens=60)
    wait_status(producer, to_stop, "started")
    wait_for(lambda: stream_events(producer, to_cancel.id), what="tokens")
    assert to_cancel.cancel()
    send_stop_job_command(producer, to_stop.id, serializer=JSONSerializer)
    wait_status(producer, to_stop, "stopped")
    wait_for(
        lambda: (
            Job.fetch(to_cancel.id, connection=producer, serializer=JSONSerializer).get_status() == "canceled"
        )
    )

    # operator: read (rq info, rose status, Job.fetch), requeue a failed job, stop a running one
    failed = enqueue(q, prompt="too long", max_tokens=500)  # over the fake context: fails
    wait_status(operator, failed, "failed")
    info = rq_cli("info", "-S", "json", url=acl.urls["operator"])
    assert info.returncode == 0 and "acl-worker" in info.stdout, info.stderr
    status = subprocess.run(
        [sys.executable, "-m", "rose", "status", "--redis-url", acl.urls["operator"]],
        capture_output=True,
        text=True,
        timeout=60,
        env=checkout_env(),
    )
    assert status.returncode == 0 and "acl-worker" in status.stdout, status.stdout + status.stderr
    requeue = rq_cli("requeue", "-S", "json", "--queue", "rose", failed.id, url=acl.urls["operator"])
    assert requeue.returncode == 0 and "Requeueing 1" in requeue.stdout, requeue.stdout + requeue.stderr
    wait_status(operator, failed, "failed")  # ran again (and failed again: still too long)
    assert (
        failed.id in FailedJobRegistry("rose", connection=operator, serializer=JSONSerializer).get_job_ids()
    )
    long = enqueue(q, prompt="l", max_tokens=60)
    wait_status(operator, long, "started")
    send_stop_job_command(operator, long.id, serializer=JSONSerializer)
    wait_status(operator, long, "stopped")

    # the worker did all of it as rose-worker, and stops cleanly (stop() raises what the worker raised); its line lets
    # it create a finished job's streams at their size (RESTORE: its first retirement asks), none refused
    wt.stop()
    restores = acl.admin.info("commandstats")["cmdstat_restore"]
    assert restores["calls"] >= 1 and restores["rejected_calls"] == 0 and restores["failed_calls"] == 0
