"""Capture what an RQ 2.x producer sends to Redis, for tests/worker/test_rq2_producers.py (not a test; run by hand
with an RQ 2 interpreter, never in CI).

    python3 -m venv /tmp/rq2venv && /tmp/rq2venv/bin/pip install rq==2.12.0 redis
    redis-server --port P1 --save '' --daemonize yes    # empty, no worker: the enqueues are captured there
    redis-server --port P2 --save '' --daemonize yes    # a rose-worker (RQ 3) serves queue `rose` here:
    python3 -m rose.worker.cli --redis-url redis://127.0.0.1:P2/0 --name rq2check --model tiny-llama --device cpu &
    /tmp/rq2venv/bin/python tests/worker/data/capture_rq2_producer.py P1 P2 rq2check tests/worker/data/rq2_12_producer.json

Every command the producer's connections send is recorded client-side (redis-py's `send_command` /
`pack_commands`: exactly what goes over the wire, MULTI/EXEC included), then per-job values are templated: the job
id -> {job_id}, the worker's name -> {worker}, ISO timestamps -> {now_iso}, unix timestamps -> {now_ts} (or
{now_ts+N}), RQ execution ids -> {execution_id}; arguments that are not UTF-8 (the zlib `data` field) are stored as
{"b64": ...}. The keyspace an enqueue leaves on the empty server is stored too (same templates).
"""

import base64
import json
import re
import sys
import time

import redis
import redis.connection
import rq
from rq import Queue, Retry
from rq.command import send_stop_job_command
from rq.job import Job
from rq.serializers import JSONSerializer

RECORD: list | None = None
_AC = redis.connection.AbstractConnection
_send, _packs = _AC.send_command, _AC.pack_commands


def _record(conn, args):
    if RECORD is not None:
        RECORD.append([conn.encoder.encode(a) for a in args])


def send_command(self, *args, **kwargs):
    _record(self, args)
    return _send(self, *args, **kwargs)


def pack_commands(self, commands):
    commands = list(commands)
    for cmd in commands:
        _record(self, cmd)
    return _packs(self, commands)


_AC.send_command, _AC.pack_commands = send_command, pack_commands

HEX32 = re.compile(rb"(?<![0-9a-f])[0-9a-f]{32}(?![0-9a-f])")
ISO = re.compile(rb"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z")


def template(cmds, job_id, worker):
    out = []
    for cmd in cmds:
        row = []
        for a in cmd:
            a = a.replace(job_id.encode(), b"{job_id}").replace(worker.encode(), b"{worker}")
            a = ISO.sub(b"{now_iso}", a)
            a = HEX32.sub(b"{execution_id}", a)
            try:
                offset = round(float(a) - time.time())
                if abs(offset) < 3600 * 24 * 400:
                    a = b"{now_ts}" if abs(offset) < 5 else b"{now_ts%+d}" % offset
            except ValueError:
                pass
            try:
                row.append(a.decode())
            except UnicodeDecodeError:
                row.append({"b64": base64.b64encode(a).decode()})
        out.append(row)
    return out


def rec(fn):
    global RECORD
    RECORD = []
    try:
        value = fn()
    finally:
        cmds, RECORD = RECORD, None
    return value, [c for c in cmds if c[0].upper() not in (b"CLIENT", b"HELLO")]


def wait(job, want, t=120):
    deadline = time.time() + t
    while job.get_status(refresh=True) not in want:
        assert time.time() < deadline, (job.id, job.get_status())
        time.sleep(0.05)


def keyspace(conn, job_id):
    keys = {}
    for k in sorted(conn.keys()):
        t = conn.type(k).decode()
        if t == "hash":
            v = {
                f.decode(): (x.decode() if f != b"data" else "<zlib json>")
                for f, x in conn.hgetall(k).items()
            }
        elif t == "list":
            v = [x.decode() for x in conn.lrange(k, 0, -1)]
        elif t == "set":
            v = sorted(x.decode() for x in conn.smembers(k))
        else:
            v = [m.decode() for m in conn.zrange(k, 0, -1)]
        keys[k.decode().replace(job_id, "{job_id}")] = {
            "type": t,
            "value": json.loads(ISO.sub(b"{now_iso}", json.dumps(v).replace(job_id, "{job_id}").encode())),
        }
    return keys


