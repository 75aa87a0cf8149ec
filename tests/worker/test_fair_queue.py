"""rose.worker.fair_queue on a real redis-server: jobs enqueued by plain producers to one queue are taken by tenant,
lowest weighted service first, deadline jobs earliest first ahead of the rest; the queue's list stays RQ's (claimed
ids move to RQ's intermediate list, canceled ones are never taken); VTC's lift; several workers share the index."""

from __future__ import annotations

import time

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from rq import Queue
from rq.job import Job
from rq.registry import CanceledJobRegistry
from rq.serializers import JSONSerializer

from rose.harness.redis_server import free_port
from rose.jobs import keys
from rose.jobs.client import Client
from rose.worker import fair_queue, fair_scripts
from rose.worker.fair_queue import FairQueue, placement
from rose.worker.metrics import WorkerMetrics
from rose.worker.tenants import Tenants

pytestmark = pytest.mark.timeout(60)

ESTIMATE = 100.0  # tokens a job is settled at


def submit(r, n: int, tenant: str | None = None, **fields) -> list[str]:
    client = Client(r, queue="rose", tenant=tenant)
    return [client.submit(f"{tenant} {i}", max_tokens=2, **fields).id for i in range(n)]


class Accounts:
    """A worker's accounts as a take sees them: nothing pending; records the advances."""

    def __init__(self) -> None:
        self.advances: dict[str, tuple[str, float]] = {}

    def typical(self) -> float | None:
        return None

    def take_pending(self) -> dict[str, float]:
        return {}

    def owe(self, charges) -> None:
        pass

    def prepaid(self, job_id: str, tenant: str, tokens: float) -> None:
        self.advances[job_id] = (tenant, tokens)


def taker(r, weights=None) -> FairQueue:
    return FairQueue(r, JSONSerializer, weights or {}, Accounts())


def tenants_of(r, ids: list[str]) -> list[str]:
    return [
        Job.fetch(i, connection=r, serializer=JSONSerializer).kwargs.get("tenant") or "default" for i in ids
    ]


def take_served(r, fair: FairQueue, queue: Queue, n: int, cost: float = ESTIMATE, weights=None) -> list[str]:
    """Take one job at a time `n` times, settling each job's tenant at `cost` tokens (over its weight; the take
    charged the job's expected tokens in advance) as a worker serving it would: the tenants in the order served."""
    order: list[str] = []
    for _ in range(n):
        taken = fair.take([queue], 1)
        if not taken:
            break
        tenant, advance = fair.accounts.advances[taken[0][0]]
        order.append(tenant)
        fair_queue.charge(r, {tenant: (cost - advance) / (weights or {}).get(tenant, 1.0)})
    return order


def test_a_small_tenant_behind_a_backlog_is_served_in_turn(r):
    queue = Queue("rose", connection=r)
    big = submit(r, 30, "big")
    small = submit(r, 5, "small")
    order = take_served(r, taker(r), queue, 14)
    # both lifted to 0 on arrival, then equal service: turns until the small tenant runs out
    assert order == ["big", "small"] * 5 + ["big"] * 4
    # claimed ids moved to RQ's intermediate list (recovery finds them there), the rest still on the queue in order
    inter = [i.decode() for i in r.lrange(queue.intermediate_queue_key, 0, -1)]
    assert set(inter) <= set(big + small) and len(inter) == 14
    assert queue.get_job_ids() == [i for i in big + small if i not in inter]
    assert queue.count == 21  # rq info's count: what still waits


def test_weights_give_shares_in_their_ratio(r):
    queue = Queue("rose", connection=r)
    submit(r, 40, "a")
    submit(r, 40, "b")
    weights = {"a": 2.0}
    order = take_served(r, taker(r, weights), queue, 30, weights=weights)
    assert order.count("a") == 20 and order.count("b") == 10
    # within one take several jobs at once: each counts its expected tokens over its weight
    r.delete(keys.fair_counters_key())
    many = taker(r, weights).take([queue], 9)
    assert tenants_of(r, [i for i, _, _ in many]).count("a") == 6


