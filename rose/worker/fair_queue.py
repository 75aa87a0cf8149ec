"""Fair share between tenants on one RQ queue (VTC: virtual token counters), with deadline jobs ahead of the rest.

Producers enqueue to the RQ queue as ever, and its list stays the truth: `rq info`, KEDA's list scaler, cancel and
`Job.get_position` read it as they always did. Beside it rose keeps an index of the queue's waiting jobs in Redis,
shared by the fleet (`keys.fair_key`):

    rose:fair2:<queue>:mark          the newest id indexed, while it waits: the next look starts after it
    rose:fair2:<queue>:mark_enqueued "<id>|<its job's enqueued_at>" as it became the mark: did its job come back?
    rose:fair2:<queue>:order         sorted set: the indexed ids by their place in the queue (first: lowest)
    rose:fair2:<queue>:tenant:<T>    list: tenant T's waiting jobs, in queue order: "<id>|<cost>"
    rose:fair2:<queue>:tenants       set: the tenants whose list may hold ids
    rose:fair2:<queue>:deadlines     sorted set: "<id>|<cost>|<tenant>" of the waiting jobs with a deadline, by it
    rose:fair:counters               sorted set: each tenant's service in tokens / its weight (the fleet, all queues)

where a job's cost is "<prompt tokens>|<all its tokens>", expected (`expected_tokens`), carried by its entry so that a
claim reads nothing else of the index. (An earlier version kept the costs in a hash beside the order, under
`rose:fair:<queue>:*`: a fleet mid-upgrade keeps both indexes, each worker its own version's, and both take from the
one RQ list, which stays the truth.)

`FairQueue.take` is one or two round trips a queue: the look reads what the queue holds past the mark (sought near
the tail, then around as many ids from the head as the index holds, then from the list's nearer end: `MARK_NEAR`;
when the mark's job has left the queue or came back, the newest indexed id found from the tail stands for it) and at
its head (where ids pushed to the front land); finding nothing new, the same script takes at once (one round trip:
the index holds every waiting job). Else it returns each new job's data; the worker reads each one's tenant and
deadline (`placement`); then one script indexes them (unless another worker moved the mark meanwhile: it indexed the
same ids) and claims up to `room` jobs: the deadline jobs earliest first, then one at a time the oldest job of the
tenant with the lowest counter (a heap; the counters kept in the script, written once a tenant). A claim moves the
id from the queue's list to RQ's intermediate list in one script, as RQ's own dequeue moves ids (the id first in the
order: LMOVE from the head, moved back if another id was there; else LREM and RPUSH; one `FAR` from the head or
more, found by its place in the order, has the head's id moved into its place instead: LREM reads every id ahead),
so a crash at any point loses nothing and rose.worker.recovery applies unchanged; a job no longer `queued`
(canceled, deleted) is dropped from the index when its turn comes, at the cost of one HMGET (its status and
timeout); taking the mark's job moves the mark to the id before it (unless its job came back: below). A take pops at
most `POPS` index entries per job it may take plus `EXTRA_POPS`; an index found with the queue empty is dropped
whole. If the index is empty while the queue is not (a look that fell behind a burst), the queue's head is taken
first come, first served.

The mark's job canceled and requeued (RQ puts it at the tail and stamps its `enqueued_at` anew) leaves the jobs after
it that no look had read before the mark. A take records the mark's job's `enqueued_at` beside it, as the look read it
(a requeue between the two is a coming back too); a look that finds it changed reads on from the newest indexed id
(found from the tail, within `SCAN_BACK`; none: from the head) enqueued no later than the mark was (an indexed id
stamped later came back as well). A mark without its record (set by an earlier version, during a rolling upgrade, or
whose job's stamp the look could not read) is trusted, as then: if its job came back, the ids before it are read on
reaching the head's window, as pushed to the front (later than their turn, never lost); so are the ids behind one
requeued by a clock that runs behind the mark's producer's, and, in some interleavings of a cancel, new jobs and a
requeue between a worker's look and its take (tests/worker/test_fair_queue_model.py), ids that arrived meanwhile. Ids
pushed to the front beyond the head's window are read a window at a time, each window ahead of those read before.

Counters: a claim charges the job's tenant its prompt's expected tokens at once, as VTC does at admission (so that
workers taking at the same moment see each other's picks), and a take spreads its picks by each job's whole expected
cost (`expected_tokens`); the worker settles each job as it is served (rose.worker.tenants: the tokens beyond the
advance, a refund of what it did not use) and each take first adds what the worker owes (`Accounts.take_pending`;
owed again when the take's first script fails: `Accounts.owe`). VTC's lift: a tenant whose list was empty when one
of its jobs is indexed has its counter raised to the lowest counter among the tenants with waiting jobs in this queue
(to the highest of all when none waits), so the service it did not ask for while idle is no credit later.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from rose.jobs import keys
from rose.worker import rq_start, rq_store
from rose.worker.fair_scripts import CHARGE, LOOK_TAKE, TAKE
from rose.worker.rq_store import decoded

if TYPE_CHECKING:
    from redis import Redis
    from rq.job import Job
    from rq.queue import Queue

DEFAULT_TENANT = "default"  # the tenant of jobs that name none
LOOK_LIMIT = 512  # new ids indexed per take at most: a burst is indexed over a few takes
HEAD = 16  # ids at the queue's head looked at for ones pushed to the front
SCAN_BACK = 4096  # ids looked at from the tail for the newest indexed one: the mark's job left or came back
MARK_NEAR = 1024  # ids read near the tail, then near where the index says, for the mark
FAR = 256  # a claim this far from the queue's head moves the head's id into its place (fair_scripts.TAKE)
POPS = 64  # a take pops at most this many index entries per job it may take, stale ones included,
EXTRA_POPS = 4096  # and this many more


@dataclass(frozen=True, slots=True)
class Placement:
    """What the index needs of a waiting job: its tenant and its deadline (Unix seconds, None: none)."""

    tenant: str = DEFAULT_TENANT
    deadline: float | None = None


def placement(kwargs: Mapping[str, Any] | None) -> Placement:
    """A job's tenant and deadline from its kwargs (the job fields), as well as they read: a field the job contract
    will refuse places the job as if it had none (it fails when a worker starts it)."""
    if not kwargs:
        return Placement()
    tenant = kwargs.get("tenant")
    deadline = kwargs.get("deadline")
    ok = isinstance(deadline, int | float) and not isinstance(deadline, bool) and 1e9 <= deadline <= 1e11
    return Placement(
        tenant if isinstance(tenant, str) and tenant.strip() else DEFAULT_TENANT,
        float(deadline) if ok else None,
    )


def charge(conn: Redis, amounts: Mapping[str, float]) -> None:
    """Add `amounts` (tokens / weight, by tenant; negative: a refund) to the fleet's counters."""
    if amounts:
        args = [x for tenant, amount in amounts.items() for x in (tenant, repr(float(amount)))]
        conn.eval(CHARGE, 1, keys.fair_counters_key(), *args)


