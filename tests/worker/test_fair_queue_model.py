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
from rq.utils import now, utcformat
from test_fair_queue import submit, taker

from rose.jobs import keys
from rose.jobs.client import Client
from rose.worker import fair_queue
from rose.worker.fair_queue import FairQueue
from rose.worker.fair_scripts import TAKE

pytestmark = pytest.mark.timeout(120)

TENANTS = ("a", "b", "c")
SEEDS = int(os.environ.get("ROSE_MODEL_SEEDS", "30"))  # more to explore (session 25: 1,000 ran clean)
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
    canceled: set[str] = field(default_factory=set)
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
                job.cancel()
                self.model.canceled.add(job_id)
            else:
                job.delete()
            self.model.waiting.discard(job_id)
            self.unorder(job_id)

    def requeue(self) -> None:
        """A taken job put back at the queue's head (a worker's shutdown, recovery) or tail (RQ's requeue), or a
        canceled one at the tail (RQ's, stamped anew). The jobs no look had read before it came back, when it was
        the look's mark, keep their order too (fair_queue's docstring): only the requeued job's own turn is free."""
        pool = [i for i in self.model.taken if self.rng.random() < 0.5] + sorted(self.model.canceled)
        if not pool:
            return
        job_id = self.rng.choice(pool)
        if job_id in self.model.canceled:
            self.model.canceled.remove(job_id)
            CanceledJobRegistry("rose", connection=self.r, serializer=JSONSerializer).requeue(job_id)
        else:
            self.model.taken.remove(job_id)
            self.r.lrem(self.queue.intermediate_queue_key, 1, job_id)
            if self.rng.random() < 0.5:  # at the head, as rose's recovery puts it back (its stamp kept)
                self.r.hset(Job.key_for(job_id), "status", "queued")
                self.r.lpush(self.queue.key, job_id)
            else:  # at the tail, as RQ's requeue (of a failed job) enqueues it again: stamped anew
                self.r.hset(
                    Job.key_for(job_id), mapping={"status": "queued", "enqueued_at": utcformat(now())}
                )
                self.r.rpush(self.queue.key, job_id)
        self.unorder(job_id)
        self.model.waiting.add(job_id)

    def come_back(self) -> None:
        """A waiting job (the newest on the list, or the look's mark) canceled, jobs enqueued, and it requeued at the
        tail, in one step: between a look and its take, the look's newest id or mark coming back past jobs it did not
        read. Those jobs, and the ones after it on the list, may come later than their turn in some interleavings
        (fair_queue's docstring): their order is not checked (the single cancel and requeue steps check it)."""
        listed = [i.decode() for i in self.r.lrange(self.queue.key, 0, -1)]
        mark = (self.r.get(keys.fair_key("rose", "mark")) or b"").decode()
        if not listed:
            return
        job_id = mark if mark in listed and self.rng.random() < 0.5 else listed[-1]
        Job.fetch(job_id, connection=self.r, serializer=JSONSerializer).cancel()
        self.model.waiting.discard(job_id)
        enqueued = len(self.model.tenant)
        self.enqueue()
        CanceledJobRegistry("rose", connection=self.r, serializer=JSONSerializer).requeue(job_id)
        self.model.waiting.add(job_id)
        for later in [job_id, *listed[listed.index(job_id) + 1 :], *list(self.model.tenant)[enqueued:]]:
            self.unorder(later)

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
                other = self.rng.choice(
                    [
                        self.enqueue,
                        self.leave,
                        self.requeue,
                        self.come_back,
                        lambda: self.take(self.workers[0]),
                    ]
                )
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
    shrunk = {"FAR": 2, "LOOK_LIMIT": 3, "HEAD": 2, "MARK_NEAR": 2, "SCAN_BACK": 6}
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
    """The mark's job canceled, jobs enqueued, then the canceled job requeued (RQ puts it at the tail, stamped anew):
    the ids before it were never read. Its `enqueued_at` is not the mark's record: the look reads on from the newest
    indexed id enqueued before the mark was, so a tenant's jobs come in the order enqueued (not the new ones first,
    as jobs pushed to the front, once they reach the head)."""
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