def test_deadline_jobs_go_first_earliest_first(r):
    queue = Queue("rose", connection=r)
    backlog = submit(r, 10, "big")
    now = time.time()
    later = submit(r, 1, "small", deadline=now + 600)
    sooner = submit(r, 1, "other", deadline=now + 60)
    taken = [i for i, _, _ in taker(r).take([queue], 3)]
    assert taken == sooner + later + backlog[:1]


def test_canceled_and_deleted_jobs_are_never_taken(r):
    queue = Queue("rose", connection=r)
    ids = submit(r, 5, "a")
    fair = taker(r)
    assert [i for i, _, _ in fair.take([queue], 1)] == ids[:1]  # indexes the five, takes one
    Job.fetch(ids[2], connection=r, serializer=JSONSerializer).cancel()
    Job.fetch(ids[3], connection=r, serializer=JSONSerializer).delete()
    assert r.llen(keys.fair_tenant_key("rose", "a")) == 4  # still indexed: the index learns at their turn
    taken = [i for i, _, _ in fair.take([queue], 5)]
    assert taken == [ids[1], ids[4]]
    assert r.zcard(keys.fair_key("rose", "order")) == 0  # the index holds nothing stale
    assert fair.take([queue], 4) == []
    # only the jobs taken were charged in advance: a prompt "a 3" (3 characters: 0.75 tokens)
    assert fair.accounts.advances == {i: ("a", 0.8) for i in (ids[0], ids[1], ids[4])}


def test_a_job_no_longer_queued_is_passed_over_at_its_turn(r):
    """An id still on the queue whose job is not `queued` any more (another actor moved it on) is not taken."""
    queue = Queue("rose", connection=r)
    ids = submit(r, 3, "a")
    fair = taker(r)
    assert [i for i, _, _ in fair.take([queue], 1)] == ids[:1]
    r.hset(Job.key_for(ids[1]), "status", "finished")
    assert [i for i, _, _ in fair.take([queue], 1)] == [ids[2]]


def test_an_emptied_queue_stalls_no_take_for_long(r, monkeypatch):
    monkeypatch.setattr(fair_queue, "POPS", 1)  # a take pops 1 + 8 entries: the stale ones take turns
    monkeypatch.setattr(fair_queue, "EXTRA_POPS", 8)
    queue = Queue("rose", connection=r, serializer=JSONSerializer)
    submit(r, 600, "a")
    fair = taker(r)
    assert len(fair.take([queue], 1)) == 1  # 512 indexed
    queue.empty()  # RQ deletes the jobs and the list: the index's ids are all stale
    assert fair.take([queue], 8) == [] and not r.keys(keys.fair_tenant_key("rose", "*"))  # dropped at once
    submit(r, 600, "a")
    assert len(fair.take([queue], 1)) == 1
    queue.empty()
    fresh = submit(r, 8, "b")  # new jobs before any take: the stale ids go 9 a take, then the fresh ones
    taken: list[str] = []
    for _ in range(80):
        taken += [i for i, _, _ in fair.take([queue], 8)]
    assert taken == fresh


def test_a_tenant_back_from_idle_is_lifted_not_credited(r):
    queue = Queue("rose", connection=r)
    fair = taker(r)
    submit(r, 20, "a")
    assert take_served(r, fair, queue, 10) == ["a"] * 10  # a alone: 1,000 tokens served
    submit(r, 10, "b")  # b arrives with no service: lifted to a's 1,000, not 1,000 tokens ahead
    assert take_served(r, fair, queue, 6) == ["a", "b"] * 3
    assert fair_queue.counters(r) == {"a": 1300.0, "b": 1300.0}


