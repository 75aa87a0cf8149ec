"""Pre-packed commands with replies read later: the bytes match redis-py's, replies come back in order, error
replies do not desynchronise the connection, an abandoned reply never reaches the next command."""

from __future__ import annotations

import time

import pytest
import redis

from rose.worker import resp
from rose.worker.resp import Pending, pack_command

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("pack", [pack_command, resp.pack_command_python], ids=["hiredis", "python"])
def test_pack_command_is_what_redis_py_sends(r, pack):
    items = [
        "EVAL",
        "return 1",
        2,
        "k:ü",
        "k2",
        -1,
        "",
        '{"text": "日本 \\"q\\""}',
        "x" * 10_000,
        b"\x00\xff",
        1.25,
    ]
    conn = r.connection_pool.get_connection()
    try:
        assert pack(items) == b"".join(conn.pack_command(*items))
    finally:
        r.connection_pool.release(conn)


def test_replies_in_order_with_error_replies_inline(r):
    r.set("resp:s", "v")
    packed = b"".join(
        pack_command(c) for c in (["GET", "resp:s"], ["LLEN", "resp:s"], ["ECHO", "ü"], ["INCR", "resp:n"])
    )
    pending = Pending(r, packed, 4)
    value, wrong_type, echo, counter = pending.read()
    assert value == b"v" and echo == "ü".encode() and counter == 1
    assert isinstance(wrong_type, redis.ResponseError) and "WRONGTYPE" in str(wrong_type)
    with pytest.raises(RuntimeError, match="already read"):
        pending.read()
    assert r.get("resp:s") == b"v"  # the pooled connection is in step


def test_abandoned_replies_never_reach_the_next_command(r):
    r.set("resp:a", "first")
    Pending(r, pack_command(["GET", "resp:a"]), 1).abandon()
    r.set("resp:b", "second")
    assert r.get("resp:b") == b"second"
    assert resp.call(r, ["GET", "resp:a"]) == b"first"


def test_call_raises_error_replies(r):
    r.set("resp:c", "v")
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        resp.call(r, ["LLEN", "resp:c"])
    assert resp.call(r, ["PING"]) in (b"PONG", "PONG", True)


def test_a_held_connection_takes_more_commands_and_a_watch_holds_on_it(r):
    """`read(keep=True)` holds the connection: WATCH there, then MULTI/EXEC there, aborted by another client's
    write to the watched key in between (what the retirer's two rounds rely on)."""
    r.set("resp:w", "1")
    pending = Pending(r, resp.pack_commands([["WATCH", "resp:w"], ["GET", "resp:w"]]), 2)
    assert pending.read(keep=True) == [b"OK", b"1"]
    pending.send(pack_command(["PING"]), 1)
    with pytest.raises(RuntimeError, match="unread"):
        pending.send(pack_command(["PING"]), 1)  # the first PING's reply is not read yet
    assert pending.read(keep=True) in ([b"PONG"], [True])
    r.set("resp:w", "2")  # another connection's write: the EXEC below writes nothing
    pending.send(resp.pack_commands([["MULTI"], ["SET", "resp:w", "3"], ["EXEC"]]), 3)
    assert pending.read() == [b"OK", b"QUEUED", None]
    assert r.get("resp:w") == b"2"
    with pytest.raises(RuntimeError, match="not held"):
        pending.send(pack_command(["PING"]), 1)
    held = Pending(r, resp.pack_commands([["WATCH", "resp:w"], ["GET", "resp:w"]]), 2)
    held.read(keep=True)
    held.send(resp.pack_commands([["MULTI"], ["SET", "resp:w", "4"], ["EXEC"]]), 3)
    assert held.read() == [b"OK", b"QUEUED", [b"OK"]] and r.get("resp:w") == b"4"


def test_ready_only_once_every_reply_is_in(r):
    """The first reply in is not enough (a MULTI's comes long before its EXEC's): `read` must not wait after
    `ready`."""
    r.delete("resp:list")
    pending = Pending(r, resp.pack_commands([["PING"], ["BLPOP", "resp:list", "0"]]), 2)
    time.sleep(0.1)  # the PING's reply in, most likely: not ready all the same, however long it waits
    assert not pending.ready() and not pending.ready()
    r.rpush("resp:list", "x")  # the BLPOP's reply
    deadline = time.monotonic() + 5
    while not pending.ready():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    started = time.monotonic()
    assert pending.read()[1] == [b"resp:list", b"x"] and time.monotonic() - started < 0.05


def test_a_connection_closed_under_a_pending_reply_is_never_opened_again_unasked(r):
    """redis-py would connect again on `can_read` or a send: the replies and a WATCH of the old connection would be
    gone, and `ready` would wait on the new one forever."""
    pending = Pending(r, resp.pack_commands([["WATCH", "resp:w"], ["PING"]]), 2)
    pending.read(keep=True)
    r.connection_pool.disconnect()  # every connection, the held one too (redis-py does so after a fork, ...)
    with pytest.raises(redis.ConnectionError, match="closed"):
        pending.send(pack_command(["PING"]), 1)
    other = Pending(r, pack_command(["BLPOP", "resp:never", "0"]), 1)
    r.connection_pool.disconnect()
    assert other.ready()  # broken: `read` raises
    with pytest.raises(redis.ConnectionError, match="closed"):
        other.read()