def main(empty_port, worker_port, worker, out_path):
    G = "rose.jobs.generate"
    KW = {"prompt": "Hello from RQ 2", "max_tokens": 3, "temperature": 0}
    BAD = {"prompt": "x", "max_token": 3}
    fx = {"rq_version": rq.__version__, "redis_py_version": redis.__version__, "queue": "rose"}

    # 1. enqueues on an empty server (commands + the keys they leave); a queued job canceled
    e = redis.Redis(port=empty_port)
    eq = Queue("rose", connection=e, serializer=JSONSerializer)
    e.flushall()
    opts = dict(
        job_timeout=120,
        result_ttl=600,
        failure_ttl=900,
        retry=Retry(max=2, interval=[1]),
        meta={"who": "rq2"},
    )
    job, cmds = rec(lambda: eq.enqueue(G, kwargs=KW, **opts))
    fx["enqueue_call"] = f"Queue('rose', serializer=JSONSerializer).enqueue({G!r}, kwargs={KW!r}, **{opts!r})"
    fx["enqueue"] = template(cmds, job.id, worker)
    fx["enqueue_keyspace"] = keyspace(e, job.id)
    _, cmds = rec(lambda: job.cancel())
    fx["cancel_queued_call"] = "job.cancel()"
    fx["cancel_queued"] = template(cmds, job.id, worker)
    fx["cancel_queued_keyspace"] = keyspace(e, job.id)
    e.flushall()
    job, cmds = rec(lambda: eq.enqueue(G, kwargs=BAD))
    fx["enqueue_bad_call"] = f"Queue('rose', serializer=JSONSerializer).enqueue({G!r}, kwargs={BAD!r})"
    fx["enqueue_bad"] = template(cmds, job.id, worker)
    e.flushall()

    # 2. against the rose-worker: how a job is read back (finished, failed), a running job canceled / stopped
    r = redis.Redis(port=worker_port)
    q = Queue("rose", connection=r, serializer=JSONSerializer)
    j = q.enqueue(G, kwargs=KW)
    wait(j, ("finished", "failed"))

    def read_back(job_id):
        f = Job.fetch(job_id, connection=r, serializer=JSONSerializer)
        return f.get_status(refresh=True), f.return_value(refresh=True), f.exc_info, f.latest_result()

    (st, rv, _, lr), cmds = rec(lambda: read_back(j.id))
    assert st == "finished" and isinstance(rv, dict) and lr.type == lr.Type.SUCCESSFUL, (st, rv, lr)
    fx["read_back_call"] = "f = Job.fetch(id, serializer=JSONSerializer); f.get_status(refresh=True); "
    fx["read_back_call"] += "f.return_value(refresh=True); f.exc_info; f.latest_result()"
    fx["read_back"] = template(cmds, j.id, worker)
    fx["read_back_seen"] = {"status": st.value, "return_value": rv, "latest_result_type": lr.type.name}

    b = q.enqueue(G, kwargs=BAD)
    wait(b, ("failed",))
    (st, _, exc, lr), cmds = rec(lambda: read_back(b.id))
    assert st == "failed" and "max_token" in exc and lr.type == lr.Type.FAILED, (st, exc, lr)
    assert template(cmds, b.id, worker) == fx["read_back"]
    fx["read_back_failed_seen"] = {"status": st.value, "exc_info": exc, "latest_result_type": lr.type.name}

    long = q.enqueue(G, kwargs={"prompt": "a long one", "max_tokens": None})
    wait(long, ("started",))
    _, cmds = rec(lambda: long.cancel())
    wait(long, ("canceled",))
    fx["cancel_running_call"] = "job.cancel()"
    fx["cancel_running"] = template(cmds, long.id, worker)

    long = q.enqueue(G, kwargs={"prompt": "another long one", "max_tokens": None})
    wait(long, ("started",))
    _, cmds = rec(lambda: send_stop_job_command(r, long.id, serializer=JSONSerializer))
    wait(long, ("stopped",), 20)
    fx["stop_running_call"] = "send_stop_job_command(r, job.id, serializer=JSONSerializer)"
    fx["stop_running"] = template(cmds, long.id, worker)

    with open(out_path, "w") as fh:
        json.dump(fx, fh, indent=1)
        fh.write("\n")
    print("written", out_path)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
