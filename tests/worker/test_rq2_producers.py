"""Producers on RQ 2.12 against rose-worker (RQ 3), without RQ 2 installed: the commands a real RQ 2.12 producer
sent are replayed verbatim on one raw connection, and the job is read back through exactly the keys and fields
RQ 2.12's `Job.fetch` / `get_status` / `return_value` / `exc_info` / `latest_result` read, decoded as RQ 2.12 does
(`rq.results.Result.restore`: `type`, base64 JSON `return_value`, base64 zlib `exc_string`).

The fixture, data/rq2_12_producer.json, was captured from a real rq 2.12.0 producer (redis-py 8.1.0) against a real
rose-worker on rq 3.0.0 (tiny-llama on CPU) by data/capture_rq2_producer.py; its docstring has the commands, e.g.

    /tmp/rq2venv/bin/python tests/worker/data/capture_rq2_producer.py P1 P2 rq2check \
        tests/worker/data/rq2_12_producer.json

Re-capture it the same way to check a later RQ 2.x (and keep the fixture's name in FIXTURE below in step)."""

from __future__ import annotations

import base64
import json
import re
import time
import uuid
import zlib
from datetime import UTC, datetime
from pathlib import Path

import pytest
import redis
from worker_helpers import FakeEngine, stream_events, wait_for

import rose.worker.worker

pytestmark = pytest.mark.timeout(30)

FIXTURE = json.loads((Path(__file__).parent / "data" / "rq2_12_producer.json").read_text())


def _pairs(reply) -> dict:
    """A hash / stream entry reply as a dict (a map under RESP3, a flat list under RESP2)."""
    return dict(reply) if isinstance(reply, dict) else dict(zip(reply[::2], reply[1::2], strict=True))


class RQ2Producer:
    """Replays the fixture's recorded commands of an RQ 2.12 producer, filling in its templates."""

    def __init__(self, client: redis.Redis, worker: str = "") -> None:
        kwargs = client.connection_pool.connection_kwargs
        self.conn = redis.Connection(
            **{k: v for k, v in kwargs.items() if k in ("host", "port", "db", "username", "password")}
        )
        self.worker = worker

    def close(self) -> None:
        self.conn.disconnect()

    def replay(self, name: str, job_id: str) -> list:
        """Send the recorded commands `name` (in order, MULTI/EXEC included) and return the replies. Values RQ 2.12
        took from an earlier reply are taken from the same reply here: the execution id (from `ZRANGE
        rq:executions:<id>`, as `Job.cancel` does) and the worker's name (from the job hash, as
        `send_stop_job_command` does)."""
        now = time.time()
        values = {
            "{job_id}": job_id,
            "{now_iso}": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
            "{now_ts}": repr(now),
            "{worker}": self.worker,
        }
        replies = []
        for cmd in FIXTURE[name]:
            args = []
            for arg in cmd:
                if isinstance(arg, dict):
                    args.append(base64.b64decode(arg["b64"]))
                    continue
                for template, value in values.items():
                    arg = arg.replace(template, value)
                arg = re.sub(r"\{now_ts([+-]\d+)\}", lambda m: repr(now + int(m.group(1))), arg)
                assert "{" not in arg or arg.startswith('{"'), f"unfilled template in {cmd}: {arg}"
                args.append(arg)
            self.conn.send_command(*args)
            reply = self.conn.read_response()
            replies.append(reply)
            if cmd[0] == "ZRANGE" and cmd[1].startswith("rq:executions:"):
                assert len(reply) == 1, reply  # rose runs a job as one execution
                values["{execution_id}"] = reply[0].decode()
            if cmd[0] == "HGETALL" and cmd[1] == "rq:job:{job_id}":
                fields = _pairs(reply)
                values["{worker}"] = fields.get(b"worker_name", b"").decode() or self.worker
        return replies

    def read_back(self, job_id: str) -> dict:
        """What RQ 2.12 sees of a job: its hash, its status and its latest result."""
        assert [c[0] for c in FIXTURE["read_back"]] == ["HGETALL", "HGET", "XREVRANGE", "XREVRANGE"]
        hgetall, status, latest, _ = self.replay("read_back", job_id)
        seen = {"hash": _pairs(hgetall), "status": status.decode()}
        seen["result"] = None
        if latest:
            (_, flat) = latest[0]
            payload = {k.decode(): v for k, v in _pairs(flat).items()}
            result = {"type": int(payload["type"])}  # rq 2.12 Result.Type: 1 successful, 2 failed, 3 stopped
            if payload.get("return_value"):
                result["return_value"] = json.loads(base64.b64decode(payload["return_value"]))
            if payload.get("exc_string"):
                result["exc_string"] = zlib.decompress(base64.b64decode(payload["exc_string"])).decode()
            seen["result"] = result
        return seen

    def wait_status(self, job_id: str, want: str, timeout: float = 10) -> dict:
        """Until both reads show `want`: the HGETALL comes before the HGET, so a job that ends between them would
        show its new status with the hash it had before (no ended_at yet)."""
        return wait_for(
            lambda: (
                (seen := self.read_back(job_id))["status"] == want
                and seen["hash"].get(b"status") == want.encode()
                and seen
            ),
            timeout,
            what=f"{job_id} {want}",
        )


class HoldingEngine(FakeEngine):
    """A FakeEngine whose steps make no tokens while `hold` is set: its jobs run until canceled or stopped."""

    def __init__(self) -> None:
        super().__init__()
        self.hold = True

    def step(self):
        if self.hold:
            time.sleep(0.005)
            return []
        return super().step()


