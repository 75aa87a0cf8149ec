"""The publisher: one atomic command per batch, sent at once and acknowledged later, in order, exactly once, never
waiting for Redis (nor blocking the caller while Redis is down)."""

from __future__ import annotations

import json
import time

import pytest
import redis

from rose.harness.worker_process import wait_for
from rose.jobs import keys
from rose.jobs.events import entry_dict, token_entry, token_event_json
from rose.worker import publisher as publisher_mod
from rose.worker.publisher import KEEP_TTL, NO_EXPIRY, Outgoing, Publisher

pytestmark = pytest.mark.timeout(30)


def ev(job_id: str, seq: int, ttl: int | None = 100) -> Outgoing:
    """A token event as the worker sends it: its JSON, and its fields for the stream."""
    text, ids = f"t{seq}", [seq]
    return Outgoing(job_id, token_event_json(seq, text, ids), ttl, token=token_entry(seq, text, ids))


def seqs(r, job_id: str) -> list[int]:
    return [entry_dict(f)["seq"] for _, f in r.xrange(keys.stream_key(job_id))]


def test_batches_reach_stream_and_pubsub_in_order(r):
    sub = r.pubsub()
    sub.subscribe(keys.tokens_channel("a"))
    sub.get_message(timeout=1)
    pub = Publisher(r)
    for i in range(0, 50, 5):
        pub.send([ev("a", s) for s in range(i, i + 5)] + [ev("b", i)])
    assert pub.flush(timeout=5)
    assert pub.backlog == 0 and pub.sent_events == 60
    pub.close()
    assert seqs(r, "a") == list(range(50))
    assert seqs(r, "b") == list(range(0, 50, 5))
    assert 90 <= r.ttl(keys.stream_key("a")) <= 100
    heard = []
    while (msg := sub.get_message(timeout=0.5)) is not None:
        if msg["type"] == "message":
            heard.append(json.loads(msg["data"])["seq"])
    assert heard == list(range(50))


def test_token_events_are_stored_as_their_fields_and_the_others_as_json(r):
    """A plain token event is stored as its fields (Redis keeps their names once a node); an event with more keys
    (logprobs, a choice's index) and every other event as its JSON, and pub/sub gets every event's JSON."""
    sub = r.pubsub()
    sub.subscribe(keys.tokens_channel("a"))
    sub.get_message(timeout=1)
    reset = '{"type":"reset","reason":"restart"}'
    with_index = token_event_json(1, "b", [8], index=0)
    done = '{"type":"done","seq":2,"finish_reason":"stop","usage":{"prompt_tokens":1,"completion_tokens":3}}'
    r.hset(keys.SEALS_KEY, "a", "w")
    sent = [
        Outgoing("a", reset, 100),
        Outgoing("a", token_event_json(0, " é,", [5, 70000]), 50, token=token_entry(0, " é,", [5, 70000])),
        Outgoing("a", with_index, KEEP_TTL),
        Outgoing("a", done, 60, seals=True),
    ]
    pub = Publisher(r)
    pub.send(sent)
    assert pub.flush(timeout=5)
    pub.close()
    stored = [fields for _, fields in r.xrange(keys.stream_key("a"))]
    assert stored == [
        {b"event": reset.encode()},
        {b"seq": b"0", b"text": " é,".encode(), b"token_ids": b"5,70000"},
        {b"event": with_index.encode()},
        {b"event": done.encode()},
    ]
    assert [entry_dict(f) for f in stored] == [json.loads(e.data) for e in sent]
    assert 50 < r.ttl(keys.stream_key("a")) <= 60 and not r.hexists(
        keys.SEALS_KEY, "a"
    )  # the seal's spec held
    heard = []
    while (msg := sub.get_message(timeout=0.5)) is not None:
        if msg["type"] == "message":
            heard.append(msg["data"].decode())
    assert heard == [e.data for e in sent]


def test_send_does_not_wait_for_the_reply(r):
    pub = Publisher(r)
    pub.send([ev("a", 0)])
    assert pub.backlog == 1  # sent, reply not read yet
    wait_for(lambda: seqs(r, "a") == [0], 5, "event 0 in the stream")  # Redis applied it all the same
    # the reply is collected later, by poll (it may reach the socket a moment after the effect is visible)
    wait_for(lambda: pub.poll() or pub.backlog == 0, 5, "the reply to be read")
    assert pub.sent_events == 1
    pub.close()