def test_a_tenant_whose_list_emptied_is_lifted_when_it_waits_again(r):
    """A tenant stays in the tenants set for a while after its list empties; its next job still lifts it to the
    tenants that wait (its own new job does not count as one of them)."""
    queue = Queue("rose", connection=r)
    fair = taker(r)
    submit(r, 5, "b")
    assert len(fair.take([queue], 5)) == 5  # b's list emptied by the take's last pop: b stays in the set
    assert "b" in {t.decode() for t in r.smembers(keys.fair_key("rose", "tenants"))}
    served = fair_queue.counters(r)["b"]
    fair_queue.charge(r, {"a": served + 1000})  # a has had more service
    submit(r, 1, "b")
    submit(r, 3, "a")
    [(job_id, _, _)] = fair.take([queue], 1)
    assert fair_queue.counters(r)["b"] == served + 1000  # lifted to a's, not credited 1,000 tokens
    assert tenants_of(r, [job_id]) == ["a"]  # a tie: a's name first


def test_workers_share_the_index_and_take_each_job_once(r):
    queue = Queue("rose", connection=r)
    ids = submit(r, 20, "a") + submit(r, 20, "b")
    one, two = taker(r), taker(r)
    taken: list[str] = []
    while batch := one.take([queue], 3) + two.take([queue], 4):
        taken += [i for i, _, _ in batch]
    assert sorted(taken) == sorted(ids)
    assert queue.count == 0 and r.llen(queue.intermediate_queue_key) == 40


def test_jobs_pushed_to_the_front_and_a_look_that_fell_behind(r, monkeypatch):
    queue = Queue("rose", connection=r)
    monkeypatch.setattr(fair_queue, "LOOK_LIMIT", 4)
    ids = submit(r, 10, "a")
    fair = taker(r)
    assert [i for i, _, _ in fair.take([queue], 2)] == ids[:2]
    front = Client(r, queue="rose", tenant="a").submit("urgent", max_tokens=2, at_front=True).id
    assert [i for i, _, _ in fair.take([queue], 1)] == [front]
    # the index has caught up 4 ids at a take: the rest come in the queue's order all the same
    rest: list[str] = []
    while batch := fair.take([queue], 3):
        rest += [i for i, _, _ in batch]
    assert rest == ids[2:]


def test_a_look_behind_a_burst_finds_the_mark_where_the_index_says_or_from_the_nearer_end(r, monkeypatch):
    """The mark sought near the tail, then around as many ids from the head as the index holds, then from the nearer
    end (the index holding ids that left the queue): the jobs come in the queue's order, each once."""
    queue = Queue("rose", connection=r, serializer=JSONSerializer)
    monkeypatch.setattr(fair_queue, "MARK_NEAR", 2)
    monkeypatch.setattr(fair_queue, "LOOK_LIMIT", 10)
    ids = submit(r, 40, "a")
    fair = taker(r)
    assert [i for i, _, _ in fair.take([queue], 1)] == ids[:1]  # ids 0..9 indexed, the mark on 9
    for i in ids[1:8]:  # they leave the queue, not the index: it says the mark is 6 ids further than it is
        Job.fetch(i, connection=r, serializer=JSONSerializer).cancel()
    monkeypatch.setattr(fair_queue, "LOOK_LIMIT", 4)  # the index stays behind for a few takes
    taken: list[str] = []
    while batch := fair.take([queue], 1):
        taken += [i for i, _, _ in batch]
    assert taken == ids[8:]
    assert r.zcard(keys.fair_key("rose", "order")) == 0


