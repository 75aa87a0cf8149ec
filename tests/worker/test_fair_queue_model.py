"""rose.worker.fair_queue against a model, on a real redis-server: random enqueues (tenants, deadlines, jobs pushed
to the front), takes by several workers (one of them with another actor's step run between its look and its take),
cancels, deletes and requeues, with the intake's distances shrunk so that every path of the take runs (far claims
moving the head's id, marks sought around, looks that fall behind). After every step RQ's lists must hold exactly
what the model says: the waiting jobs on the queue's list, each once; the taken ones on the intermediate list, in
the order taken; no job taken twice, none not waiting, each tenant's plain jobs in the order enqueued. At the end
every job still waiting is taken. Then the look's mark when its job comes back to the queue's tail, and when ids
pushed to the front reach it."""

from __future__ import annotations

import hashlib
import os
import random
from dataclasses import dataclass, field

import pytest
import redis
from rq import Queue
from rq.job import Job
from rq.registry import CanceledJobRegistry
from rq.serializers import JSONSerializer
from test_fair_queue import submit, taker

from rose.jobs import keys
from rose.jobs.client import Client
from rose.worker import fair_queue
from rose.worker.fair_queue import FairQueue
from rose.worker.fair_scripts import TAKE

pytestmark = pytest.mark.timeout(120)

TENANTS = ("a", "b", "c")
SEEDS = int(os.environ.get("ROSE_MODEL_SEEDS", "6"))  # more to explore (session 21: 300 ran clean)
DEADLINES = 2_000_000_000  # Unix seconds: deadlines from here, as the seed says
TAKE_SHA = hashlib.sha1(TAKE.encode()).hexdigest()


class Interrupted(redis.Redis):
    """A connection whose next take script runs `between()` first: another actor's step between a look and its take."""

    between = None
    interruptions = 0

    def evalsha(self, sha, numkeys, *args):  # type: ignore[override]
        if sha == TAKE_SHA and self.between is not None:  # not the look, which runs first
            hook, self.between = self.between, None
            hook()
            self.interruptions += 1
        return super().evalsha(sha, numkeys, *args)


@dataclass
class Model:
    """What RQ's lists must hold: the jobs waiting, the ones taken (in order), each tenant's plain jobs in order."""

    waiting: set[str] = field(default_factory=set)
    taken: list[str] = field(default_factory=list)
    # -> the jobs after it on the list then, and how many jobs had been enqueued
    canceled: dict[str, tuple[list[str], int]] = field(default_factory=dict)
    plain: dict[str, list[str]] = field(default_factory=dict)  # never front, deadline nor requeued: FIFO
    tenant: dict[str, str] = field(default_factory=dict)  # every job's, in the order enqueued