def test_a_lost_connection_loses_and_repeats_nothing(r):
    pub = Publisher(r)
    pub.send([ev("a", 0), ev("a", 1)])
    wait_for(lambda: seqs(r, "a") == [0, 1], 5, "events 0, 1 in the stream")  # applied, reply unread...
    r.client_kill_filter(_type="normal", skipme=True)  # ...and lost with the connection
    for i in range(2, 6):
        pub.send([ev("a", i)])
    assert pub.flush(timeout=10)
    assert seqs(r, "a") == list(range(6))
    pub.close()


def test_persist_when_result_ttl_is_infinite(r):
    pub = Publisher(r)
    pub.send([Outgoing("p", json.dumps({"job_id": "p", "type": "reset"}), NO_EXPIRY)])
    assert pub.flush(timeout=5)
    assert r.ttl(keys.stream_key("p")) == -1


def test_send_never_blocks_even_when_redis_is_down(unused_port):
    dead = redis.Redis(port=unused_port, socket_connect_timeout=0.2)
    pub = Publisher(dead, max_backoff=0.2)
    t = time.monotonic()
    for i in range(100):
        pub.send([ev("a", i)])
    assert time.monotonic() - t < 0.5
    assert pub.flush(timeout=0.5) is False  # still retrying, nothing dropped
    assert pub.backlog == 100
    pub.close(timeout=0.1)
    assert pub.backlog == 0


def test_events_kept_while_redis_is_down_are_written_when_it_is_back(persistent_redis_server):
    redis_server = persistent_redis_server
    pub = Publisher(redis_server.client(), max_backoff=0.2)
    pub.send([ev("a", 0)])
    assert pub.flush(timeout=5)
    redis_server.stop()
    for i in range(1, 4):
        pub.send([ev("a", i)])
    assert pub.backlog > 0
    redis_server.start()
    assert pub.flush(timeout=10)
    assert seqs(redis_server.client(), "a") == [0, 1, 2, 3]
    pub.close()


def test_waits_for_redis_when_too_many_batches_are_unanswered(r, monkeypatch):
    monkeypatch.setattr(publisher_mod, "MAX_IN_FLIGHT", 3)
    pub = Publisher(r)
    for i in range(10):
        pub.send([ev("a", i)])
        assert pub.backlog <= 3
    assert pub.flush(timeout=5)
    assert seqs(r, "a") == list(range(10))


def test_a_refused_batch_is_dropped_not_retried(r, caplog):
    pub = Publisher(r)
    pub.send([ev("a", 0)])
    assert pub.flush(timeout=5)
    r.set(keys.stream_key("x"), "not a stream")  # XADD on it fails inside the script
    pub.send([ev("x", 0)])
    pub.send([ev("a", 1)])
    assert pub.flush(timeout=5)
    assert seqs(r, "a") == [0, 1]
    assert "refused" in caplog.text
    # the loop repairs its stream
    assert pub.take_dropped() == ({"x"}, set()) and pub.take_dropped() == (set(), set())
    assert pub.acked == 3 and not pub.lost


def test_a_batch_a_full_redis_refused_is_named_apart_and_its_gap_is_no_loss(r, caplog):
    pub = Publisher(r)
    pub.send([ev("a", 0)])
    assert pub.flush(timeout=5)
    r.config_set("maxmemory-policy", "noeviction")
    r.config_set("maxmemory", 1)  # below what Redis holds: every write refused
    try:
        pub.send([ev("a", 1), ev("b", 0)])
        pub.send([ev("a", 2)])
        assert pub.flush(timeout=5)
    finally:
        r.config_set("maxmemory", 0)
    assert pub.take_dropped() == (set(), {"a", "b"})  # their streams start over (rose.worker.loop)
    pub.send([ev("a", 3)])
    assert pub.flush(timeout=5)
    assert seqs(r, "a") == [0, 3] and seqs(r, "b") == []  # the refused batches wrote nothing
    assert not pub.lost and "lost event batches" not in caplog.text  # the counter's gap is theirs
    assert caplog.text.count("Redis is full (maxmemory)") == 1  # once, not a line a batch


