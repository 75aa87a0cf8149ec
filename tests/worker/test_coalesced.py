"""rose.worker.coalesced: a batch's writes in fewer commands leave Redis exactly as the writes one by one,
checked on a real Redis against random batches over a few shared keys; and what the start and the retirement send
is coalesced (one write per shared key a batch, whatever its size)."""

from __future__ import annotations

import contextlib
import random

import pytest
import redis

from rose.worker.coalesce import coalesced

KEYS = ["z1", "z2", "s1", "s2", "h1", "x1", "x2", "x3"]
MEMBERS = ["a", "b", "c", "d"]


def random_command(rng: random.Random) -> tuple:
    key, member = rng.choice(KEYS), rng.choice(MEMBERS)
    kind = rng.choice(["ZADD", "ZREM", "SADD", "SREM", "EXPIRE", "DEL", "HSET", "PERSIST", "ZADDXX"])
    if kind == "ZADD":
        return ("ZADD", key, rng.randint(1, 9), member)
    if kind == "ZADDXX":
        return ("ZADD", key, "XX", rng.randint(1, 9), member)
    if kind in ("ZREM", "SADD", "SREM"):
        return (kind, key, member)
    if kind == "EXPIRE":
        return ("EXPIRE", key, rng.choice([100, 200]))
    if kind == "DEL":
        return ("DEL", *rng.sample(KEYS, rng.randint(1, 2)))
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


@pytest.mark.parametrize("case", range(60))
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
