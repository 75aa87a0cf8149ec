"""rose.worker.fair_queue against a model, on a real redis-server: random enqueues (tenants, deadlines, jobs pushed
to the front), takes by several workers (one of them with another actor's step run between its look and its take),
cancels, deletes and requeues, with the intake's distances shrunk so that every path of the take runs (far claims
moving the head's id, marks sought around, looks that fall behind). After every step RQ's lists must hold exactly
what the model says: the waiting jobs on the queue's list, each once; the taken ones on the intermediate list, in
the order taken; no job taken twice, none not waiting, each tenant's plain jobs in the order enqueued. At the end
every job still waiting is taken and the index is left empty."""

from __future__ import annotations

import hashlib
import os
import random
import time
from dataclasses import dataclass, field

import pytest
import redis
from rq import Queue
from rq.job import Job
from rq.serializers import JSONSerializer

from rose.jobs import keys
from rose.jobs.client import Client
from rose.worker import fair_queue
from rose.worker.fair_queue import FairQueue
from rose.worker.fair_scripts import TAKE

pytestmark = pytest.mark.timeout(120)

TENANTS = ("a", "b", "c")
SEEDS = int(os.environ.get("ROSE_MODEL_SEEDS", "6"))  # more to explore: 500 seeds ran clean (session 21)
TAKE_SHA = hashlib.sha1(TAKE.encode()).hexdigest()


class Accounts:
    """A worker's accounts as a take sees them: a fixed estimate, nothing pending."""

    def estimate(self) -> float:
        return 100.0

    def typical(self) -> float | None:
        return None

    def take_pending(self) -> dict[str, float]:
        return {}

    def prepaid(self, job_id: str, tenant: str, tokens: float) -> None:
        pass


class Interrupted(redis.Redis):
    """A connection whose next take script runs `between()` first: another actor's step between a look and its take."""

    between = None

    def evalsha(self, sha, numkeys, *args):  # type: ignore[override]
        hook, self.between = self.between, None
        if hook is not None and sha == TAKE_SHA:
            hook()
        return super().evalsha(sha, numkeys, *args)


@dataclass
class Model:
    """What RQ's lists must hold: the jobs waiting, the ones taken (in order), each tenant's plain jobs in order."""

    waiting: set[str] = field(default_factory=set)
    taken: list[str] = field(default_factory=list)
    canceled: list[str] = field(default_factory=list)
    plain: dict[str, list[str]] = field(default_factory=dict)  # never front, deadline nor requeued: FIFO
    tenant: dict[str, str] = field(default_factory=dict)


class Run:
    def __init__(self, r: redis.Redis, rng: random.Random) -> None:
        self.r, self.rng, self.model = r, rng, Model()
        self.queue = Queue("rose", connection=r, serializer=JSONSerializer)
        pool = r.connection_pool.connection_kwargs
        self.hooked = Interrupted(host=pool["host"], port=pool["port"])
        self.workers = [FairQueue(c, JSONSerializer, {"b": 2.0}, Accounts()) for c in (r, r, self.hooked)]

    def enqueue(self) -> None:
        t, kind = self.rng.choice(TENANTS), self.rng.random()
        fields = {"deadline": time.time() + self.rng.randint(60, 600)} if kind < 0.15 else {}
        front = 0.15 <= kind < 0.3
        for _ in range(self.rng.randint(1, 6)):
            job_id = (
                Client(self.r, queue="rose", tenant=t).submit("x", max_tokens=2, at_front=front, **fields).id
            )
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
                assert plain[0] == job_id, "a tenant's plain jobs taken out of their order"
                plain.pop(0)
            self.r.hset(Job.key_for(job_id), "status", "started")  # as the worker starting it

    def leave(self) -> None:
        """A waiting job canceled or deleted (RQ takes it off the queue's list)."""
        if self.model.waiting:
            job_id = self.rng.choice(
                [i for i in self.model.tenant if i in self.model.waiting]
            )  # in enqueue order
            job = Job.fetch(job_id, connection=self.r, serializer=JSONSerializer)
            if self.rng.random() < 0.5:
                job.cancel()
                self.model.canceled.append(job_id)
            else:
                job.delete()
            self.forget(job_id)

    def requeue(self) -> None:
        """A taken job (a worker's crash) or a canceled one put back at the queue's tail, as RQ requeues."""
        pool = [i for i in self.model.taken if self.rng.random() < 0.5] + self.model.canceled
        if pool:
            job_id = self.rng.choice(pool)
            if job_id in self.model.canceled:
                self.model.canceled.remove(job_id)
            else:
                self.model.taken.remove(job_id)
                self.r.lrem(self.queue.intermediate_queue_key, 1, job_id)
            self.r.hset(Job.key_for(job_id), "status", "queued")
            self.r.rpush(self.queue.key, job_id)
            self.forget(job_id)
            self.model.waiting.add(job_id)

    def forget(self, job_id: str) -> None:
        self.model.waiting.discard(job_id)
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
    for name, value in {"FAR": 2, "LOOK_LIMIT": 3, "HEAD": 2, "MARK_NEAR": 2, "SCAN_BACK": 6}.items():
        monkeypatch.setattr(fair_queue, name, value)
    run = Run(r, random.Random(seed))
    for _ in range(250):
        run.step()
    for _ in range(200):  # drained: every job still waiting is taken in a bounded number of takes
        if not run.model.waiting:
            break
        run.take(run.workers[0])
        run.check()
    assert not run.model.waiting, f"{len(run.model.waiting)} waiting jobs never taken"
    assert run.workers[1].take([run.queue], 4) == []
    for part in ("indexed", "order", "deadlines", "tenants", "mark"):
        assert not r.exists(keys.fair_key("rose", part)), f"the index's {part} left behind"