class Run:
    def __init__(self, r: redis.Redis, seed: int) -> None:
        self.r, self.rng, self.seed, self.model = r, random.Random(seed), seed, Model()
        self.queue = Queue("rose", connection=r, serializer=JSONSerializer)
        pool = r.connection_pool.connection_kwargs
        self.hooked = Interrupted(host=pool["host"], port=pool["port"])
        self.workers = [taker(c, {"b": 2.0}) for c in (r, r, self.hooked)]

    def enqueue(self) -> None:
        t, kind = self.rng.choice(TENANTS), self.rng.random()
        fields = {"deadline": DEADLINES + self.rng.randint(0, 600)} if kind < 0.15 else {}
        front = 0.15 <= kind < 0.3
        client = Client(self.r, queue="rose", tenant=t)
        for _ in range(self.rng.randint(1, 6)):
            job_id = f"s{self.seed}-{len(self.model.tenant)}"  # ids (deadlines' ties) as the seed says
            client.submit("x", max_tokens=2, at_front=front, job_id=job_id, **fields)
            self.model.waiting.add(job_id)
            self.model.tenant[job_id] = t
            if not fields and not front:
                self.model.plain.setdefault(t, []).append(job_id)

    def take(self, worker: FairQueue) -> None:
        for job_id, _, job in worker.take([self.queue], self.rng.randint(1, 4)):
            assert job is not None and job_id in self.model.waiting, f"{job_id} taken but not waiting"
            self.model.waiting.discard(job_id)
            self.model.taken.append(job_id)
            plain = self.model.plain.get(self.model.tenant[job_id], [])
            if job_id in plain:
                assert plain[0] == job_id, f"{job_id}: a tenant's plain jobs taken out of their order"
                plain.pop(0)
            self.r.hset(Job.key_for(job_id), "status", "started")  # as the worker starting it

    def leave(self) -> None:
        """A waiting job canceled or deleted (RQ takes it off the queue's list)."""
        if self.model.waiting:
            job_id = self.rng.choice([i for i in self.model.tenant if i in self.model.waiting])
            mark = (self.r.get(keys.fair_key("rose", "mark")) or b"").decode()
            if mark in self.model.waiting and self.rng.random() < 0.5:
                job_id = (
                    mark  # the look's mark (fair_queue's docstring): its job coming back is a case of its own
                )
            job = Job.fetch(job_id, connection=self.r, serializer=JSONSerializer)
            if self.rng.random() < 0.5:
                listed = [i.decode() for i in self.r.lrange(self.queue.key, 0, -1)]
                job.cancel()
                self.model.canceled[job_id] = listed[listed.index(job_id) + 1 :], len(self.model.tenant)
            else:
                job.delete()
            self.model.waiting.discard(job_id)
            self.unorder(job_id)

    def requeue(self) -> None:
        """A taken job put back at the queue's head (a worker's shutdown, recovery) or tail (RQ's requeue), or a
        canceled one at the tail (RQ's). If that was the look's mark, the jobs after it on the list that no look had
        read, and those enqueued while it was away, may be read late, at the head's window (fair_queue's docstring):
        their order is not checked."""
        pool = [i for i in self.model.taken if self.rng.random() < 0.5] + list(self.model.canceled)
        if not pool:
            return
        job_id = self.rng.choice(pool)
        if job_id in self.model.canceled:
            after, enqueued = self.model.canceled.pop(job_id)
            for later in after + list(self.model.tenant)[enqueued:]:  # unread then, or enqueued since
                self.unorder(later)
            CanceledJobRegistry("rose", connection=self.r, serializer=JSONSerializer).requeue(job_id)
        else:
            self.model.taken.remove(job_id)
            self.r.lrem(self.queue.intermediate_queue_key, 1, job_id)
            self.r.hset(Job.key_for(job_id), "status", "queued")
            (self.r.lpush if self.rng.random() < 0.5 else self.r.rpush)(self.queue.key, job_id)
        self.unorder(job_id)
        self.model.waiting.add(job_id)

    def unorder(self, job_id: str) -> None:
        plain = self.model.plain.get(self.model.tenant[job_id], [])
        if job_id in plain:
            plain.remove(job_id)

    def step(self) -> None:
        x = self.rng.random()
        if x < 0.3:
            self.enqueue()
        elif x < 0.75:
            worker = self.rng.choice(self.workers)
            if worker is self.workers[2]:
                other = self.rng.choice([self.enqueue, self.leave, lambda: self.take(self.workers[0])])
                self.hooked.between = other
            self.take(worker)
            self.hooked.between = None
        elif x < 0.88:
            self.leave()
        else:
            self.requeue()
        self.check()

    def check(self) -> None:
        listed = [i.decode() for i in self.r.lrange(self.queue.key, 0, -1)]
        assert len(listed) == len(set(listed)), "an id twice on the queue's list"
        assert set(listed) == self.model.waiting, "the queue's list is not the waiting jobs"
        moved = [i.decode() for i in self.r.lrange(self.queue.intermediate_queue_key, 0, -1)]
        assert moved == self.model.taken, "the intermediate list is not the jobs taken, in order"


@pytest.mark.parametrize("seed", range(SEEDS))
def test_the_fair_take_keeps_rqs_lists_and_each_tenants_order(r, monkeypatch, seed):
    shrunk = {"FAR": 2, "LOOK_LIMIT": 3, "HEAD": 2, "MARK_NEAR": 2, "SCAN_BACK": 6, "RESCAN": 4}
    for name, value in shrunk.items():
        monkeypatch.setattr(fair_queue, name, value)
    run = Run(r, seed)
    try:
        for _ in range(250):
            run.step()
        assert run.hooked.interruptions > 0
        for _ in range(200):  # drained: every job still waiting is taken in a bounded number of takes
            if not run.model.waiting:
                break
            run.take(run.workers[0])
            run.check()
    finally:
        run.hooked.close()
    assert not run.model.waiting, f"{len(run.model.waiting)} waiting jobs never taken"