def test_a_job_far_from_the_head_is_taken_by_moving_the_heads_id_into_its_place(r, monkeypatch):
    """A claim `FAR` ids from the queue's head or more does not remove by value (a read of every id ahead): the head's
    id takes its place in the list, and in the index's order, so that its own claim is as cheap. Canceled jobs put
    the order's places off (found around them); an id at the head that no look has seen is never moved."""
    queue = Queue("rose", connection=r, serializer=JSONSerializer)
    monkeypatch.setattr(fair_queue, "FAR", 2)
    a, b = submit(r, 6, "a"), submit(r, 6, "b")
    fair = taker(r)

    def listed() -> list[str]:
        return [i.decode() for i in r.lrange(queue.key, 0, -1)]

    assert [i for i, _, _ in fair.take([queue], 1)] == a[:1]  # at the head: removed as RQ would
    Job.fetch(a[5], connection=r, serializer=JSONSerializer).cancel()  # off the list, still in the index
    assert listed() == a[1:5] + b
    assert [i for i, _, _ in fair.take([queue], 1)] == b[:1]  # 4 ids ahead: a[1] moves into its place
    assert listed() == a[2:5] + [a[1]] + b[1:]
    assert [i for i, _, _ in fair.take([queue], 1)] == a[1:2]  # its place known: a[2] moves into it
    assert listed() == a[3:5] + [a[2]] + b[1:]
    # two jobs pushed to the front of a new tenant; a look sees the head only
    monkeypatch.setattr(fair_queue, "HEAD", 1)
    c = [
        Client(r, queue="rose", tenant="c").submit(f"urgent {i}", max_tokens=2, at_front=True).id
        for i in (1, 2)
    ]
    # b[1], far: the head c[1] (seen) moves into its place; c[1], there now: the head c[0] (unseen) stays, c[1] is
    # removed by value
    assert [i for i, _, _ in fair.take([queue], 2)] == [b[1], c[1]]
    assert listed() == [c[0]] + a[3:5] + [a[2]] + b[2:]
    taken: list[str] = []
    while batch := fair.take([queue], 2):
        taken += [i for i, _, _ in batch]
    assert taken.index(c[0]) < len(taken) - 1  # seen by the next look (at the head), taken at its turn
    assert sorted(taken) == sorted([c[0], *a[2:5], *b[2:]]) and len(taken) == len(set(taken))
    assert [i for i in taken if i in a] == a[2:5] and [i for i in taken if i in b] == b[2:]
    assert r.llen(queue.key) == 0 and r.llen(queue.intermediate_queue_key) == 13
    assert r.zcard(keys.fair_key("rose", "order")) == 0


def test_the_head_is_not_moved_when_it_is_the_mark_and_a_far_mark_is_found_where_it_is(r, monkeypatch):
    """The mark at the head and an indexed job past ids no look has read (a canceled job requeued between a look and
    its take): the head is not moved over them (they would sit before the mark, unread). A far job that is the mark
    itself is found by its place, and the mark moves to the id before it."""
    queue = Queue("rose", connection=r, serializer=JSONSerializer)
    monkeypatch.setattr(fair_queue, "FAR", 2)
    monkeypatch.setattr(fair_queue, "HEAD", 1)
    a, c, x, m = submit(r, 1, "a"), submit(r, 2, "c"), submit(r, 1, "b"), submit(r, 1, "m")
    fair = taker(r)
    assert [i for i, _, _ in fair.take([queue], 1)] == a  # indexes c, x, m; the mark on m
    for i in c + x:
        Job.fetch(i, connection=r, serializer=JSONSerializer).cancel()
    # the look alone, as LOOK_TAKE replies when its look finds ids: stands for a take whose look found ids that
    # another worker indexed meanwhile (its TAKE indexes none; here the look finds none and would take at once)
    look, look_take, arrived = r.register_script(fair_scripts.LOOK), fair._look_take, []

    def late_look(keys, args):  # jobs arrive and x is requeued between the look and the take
        out = [b"looked", *look(keys=[keys[0], keys[2], keys[3], keys[7]], args=args[:6])]
        arrived.extend(submit(r, 10, "u"))
        CanceledJobRegistry("rose", connection=r, serializer=JSONSerializer).requeue(x[0])
        return out

    monkeypatch.setattr(fair, "_look_take", late_look)
    assert [i for i, _, _ in fair.take([queue], 1)] == x
    monkeypatch.setattr(fair, "_look_take", look_take)
    assert [
        i.decode() for i in r.lrange(queue.key, 0, -1)
    ] == m + arrived  # m stayed the head, x removed by value
    deadline = submit(r, 1, "d", deadline=time.time() + 60)  # indexed last: the mark, far from the head
    assert [i for i, _, _ in fair.take([queue], 1)] == deadline
    assert r.get(keys.fair_key("rose", "mark")).decode() == arrived[-1]
    taken: list[str] = []
    while batch := fair.take([queue], 3):
        taken += [i for i, _, _ in batch]
    assert sorted(taken) == sorted(m + arrived) and r.llen(queue.key) == 0


