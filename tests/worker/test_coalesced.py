"""rose.worker.coalesced: a batch's writes in fewer commands leave Redis exactly as the writes one by one,
checked on a real Redis against random batches over a few shared keys; and what the start and the retirement send
is coalesced (one write per shared key a batch, whatever its size)."""

from __future__ import annotations

import contextlib
import random

import pytest
import redis

from rose.worker.coalesce import MAX_ARGS, coalesced

KEYS = ["z1", "z2", "s1", "s2", "h1", "x1", "x2", "x3"]
MEMBERS = ["a", "b", "c", "d"]


def random_command(rng: random.Random) -> tuple:
    key, member = rng.choice(KEYS), rng.choice(MEMBERS)
    if rng.random() < 0.15:
        key = key.encode()  # redis-py sends str and bytes alike: one key
    kind = rng.choice(
        ["ZADD", "ZREM", "SADD", "SREM", "EXPIRE", "DEL", "HSET", "PERSIST", "ZADD+", "EXPIRE+", "HINCR"]
    )
    if kind == "ZADD":
        return ("ZADD", key, rng.choice([rng.randint(1, 9), "2.5", "-inf"]), member)
    if kind == "ZADD+":  # flags change what a ZADD does
        return ("ZADD", key, rng.choice(["XX", "NX", "GT", "INCR"]), rng.randint(1, 9), member)
    if kind in ("ZREM", "SADD", "SREM"):
        return (kind, key, member)
    if kind == "EXPIRE":
        return ("EXPIRE", key, rng.choice([100, 200, 200, 0, -1]))
    if kind == "EXPIRE+":
        return ("EXPIRE", key, 300, rng.choice(["NX", "XX", "GT", "LT"]))
    if kind == "DEL":
        return ("DEL", *rng.sample(KEYS, rng.randint(1, 2)))
    if kind == "HINCR":
        if rng.random() < 0.5:
            return ("HINCRBY", key, member, rng.randint(-3, 3))
        return ("HINCRBYFLOAT", key, member, rng.choice([0.5, 1.25, -2.0]))
    if kind == "HSET":
        return ("HSET", key, member, rng.randint(1, 9))
    return ("PERSIST", key)


def shaped_batch(rng: random.Random, jobs: int) -> list[tuple]:
    """What a batch looks like: per-job keys, and shared ones written once a job with a repeated EXPIRE."""
    commands: list[tuple] = []
    for j in range(jobs):
        commands += [
            ("HSET", f"job{j}", "status", "done"),
            ("ZADD", "finished", 100 + j, f"job{j}"),
            ("EXPIRE", f"job{j}", 500),
            ("DEL", f"exec{j}"),
            ("ZREM", "wip", f"job{j}:e"),
            ("SADD", "index", f"job{j}:e"),
            ("EXPIRE", "index", 3840),
            ("SREM", "index2", f"job{j}:e"),
            ("HINCRBY", "worker", "count", 1),
            ("HINCRBYFLOAT", "worker", "seconds", 0.5),
        ]
    return commands


def state(r) -> dict:
    out = {}
    for key in sorted(r.keys()):
        kind = r.type(key).decode()
        value = {
            "zset": lambda k: r.zrange(k, 0, -1, withscores=True),
            "set": lambda k: sorted(r.smembers(k)),
            "hash": lambda k: sorted(r.hgetall(k).items()),
            "string": lambda k: r.get(k),
        }[kind](key)
        out[key] = (kind, value, r.ttl(key))
    return out


def seed(r, rng: random.Random) -> None:
    """Some keys already there (members, TTLs) before the batch."""
    for command in [random_command(rng) for _ in range(10)]:
        if command[0] not in ("DEL", "PERSIST"):
            with contextlib.suppress(redis.ResponseError):  # a key of another type
                r.execute_command(*command)
    for j in range(4):
        r.hset(f"exec{j}", "x", 1)
        r.zadd("wip", {f"job{j}:e": 1})
        r.sadd("index2", f"job{j}:e")


def run(r, commands: list[tuple]) -> None:
    with r.pipeline() as pipe:  # one transaction, as the worker sends them
        for command in commands:
            pipe.execute_command(*command)
        pipe.execute(raise_on_error=False)