def counters(conn: Redis) -> dict[str, float]:
    """The fleet's counters: each tenant's service in tokens / weight."""
    pairs = conn.zrange(keys.fair_counters_key(), 0, -1, withscores=True)
    return {decoded(t): float(v) for t, v in pairs}  # type: ignore[union-attr]


def waiting(conn: Redis, queue_name: str) -> dict[str, int]:
    """Each tenant's jobs in `queue_name`'s index, deadline jobs included (a job canceled while it waits counts
    until a worker reaches it)."""
    tenants = sorted(decoded(t) for t in conn.smembers(keys.fair_key(queue_name, "tenants")))  # type: ignore[union-attr]
    with conn.pipeline(transaction=False) as pipe:
        for tenant in tenants:
            pipe.llen(keys.fair_tenant_key(queue_name, tenant))
        pipe.zrange(keys.fair_key(queue_name, "deadlines"), 0, -1)
        *lengths, deadlines = pipe.execute()
    found = {t: int(n) for t, n in zip(tenants, lengths, strict=True) if n}
    for member in deadlines:
        tenant = decoded(member).split("|", 3)[3]  # "<id>|<cost>|<tenant>", the cost "<prompt>|<all>"
        found[tenant] = found.get(tenant, 0) + 1
    return found


def expected_tokens(kwargs: Mapping[str, Any] | None, typical: float | None) -> tuple[float, float]:
    """What a job is expected to cost: (its prompt: a token per 4 characters, or its ids; that plus its max_tokens
    times its `n` choices, or `typical` (this worker's jobs' generated tokens so far, on average) when that is lower;
    None max_tokens (up to the context): `typical`, or 256). A claim charges the prompt at once (VTC charges
    it at admission); the whole spreads a take's picks."""
    kwargs = kwargs or {}
    prompt = kwargs.get("prompt")
    if isinstance(prompt, list):
        prompt_tokens = float(len(prompt))
    else:
        prompt_tokens = len(str(prompt if prompt is not None else kwargs.get("messages") or "")) / 4
    most = kwargs.get("max_tokens", 16)
    most = float(most) if isinstance(most, int | float) and not isinstance(most, bool) and most > 0 else None
    n = kwargs.get("n", 1)
    if most is not None:
        most *= n if isinstance(n, int) and 0 < n <= 128 else 1
    generated = min(x for x in (most, typical) if x is not None) if most or typical else 256.0
    return round(prompt_tokens, 1), round(prompt_tokens + generated, 1)


class Accounts(Protocol):
    """What a take asks of the worker's accounts (rose.worker.tenants.Tenants)."""

    def typical(self) -> float | None:
        """The tokens this worker's jobs generated so far, on average (None: none ended yet)."""
        ...

    def take_pending(self) -> dict[str, float]:
        """The charges not yet added to the counters (tokens / weight, by tenant), handed over."""
        ...

    def owe(self, charges: Mapping[str, float]) -> None:
        """Charges handed over (`take_pending`) that no script added: owed again, added by a later take."""
        ...

    def prepaid(self, job_id: str, tenant: str, tokens: float) -> None:
        """A job taken whose tenant was charged `tokens` in advance (settled as it is served)."""
        ...