def test_the_mark_found_far_past_its_place_is_removed_by_value(r, monkeypatch):
    """The mark's job, near the head by its place but found further on (ids pushed to the front that no look has read
    ahead of it): taken by value, as any job whose place is near the head."""
    queue = Queue("rose", connection=r, serializer=JSONSerializer)
    monkeypatch.setattr(fair_queue, "FAR", 2)
    monkeypatch.setattr(fair_queue, "HEAD", 1)
    y, x = submit(r, 2, "a")
    fair = taker(r)
    assert [i for i, _, _ in fair.take([queue], 1)] == [y]  # x indexed: the mark
    front = [
        Client(r, queue="rose", tenant="b").submit(f"f{i}", max_tokens=2, at_front=True).id for i in range(3)
    ]
    assert [i for i, _, _ in fair.take([queue], 1)] == [x]  # the mark, at 3; its place 1 (f2, seen, ahead)
    assert [i.decode() for i in r.lrange(queue.key, 0, -1)] == front[::-1]
    taken: list[str] = []
    while batch := fair.take([queue], 1):
        taken += [i for i, _, _ in batch]
    assert sorted(taken) == sorted(front)


def test_the_look_goes_on_after_the_newest_indexed_job_is_taken_or_requeued(r):
    queue = Queue("rose", connection=r, serializer=JSONSerializer)
    fair = taker(r)
    a = submit(r, 3, "a")
    assert [i for i, _, _ in fair.take([queue], 1)] == a[:1]
    urgent = submit(r, 1, "x", deadline=time.time() + 600)  # the newest id indexed: the mark
    assert [i for i, _, _ in fair.take([queue], 1)] == urgent  # taken: the mark moves back to a[2]
    b = submit(r, 2, "b")
    assert [i for i, _, _ in fair.take([queue], 4)] == [a[1], b[0], a[2], b[1]]  # b's jobs seen at once
    # the newest indexed job is taken, a job with a deadline comes, then RQ puts the taken one back at the tail
    backlog = submit(r, 20, "a")
    assert len(fair.take([queue], 0 + 1)) == 1  # indexes the backlog
    late = submit(r, 1, "x", deadline=time.time() + 900)
    assert [i for i, _, _ in fair.take([queue], 1)] == late  # the mark: back to the backlog's last
    soon = submit(r, 1, "y", deadline=time.time() + 60)
    r.rpush(queue.key, late[0])  # a requeue: RPUSH, status queued
    r.hset(Job.key_for(late[0]), "status", "queued")
    assert [i for i, _, _ in fair.take([queue], 2)] == soon + late  # both seen, past the 19 still waiting
    assert queue.count == len(backlog) - 1


def test_higher_queues_first_and_many_tenants(r):
    high = Queue("high", connection=r, serializer=JSONSerializer)
    low = Queue("low", connection=r, serializer=JSONSerializer)
    lows = [Client(r, queue="low", tenant="l").submit("x", max_tokens=2).id for _ in range(2)]
    highs = [Client(r, queue="high", tenant=f"t{i}").submit("x", max_tokens=2).id for i in range(2000)]
    fair = taker(r)
    taken = [i for i, _, _ in fair.take([high, low], 600)]
    assert len(taken) == 600 and set(taken) <= set(highs)  # one job of 600 tenants, low's wait
    while batch := fair.take([high, low], 600):
        taken += [i for i, _, _ in batch]
    assert taken[-2:] == lows and sorted(taken[:-2]) == sorted(highs)


def test_placement_reads_what_the_contract_would():
    assert placement({"tenant": "t", "deadline": 2e9}) == fair_queue.Placement("t", 2e9)
    assert placement({"tenant": " ", "deadline": 5}) == fair_queue.Placement()  # refused at start: no place
    assert placement({"deadline": True}) == fair_queue.Placement()
    assert placement(None) == fair_queue.Placement()