def record(r) -> str:
    return (r.get(keys.fair_key("rose", "mark_enqueued")) or b"").decode()


def test_a_take_records_the_marks_enqueued_at(r):
    submit(r, 1, "a")
    m = submit(r, 1, "b")
    fair = taker(r)
    fair.take([Queue("rose", connection=r, serializer=JSONSerializer)], 1)
    stamp = r.hget(Job.key_for(m[0]), "enqueued_at").decode()
    assert r.get(keys.fair_key("rose", "mark")).decode() == m[0] and record(r) == f"{m[0]}|{stamp}"


def test_a_mark_that_came_back_behind_another_requeued_indexed_id_is_read_on_from_before_both(r, monkeypatch):
    """Two indexed jobs canceled (the mark's and the one before it), jobs enqueued, both requeued: the id before the
    mark is indexed, but it came back too (stamped after the mark was): the look reads on from before both."""
    queue = Queue("rose", connection=r, serializer=JSONSerializer)
    monkeypatch.setattr(fair_queue, "HEAD", 2)
    a, x, old = submit(r, 1, "a"), submit(r, 2, "x"), submit(r, 1, "b")
    back = submit(r, 1, "m") + submit(r, 1, "n")  # the mark last
    fair = taker(r)
    assert [i for i, _, _ in fair.take([queue], 1)] == a
    canceled = CanceledJobRegistry("rose", connection=r, serializer=JSONSerializer)
    for job_id in back:
        Job.fetch(job_id, connection=r, serializer=JSONSerializer).cancel()
    new = submit(r, 3, "b")
    for job_id in back:
        canceled.requeue(job_id)
    assert [i.decode() for i in r.lrange(queue.key, 0, -1)] == x + old + new + back
    # x's jobs first: the mark stays where it is while the new jobs are read
    fair_queue.charge(r, {"b": 1000.0, "m": 1000.0, "n": 1000.0})
    taken = drain(fair, queue)
    assert [i for i in taken if i in old + new] == old + new and sorted(taken) == sorted(x + old + new + back)


def test_a_mark_that_came_back_inside_the_heads_window_is_read_on_from_the_indexed_id_before(r):
    """A short queue (all of it inside the head's window): the mark's job came back behind one new job; the new job
    is read as enqueued, after its tenant's older one, not as pushed to the front."""
    queue = Queue("rose", connection=r, serializer=JSONSerializer)
    a, old, m = submit(r, 1, "a"), submit(r, 1, "b"), submit(r, 1, "m")
    fair = taker(r)
    assert [i for i, _, _ in fair.take([queue], 1)] == a
    Job.fetch(m[0], connection=r, serializer=JSONSerializer).cancel()
    new = submit(r, 1, "b")
    CanceledJobRegistry("rose", connection=r, serializer=JSONSerializer).requeue(m[0])
    assert [i.decode() for i in r.lrange(queue.key, 0, -1)] == old + new + m
    fair_queue.charge(r, {"b": 1000.0})
    assert [i for i in drain(fair, queue) if i in old + new] == old + new


