"""The publisher thread: one atomic round trip per batch, in order, exactly once, never blocking the caller."""

from __future__ import annotations

import json
import time

import pytest
import redis

from rose.jobs import keys
from rose.worker.publisher import KEEP_TTL, NO_EXPIRY, Outgoing, Publisher

pytestmark = pytest.mark.timeout(30)


def ev(job_id: str, seq: int) -> Outgoing:
    data = json.dumps({"job_id": job_id, "type": "token", "seq": seq, "text": f"t{seq}", "token_ids": [seq]})
    return Outgoing(job_id, data, 100)


def seqs(r, job_id: str) -> list[int]:
    return [json.loads(f[b"event"])["seq"] for _, f in r.xrange(keys.stream_key(job_id))]


def test_batches_reach_stream_and_pubsub_in_order(r):
    sub = r.pubsub()
    sub.subscribe(keys.tokens_channel("a"))
    sub.get_message(timeout=1)
    pub = Publisher(r).start()
    for i in range(0, 50, 5):
        pub.send([ev("a", s) for s in range(i, i + 5)] + [ev("b", i)])
    assert pub.flush(timeout=5)
    pub.close()
    assert seqs(r, "a") == list(range(50))
    assert seqs(r, "b") == list(range(0, 50, 5))
    assert 90 <= r.ttl(keys.stream_key("a")) <= 100
    heard = []
    while (msg := sub.get_message(timeout=0.5)) is not None:
        if msg["type"] == "message":
            heard.append(json.loads(msg["data"])["seq"])
    assert heard == list(range(50))


def test_a_retried_batch_is_not_applied_twice(r):
    pub = Publisher(r)
    pub._write([ev("a", 0), ev("a", 1)])
    pub._batch_no -= 1  # as if the reply of that call had been lost and the same batch were sent again
    pub._write([ev("a", 0), ev("a", 1)])
    pub._write([ev("a", 2)])
    assert seqs(r, "a") == [0, 1, 2]


def test_persist_when_result_ttl_is_infinite(r):
    pub = Publisher(r)
    pub._write([Outgoing("p", json.dumps({"job_id": "p", "type": "reset"}), NO_EXPIRY)])
    assert r.ttl(keys.stream_key("p")) == -1


def test_send_never_blocks_even_when_redis_is_down(unused_port):
    dead = redis.Redis(port=unused_port, socket_connect_timeout=0.2)
    pub = Publisher(dead, max_backoff=0.2).start()
    t = time.monotonic()
    for i in range(100):
        pub.send([ev("a", i)])
    assert time.monotonic() - t < 0.1
    assert pub.flush(timeout=0.5) is False  # still retrying, nothing dropped
    assert pub.backlog > 0
    pub.close(timeout=0.5)


def test_keep_ttl_leaves_the_streams_expiry_alone(r):
    pub = Publisher(r)
    pub._write([ev("k", 0)])  # a job's first event sets the expiry
    assert 90 <= r.ttl(keys.stream_key("k")) <= 100
    r.expire(keys.stream_key("k"), 50)
    pub._write([Outgoing("k", ev("k", 1).data, KEEP_TTL)])
    assert 40 <= r.ttl(keys.stream_key("k")) <= 50
    pub._write([ev("k", 2)])  # a refresh or a terminal event sets it again
    assert r.ttl(keys.stream_key("k")) > 50
    assert seqs(r, "k") == [0, 1, 2]