def test_expected_tokens_charged_in_advance():
    expected = fair_queue.expected_tokens
    assert expected({"prompt": "x" * 40, "max_tokens": 100}, None) == (10.0, 110.0)
    assert expected({"prompt": "x" * 40, "max_tokens": 100}, 30.0) == (10.0, 40.0)  # typical is lower
    assert expected({"prompt": [1, 2, 3], "max_tokens": 5, "n": 4}, None) == (3.0, 23.0)
    assert expected({"messages": [{"role": "user", "content": "hi"}]}, None)[1] > 16
    assert expected({"prompt": "", "max_tokens": None}, None) == (0.0, 256.0)
    assert expected(None, None) == (0.0, 16.0)  # the contract's default max_tokens


def test_an_id_whose_job_expired_leaves_the_queue(r):
    queue = Queue("rose", connection=r, serializer=JSONSerializer)
    ids = submit(r, 3, "a")
    fair = taker(r)
    assert [i for i, _, _ in fair.take([queue], 1)] == ids[:1]
    r.delete(Job.key_for(ids[1]))  # its hash expired (RQ's ttl): the id alone is left on the queue
    assert [i for i, _, _ in fair.take([queue], 2)] == ids[2:]
    assert queue.get_job_ids() == []  # dropped, as RQ's dequeue drops such ids, not indexed again


def test_what_a_take_costs_redis_a_job(r):
    """A take's commands: the index's membership read in one HMGET a chunk of ids (not an HEXISTS an id), the
    tenants set and each tenant's counter written once a take (not a SADD and a ZINCRBY a job), a claim at the queue's
    head moved by one LMOVE (not LREM + RPUSH); the counters exactly as one ZINCRBY a claim would leave them."""
    queue = Queue("rose", connection=r)
    submit(r, 8, "a")
    submit(r, 8, "b")
    weights = {"a": 0.3, "b": 0.3}
    fair_queue.charge(
        r, {"a": 0.1, "b": 0.1}
    )  # from 0.1, five additions of 0.8 / 0.3 differ from one of five times it
    fair = taker(r, weights)
    r.config_resetstat()
    taken = fair.take([queue], 10)
    stats = r.info("commandstats")

    def calls(name: str) -> int:
        return int(stats.get(f"cmdstat_{name}", {}).get("calls", 0))

    assert len(taken) == 10
    # no mark yet: one ZMSCORE for the scan from the tail for the newest indexed id (256 ids a chunk), one for the
    # ids read; the look reads each new job's data (16) and the newest one's enqueued_at; an HMGET a claim (the job's
    # status and timeout; never its whole hash: the start reads that); nothing else read of a job or its index entry
    # but its place (its cost comes with its tenant list's entry)
    assert calls("zmscore") == 2 and calls("hmget") == 10 and calls("hgetall") == 0
    assert calls("hget") == 16 + 1 and calls("hdel") == 0 and calls("zrank") == 10
    assert calls("sadd") == 2 and calls("zincrby") == 0
    # a's jobs are first in the queue: each claim of one finds it at the head; b's sit behind a's, removed by value
    assert calls("lmove") == 5 and calls("lrem") == 5 and calls("rpush") == 16 + 5
    prompt = fair.accounts.advances[taken[0][0]][1]  # every job's prompt: "a 0"... 3 characters, 0.8 tokens
    counter = 0.1
    for _ in range(5):
        counter += prompt / 0.3
    assert counter != 0.1 + 5 * (prompt / 0.3)
    assert fair_queue.counters(r) == {"a": counter, "b": counter}


def test_charges_handed_over_are_owed_again_when_the_take_cannot_reach_redis():
    """An outage: the take's first script never runs, so the worker's charges (here a refund and a charge) stay owed
    and the next take adds them (a failure that dropped them would leave those tenants' counters short for good)."""
    metrics = WorkerMetrics(name="w", model="fake", device="cpu", dtype="", queues=["rose"], version="test")
    accounts = Tenants({}, metrics)
    accounts.pending.update({"a": 5.0, "b": -1.5})
    dead = redis.Redis(port=free_port(), socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0))
    fair = FairQueue(dead, JSONSerializer, {}, accounts)
    with pytest.raises(redis.ConnectionError):
        fair.take([Queue("rose", connection=dead)], 1)
    assert accounts.take_pending() == {"a": 5.0, "b": -1.5}