def test_with_no_mark_the_last_ones_stamp_still_tells_an_indexed_id_that_came_back(r, monkeypatch):
    """The mark's job taken at the head leaves no mark; an indexed job canceled before comes back at the tail behind
    jobs no look read: it is no sign that they were read (the last mark's stamp is older than its own)."""
    queue = Queue("rose", connection=r, serializer=JSONSerializer)
    monkeypatch.setattr(fair_queue, "HEAD", 2)
    a, gone, m = submit(r, 1, "a"), submit(r, 1, "r"), submit(r, 1, "m")
    fair = taker(r)
    assert [i for i, _, _ in fair.take([queue], 1)] == a  # gone and m indexed, the mark on m
    Job.fetch(gone[0], connection=r, serializer=JSONSerializer).cancel()
    assert [i for i, _, _ in fair.take([queue], 1)] == m  # the mark's job, at the head: no mark now
    assert r.get(keys.fair_key("rose", "mark")) is None and record(r).startswith("|")
    early = submit(r, 3, "b")
    CanceledJobRegistry("rose", connection=r, serializer=JSONSerializer).requeue(gone[0])
    late = submit(r, 1, "b")
    assert [i.decode() for i in r.lrange(queue.key, 0, -1)] == early + gone + late
    taken = drain(fair, queue)
    assert [i for i in taken if i in early + late] == early + late
    assert sorted(taken) == sorted(early + gone + late)


def test_a_mark_without_its_record_is_trusted_as_by_earlier_versions(r):
    """A mark an earlier version set (no record beside it) whose job came back: the mark is trusted, the new job is
    read at the head's window as pushed to the front (ahead of its tenant's older job); nothing is lost."""
    queue = Queue("rose", connection=r, serializer=JSONSerializer)
    a, old, m = submit(r, 1, "a"), submit(r, 1, "b"), submit(r, 1, "m")
    fair = taker(r)
    assert [i for i, _, _ in fair.take([queue], 1)] == a
    r.delete(keys.fair_key("rose", "mark_enqueued"))
    Job.fetch(m[0], connection=r, serializer=JSONSerializer).cancel()
    new = submit(r, 1, "b")
    CanceledJobRegistry("rose", connection=r, serializer=JSONSerializer).requeue(m[0])
    fair_queue.charge(r, {"b": 1000.0})
    taken = drain(fair, queue)
    assert [i for i in taken if i in old + new] == new + old and sorted(taken) == sorted(old + new + m)


@pytest.mark.parametrize("tenant", ["y", "w"])  # y's turn after x's; w's first: the same take claims it
def test_a_mark_requeued_between_the_look_and_its_take_is_told_by_the_stamp_the_look_read(
    r, monkeypatch, tenant
):
    """The newest id a look read is canceled, jobs are enqueued and it is requeued, all between that look and its
    take: the take records the stamp the look read, so the next look tells the mark came back and reads the jobs
    enqueued meanwhile in their turn (a stamp read by the take would hide it: they would come at the head's window,
    ahead of their tenant's older job). Claimed by that take, the mark stays: the id before it arrived meanwhile."""
    queue = Queue("rose", connection=r, serializer=JSONSerializer)
    monkeypatch.setattr(fair_queue, "HEAD", 2)
    a, x, old = submit(r, 1, "a"), submit(r, 2, "x"), submit(r, 1, "b")
    fair = taker(r)
    assert [i for i, _, _ in fair.take([queue], 1)] == a
    fair_queue.charge(r, {"b": 1000.0})
    y = submit(r, 1, tenant)
    new: list[str] = []

    def between() -> None:
        Job.fetch(y[0], connection=r, serializer=JSONSerializer).cancel()
        new.extend(submit(r, 2, "b"))
        CanceledJobRegistry("rose", connection=r, serializer=JSONSerializer).requeue(y[0])

    pool = r.connection_pool.connection_kwargs
    hooked = Interrupted(host=pool["host"], port=pool["port"])
    try:
        hooked.between = between
        taken = [i for i, _, _ in taker(hooked).take([queue], 1)]
        assert hooked.interruptions == 1
    finally:
        hooked.close()
    waiting = [i for i in x + old + new + y if i not in taken]  # y back at the tail, past the new jobs
    assert [i.decode() for i in r.lrange(queue.key, 0, -1)] == waiting
    taken += drain(fair, queue)
    assert [i for i in taken if i in old + new] == old + new and sorted(taken) == sorted(x + old + y + new)