class FairQueue:
    """Takes jobs from RQ queues by the policy above. `weights`: tenant -> weight (1 unless named);
    `serializer`: the jobs' (RQ's); `accounts`: the worker's, whose pending charges each take adds first, so that
    it picks by the service given up to now."""

    def __init__(
        self, conn: Redis, serializer: Any, weights: Mapping[str, float], accounts: Accounts
    ) -> None:
        self.conn = conn
        self.serializer = serializer
        self.weights = [x for tenant, w in weights.items() for x in (tenant, repr(float(w)))]
        self.accounts = accounts
        self._look_take = conn.register_script(LOOK_TAKE)
        self._take = conn.register_script(TAKE)

    def take(self, queues: list[Queue], room: int) -> list[tuple[str, Queue, Job | None]]:
        """Up to `room` jobs, the queues in order (a queue's jobs all come before the next queue's: a queue that
        still holds jobs after a short take ends it): (id, queue, the job as `rq_start.claimed`, None if it has no
        status), as rq_start.dequeue gives them. A Redis error after a queue's jobs were taken returns those (the next take
        meets the error again)."""
        taken: list[tuple[str, Queue, Job | None]] = []
        for queue in queues:
            if len(taken) >= room:
                break
            try:
                flat = self._take_from(queue, room - len(taken))
            except Exception:
                if taken:  # theirs started as usual; a lost reply's charges stay counted, not twice
                    return taken
                raise
            for i in range(1, len(flat), 4):
                job_id, tenant = decoded(flat[i]), decoded(flat[i + 1])
                if tenant:
                    self.accounts.prepaid(job_id, tenant, float(flat[i + 2]))
                status, timeout = flat[i + 3]
                job = rq_start.claimed(self.conn, job_id, queue, status, timeout, self.serializer)
                taken.append((job_id, queue, job))
            if flat[0] and len(taken) < room:
                break  # jobs still wait here that this take did not reach: no lower queue goes first
        return taken

    def _take_from(self, queue: Queue, room: int) -> list[Any]:
        """Index what `queue` holds past the mark, claim up to `room` of its jobs: the take's reply (flat). One round
        trip when the look finds nothing new (it takes at once), else two."""
        name = queue.name
        prefix = rq_start.job_hash_prefix()
        script_keys = [
            queue.key,
            queue.intermediate_queue_key,
            keys.fair_key(name, "mark"),
            keys.fair_key(name, "order"),
            keys.fair_key(name, "tenants"),
            keys.fair_key(name, "deadlines"),
            keys.fair_counters_key(),
            keys.fair_key(name, "mark_enqueued"),
        ]
        # handed over before the first script, which may take: owed again if it fails (an outage must not lose them;
        # counted twice only if it ran and its reply was lost). The second script's error drops them (at most once)
        pending = self.accounts.take_pending()
        charges = [x for tenant, amount in pending.items() for x in (tenant, repr(float(amount)))]

        def take_args(expected: str, newest: str, stamp: str, entries: list[str]) -> list[Any]:
            return [
                keys.fair_tenant_key(name, ""),
                prefix,
                expected,
                newest,
                room,
                POPS * room + EXTRA_POPS,
                rq_store.JOB_STATUS_FIELD,
                rq_store.QUEUED,
                FAR,
                rq_store.JOB_ENQUEUED_FIELD,
                stamp,
                rq_store.JOB_TIMEOUT_FIELD,
                len(self.weights) // 2,
                *self.weights,
                len(charges) // 2,
                *charges,
                len(entries) // 5,
                *entries,
            ]

        look_args = [LOOK_LIMIT, HEAD, prefix, SCAN_BACK, MARK_NEAR, rq_store.JOB_ENQUEUED_FIELD]
        try:
            reply = self._look_take(keys=script_keys, args=[*look_args, *take_args("", "", "", [])])
        except Exception:
            self.accounts.owe(pending)
            raise
        if decoded(reply[0]) == "took":
            return reply[1:]
        expected, newest, stamp, found = decoded(reply[1]), decoded(reply[2]), decoded(reply[3]), reply[4:]
        entries: list[str] = []
        for i in range(0, len(found), 3):
            kwargs = rq_start.job_kwargs(found[i + 2], self.serializer)
            place = placement(kwargs)
            deadline = "" if place.deadline is None else repr(place.deadline)
            prompt, total = expected_tokens(kwargs, self.accounts.typical())
            cost = f"{prompt!r}|{total!r}"
            entries += [decoded(found[i]), place.tenant, deadline, decoded(found[i + 1]), cost]
        return self._take(keys=script_keys, args=take_args(expected, newest, stamp, entries))