# the cases that once broke it: plain ZADDs merged past a flagged one; a flagged EXPIRE taken for a plain one; a
# TTL of 0 between adds; one key as str and bytes; int and float increments of one field
REGRESSIONS = [
    [("ZADD", "k", 1, "a"), ("ZADD", "k", "XX", 2, "b"), ("ZADD", "k", 3, "b")],
    [("ZADD", "k", 1, "b"), ("ZADD", "k", "INCR", 5, "b"), ("ZADD", "k", 3, "b")],
    [("EXPIRE", "k", 200), ("SADD", "k", "a"), ("EXPIRE", "k", 200, "NX")],
    [("SADD", "k", "a"), ("EXPIRE", "k", 0), ("SADD", "k", "b")],
    [("SADD", "k", "a"), ("EXPIRE", "k", -1), ("SADD", "k", "b")],
    [("DEL", "x"), ("HSET", b"k", "f", 1), ("DEL", "k")],
    [("HINCRBY", "h", "f", 1), ("HINCRBYFLOAT", "h", "f", 0.5), ("HINCRBY", "h", "f", 2)],
    [("ZADD", "k", "nan", "a"), ("ZADD", "k", 1, "b")],
]


@pytest.mark.parametrize("case", range(len(REGRESSIONS)))
def test_cases_that_once_differed_do_not(redis_server, case):
    one, other = redis_server.client(db=1), redis_server.client(db=2)
    for r in (one, other):
        r.flushdb()
    commands = REGRESSIONS[case]
    run(one, commands)
    run(other, coalesced(commands))
    assert state(one) == state(other), coalesced(commands)


def test_a_merged_command_stays_under_what_a_script_can_unpack():
    commands = [("ZADD", "finished", 100, f"job{j}") for j in range(5000)] + [
        ("DEL", f"exec{j}") for j in range(5000)
    ]
    merged = coalesced(commands)
    assert all(len(c) <= MAX_ARGS for c in merged)
    assert sum(len(c) - 2 for c in merged if c[0] == "ZADD") == 2 * 5000
    assert sum(len(c) - 1 for c in merged if c[0] == "DEL") == 5000
    assert len(merged) < 30


@pytest.mark.parametrize("case", range(400))
def test_coalesced_writes_leave_redis_as_the_writes_one_by_one(redis_server, case):
    rng = random.Random(case)
    one, other = redis_server.client(db=1), redis_server.client(db=2)
    for r in (one, other):
        r.flushdb()
    commands = (
        shaped_batch(rng, rng.randint(1, 4))
        if case % 3 == 0
        else [random_command(rng) for _ in range(rng.randint(1, 25))]
    )
    state_seed = rng.random()
    seed(one, random.Random(state_seed))
    seed(other, random.Random(state_seed))
    merged = coalesced(commands)
    run(one, commands)
    run(other, merged)
    assert state(one) == state(other), (commands, merged)
    assert len(merged) <= len(commands)


def test_a_batchs_shared_keys_get_one_write_each():
    commands = coalesced(shaped_batch(random.Random(0), 8))
    shared = [c for c in commands if c[1] in ("finished", "wip", "index", "index2")]
    assert sorted((c[0], c[1]) for c in shared) == [
        ("EXPIRE", "index"),
        ("SADD", "index"),
        ("SREM", "index2"),
        ("ZADD", "finished"),
        ("ZREM", "wip"),
    ]
    assert [c for c in commands if c[0] == "DEL"] == [("DEL", *(f"exec{j}" for j in range(8)))]
    # the per-job writes stay as they were
    assert [c for c in commands if c[0] == "HSET"] == [
        ("HSET", f"job{j}", "status", "done") for j in range(8)
    ]
    # SADD before the EXPIRE that follows it
    names = [(c[0], c[1]) for c in commands]
    assert names.index(("SADD", "index")) < names.index(("EXPIRE", "index"))


def test_flagged_zadds_and_keys_written_otherwise_are_left_alone():
    commands = [
        ("ZADD", "z", "XX", 1, "a"),
        ("ZADD", "z", "XX", 2, "b"),
        ("SADD", "s", "a"),
        ("SREM", "s", "b"),  # adds and removes on one key: order matters
        ("SADD", "s", "c"),
        ("DEL", "k"),
        ("HSET", "k", "f", 1),
        ("DEL", "k"),
    ]
    assert coalesced(commands) == commands