def test_an_empty_batch_refused_for_any_reason_wrote_nothing_and_its_gap_is_no_loss(r, caplog):
    """`verify`'s empty batch (the outbox asks a full Redis with one) writes only the counter: refused, whatever
    the reason, it leaves a gap that is no loss."""
    pub = Publisher(r)
    pub.send([ev("a", 0)])
    assert pub.flush(timeout=5)
    (counter,) = r.keys("rose:publisher:*")
    value = r.get(counter)
    r.delete(counter)
    r.hset(counter, "x", 1)  # a counter of the wrong type: the script's GET refused (WRONGTYPE)
    pub.verify()
    assert pub.flush(timeout=5) and pub.written == 1 and pub.acked == 2
    r.delete(counter)
    r.set(counter, value)
    pub.send([ev("a", 1)])
    assert pub.flush(timeout=5) and pub.written == 3
    assert not pub.lost and "lost event batches" not in caplog.text
    assert pub.take_dropped() == (set(), set()) and seqs(r, "a") == [0, 1]


def test_acked_is_the_last_batch_redis_answered(r):
    pub = Publisher(r)
    numbers = [pub.send([ev("a", i)]) for i in range(3)]
    assert numbers == [1, 2, 3] and pub.send([]) == 0
    assert pub.flush(timeout=5) and pub.acked == 3
    pub.close()


def test_writes_redis_lost_are_reported_and_the_batch_still_applied(r):
    """A failover to a replica that missed the last writes: the counter is behind what Redis acknowledged."""
    pub = Publisher(r)
    pub.send([ev("a", 0)])
    pub.send([ev("a", 1)])
    assert pub.flush(timeout=5) and not pub.lost
    (counter,) = r.keys("rose:publisher:*")
    r.set(counter, 1)  # batch 2 lost
    r.xdel(keys.stream_key("a"), r.xrange(keys.stream_key("a"))[1][0])
    pub.send([ev("a", 2)])
    assert pub.flush(timeout=5) and pub.lost
    assert seqs(r, "a") == [0, 2]  # applied: the loop starts the stream over after it


def test_verify_finds_a_loss_with_no_events_to_send(r):
    pub = Publisher(r)
    pub.verify()
    assert pub.flush(timeout=5) and not pub.lost  # a fresh publisher: no counter yet, nothing lost
    pub.send([ev("a", 0)])
    assert pub.flush(timeout=5)
    for key in r.keys("rose:publisher:*"):
        r.delete(key)  # a restart without persistence
    pub.verify()
    assert pub.flush(timeout=5) and pub.lost


def test_keep_ttl_leaves_the_streams_expiry_alone(r):
    pub = Publisher(r)

    def write(*events: Outgoing) -> None:
        pub.send(list(events))
        assert pub.flush(timeout=5)

    write(ev("k", 0))  # a job's first event sets the expiry
    assert 90 <= r.ttl(keys.stream_key("k")) <= 100
    r.expire(keys.stream_key("k"), 50)
    write(ev("k", 1, KEEP_TTL))
    assert 40 <= r.ttl(keys.stream_key("k")) <= 50
    write(ev("k", 2))  # a refresh or a terminal event sets it again
    assert r.ttl(keys.stream_key("k")) > 50
    assert seqs(r, "k") == [0, 1, 2]


def test_through_sentinel_the_publisher_writes_to_the_primary_sentinel_names():
    """Its connection is made by hand (make_connection), and redis-py's send path connects a Sentinel-managed
    connection to its default host, not the primary: the publisher must connect it itself."""
    from rose.harness.sentinel import SentinelCluster
    from rose.jobs.connection import connect

    with SentinelCluster().start() as cluster:
        r = connect(cluster.url)
        pub = Publisher(r)
        pub.send([ev("a", 0)])
        assert pub.flush(timeout=5)
        assert seqs(r, "a") == [0]  # read back from the primary, through the Sentinels
        pub.close()