@pytest.fixture(autouse=True)
def quick_stop(monkeypatch):
    """An idle worker blocks on its queues for at most 0.1 s instead of 1 s: it stops sooner (keeps this file fast)."""
    monkeypatch.setattr(rose.worker.worker, "IDLE_BLOCK_S", 0.1)


@pytest.fixture
def producer(r):
    p = RQ2Producer(r)
    yield p
    p.close()


def new_id() -> str:
    return str(uuid.uuid4())


def test_rq2_enqueued_jobs_run_and_rq2_reads_their_results(run_worker, producer, r):
    good, bad = new_id(), new_id()
    engine = FakeEngine()
    run_worker(engine=engine)
    producer.replay("enqueue", good)
    producer.replay("enqueue_bad", bad)

    seen = producer.wait_status(good, "finished")
    assert seen["result"]["type"] == 1, seen  # SUCCESSFUL
    result = seen["result"]["return_value"]
    assert result["text"] == "w0 w1 w2 " and result["token_ids"] == [0, 1, 2], result  # max_tokens=3 kept
    assert result["finish_reason"] == "length"
    assert set(FIXTURE["read_back_seen"]["return_value"]) <= set(
        result
    )  # what rq 2.12 saw from the real worker
    job = seen["hash"]
    assert job[b"meta"] == b'{"who": "rq2"}' and job[b"timeout"] == b"120" and job[b"result_ttl"] == b"600"
    assert job[b"worker_name"] and job[b"started_at"] and job[b"ended_at"], job
    assert good in engine.added
    assert r.zscore("rq:finished:rose", good) is not None
    assert 0 < r.ttl(f"rq:job:{good}") <= 600  # the producer's result_ttl

    seen = producer.wait_status(bad, "failed")
    assert seen["result"]["type"] == 2, seen  # FAILED; rq 2.12's job.exc_info is this exc_string
    assert "unknown field 'max_token'" in seen["result"]["exc_string"]
    assert "unknown field 'max_token'" in FIXTURE["read_back_failed_seen"]["exc_info"]
    assert bad not in engine.added and r.zscore("rq:failed:rose", bad) is not None


def _layout(r, job_id: str) -> dict:
    out = {}
    for key in sorted(k.decode() for k in r.scan_iter()):
        kind = r.type(key).decode()
        out[key.replace(job_id, "{job_id}")] = {
            "hash": lambda k: sorted(f.decode() for f in r.hkeys(k)),
            "list": lambda k: [v.decode().replace(job_id, "{job_id}") for v in r.lrange(k, 0, -1)],
            "set": lambda k: sorted(v.decode() for v in r.smembers(k)),
            "zset": lambda k: [v.decode().replace(job_id, "{job_id}") for v in r.zrange(k, 0, -1)],
        }[kind](key)
    return out


def _fixture_layout(name: str) -> dict:
    return {
        k: sorted(v["value"]) if v["type"] in ("hash", "set") else v["value"]
        for k, v in FIXTURE[name].items()
    }


def test_rq2_cancel_and_stop_are_honoured(run_worker, producer, r):
    """A queued job canceled (the replay leaves what the real RQ 2.12 enqueue / cancel left) never runs; a running
    job canceled with `job.cancel()` or stopped with `send_stop_job_command` is aborted, never stored as finished,
    and its slot freed."""
    queued = new_id()
    producer.replay("enqueue", queued)
    assert _layout(r, queued) == _fixture_layout("enqueue_keyspace")
    producer.replay("cancel_queued", queued)
    assert _layout(r, queued) == _fixture_layout("cancel_queued_keyspace")
    engine = HoldingEngine()
    wt = run_worker(engine=engine)

    _cancel_running(producer, r, engine, wt.worker.name, "cancel_running", "canceled")
    _cancel_running(producer, r, engine, wt.worker.name, "stop_running", "stopped")

    engine.hold = False  # the slots are free: the next RQ 2.12 job runs
    after = new_id()
    producer.replay("enqueue", after)
    assert producer.wait_status(after, "finished")["result"]["return_value"]["token_ids"] == [0, 1, 2]
    assert producer.read_back(queued)["status"] == "canceled"
    assert queued not in engine.added and r.xlen(f"rq:results:{queued}") == 0


def _cancel_running(producer, r, engine, worker_name: str, how: str, status: str) -> None:
    job_id = new_id()
    producer.replay("enqueue", job_id)
    wait_for(lambda: producer.read_back(job_id)["status"] == "started" and job_id in engine.added, 5)
    wait_for(lambda: r.zcard("rq:wip:rose"), 5, what="job in StartedJobRegistry")
    assert producer.read_back(job_id)["hash"][b"worker_name"].decode() == worker_name  # what RQ 2.12 uses
    producer.replay(how, job_id)
    seen = producer.wait_status(job_id, status, 5)
    wait_for(lambda: job_id in engine.aborted, 5, what=f"engine abort ({how})")
    assert seen["result"] is None or seen["result"]["type"] != 1, seen  # never stored as finished
    wait_for(lambda: r.zcard("rq:wip:rose") == 0, 5, what=f"StartedJobRegistry empty ({how})")
    assert r.zscore("rq:finished:rose", job_id) is None
    wait_for(
        lambda: [e["type"] for e in stream_events(r, job_id)][-1:] == ["canceled"], 5, what="canceled event"
    )