def drain(fair: FairQueue, queue: Queue) -> list[str]:
    taken: list[str] = []
    while batch := fair.take([queue], 1):
        taken += [i for i, _, _ in batch]
    return taken


def test_a_mark_whose_job_came_back_at_the_tail_is_read_on_from_the_indexed_id_before(r, monkeypatch):
    """The mark's job canceled, jobs enqueued, then the canceled job requeued (RQ puts it at the tail): the ids
    before it were never read. The id before the mark, past the head's window, is not indexed and an indexed id lies
    shortly before it, past the window too: the look reads on from there, so a tenant's jobs come in the order
    enqueued (not the new ones first, as jobs pushed to the front, once they reach the head)."""
    queue = Queue("rose", connection=r, serializer=JSONSerializer)
    monkeypatch.setattr(fair_queue, "HEAD", 2)
    a, x, old, m = submit(r, 1, "a"), submit(r, 2, "x"), submit(r, 1, "b"), submit(r, 1, "m")
    fair = taker(r)
    assert [i for i, _, _ in fair.take([queue], 1)] == a  # x, old and m indexed; the mark on m
    Job.fetch(m[0], connection=r, serializer=JSONSerializer).cancel()
    new = submit(r, 2, "b")
    CanceledJobRegistry("rose", connection=r, serializer=JSONSerializer).requeue(m[0])
    assert [i.decode() for i in r.lrange(queue.key, 0, -1)] == x + old + new + m
    fair_queue.charge(r, {"b": 1000.0})  # b's turn comes last: its new jobs reach the head's window before
    taken = drain(fair, queue)
    assert [i for i in taken if i in old + new] == old + new and sorted(taken) == sorted(x + old + new + m)
    assert r.llen(keys.fair_tenant_key("rose", "b")) == 0 and r.llen(queue.key) == 0


def test_ids_pushed_to_the_front_up_to_the_mark_keep_their_turn(r, monkeypatch):
    """More ids pushed to the front than the head's window reads (a worker's jobs given back at its shutdown) while
    the queue holds only the mark's job: no indexed id before them past the head's window (the ids it read are not
    a sign), so the mark is trusted and they are read at the head, as pushed to the front: taken before the mark's
    job and the jobs enqueued after."""
    queue = Queue("rose", connection=r, serializer=JSONSerializer)
    monkeypatch.setattr(fair_queue, "HEAD", 2)
    a, m = submit(r, 1, "a"), submit(r, 1, "b")
    fair = taker(r)
    assert [i for i, _, _ in fair.take([queue], 1)] == a  # m indexed: the mark
    front = submit(r, 5, "b", at_front=True)[::-1]  # the last pushed first
    assert [i.decode() for i in r.lrange(queue.key, 0, -1)] == front + m
    taken = drain(fair, queue)
    # (a window's ids pushed ahead of those the last one read: their order among themselves is not kept)
    assert sorted(taken[:5]) == sorted(front) and taken[5:] == m


def test_ids_pushed_to_the_front_after_an_earlier_push_was_read_keep_their_turn(r, monkeypatch):
    """Two pushes to the front (two workers giving their jobs back), the head's window of the first read in between:
    the first push's indexed ids now lie past the window, further from the head than their places (the second push
    is ahead of them), so they say nothing of the ids after them: the mark is trusted, every pushed id is taken
    before the mark's job."""
    queue = Queue("rose", connection=r, serializer=JSONSerializer)
    monkeypatch.setattr(fair_queue, "HEAD", 2)
    a, m = submit(r, 1, "a"), submit(r, 1, "b")
    fair = taker(r)
    assert [i for i, _, _ in fair.take([queue], 1)] == a  # m indexed: the mark
    first = submit(r, 4, "b", at_front=True)[::-1]
    assert [i for i, _, _ in fair.take([queue], 1)] == first[:1]  # the window read first[0], first[1]
    second = submit(r, 2, "b", at_front=True)[::-1]
    assert [i.decode() for i in r.lrange(queue.key, 0, -1)] == second + first[1:] + m
    taken = drain(fair, queue)
    assert sorted(taken[:5]) == sorted(second + first[1:]) and taken[5:] == m
