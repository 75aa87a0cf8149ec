"""Fair share between tenants on one RQ queue (VTC: virtual token counters), with deadline jobs ahead of the rest.

Producers enqueue to the RQ queue as ever, and its list stays the truth: `rq info`, KEDA's list scaler, cancel and
`Job.get_position` read it as they always did. Beside it rose keeps an index of the queue's waiting jobs in Redis,
shared by the fleet (`keys.fair_key`):

    rose:fair:<queue>:mark          the newest id indexed: the next look at the queue starts after it
    rose:fair:<queue>:indexed       set: the ids in the index
    rose:fair:<queue>:tenant:<T>    list: tenant T's waiting ids, in queue order
    rose:fair:<queue>:tenants       set: the tenants whose list may hold ids
    rose:fair:<queue>:deadlines     sorted set: waiting ids with a deadline, by deadline
    rose:fair:counters              hash: each tenant's service in tokens / its weight (the fleet, every queue)

`FairQueue.take` is two round trips: `look` reads what the queue holds past the mark (and its head, where ids
pushed to the front land) with each new job's data, the worker reads each one's tenant and deadline
(rq_start.job_placement), then one script indexes them (unless another worker indexed meanwhile) and claims up to
`room` jobs: the deadline jobs earliest first, then one at a time the oldest job of the tenant with the lowest
counter (plus `estimate` tokens for each job this take already gave it). A claim is LREM from the queue's list and
RPUSH to RQ's intermediate list in one script, as RQ's own dequeue moves ids, so a crash at any point loses nothing
and rose.worker.recovery applies unchanged; an id no longer on the queue (canceled, deleted, taken by a worker
that reads the head) is dropped from the index when its turn comes. If the index is empty while the queue is not
(a look that fell behind a burst), the queue's head is taken first come, first served.

VTC's lift: a tenant whose list was empty when one of its jobs is indexed has its counter raised to the lowest
counter among the tenants with waiting jobs (to the highest of all when none waits), so the service it did not ask
for while idle is no credit later. Counters grow by what the workers `charge` them: a job's generated tokens as
they come, its prompt tokens when it ends, each divided by its tenant's weight; each take first adds what its
worker owes them, so it picks by the service given up to that moment.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from rose.jobs import keys
from rose.worker import rq_start
from rose.worker.rq_store import decoded

if TYPE_CHECKING:
    from redis import Redis
    from rq.job import Job
    from rq.queue import Queue

DEFAULT_TENANT = "default"  # the tenant of jobs that name none
LOOK_LIMIT = 512  # new ids indexed per take at most: a burst is indexed over a few takes
HEAD = 16  # ids at the queue's head looked at for ones pushed to the front
MAX_POPS = 8  # a take pops at most this many index entries per job it may take (stale ones included)

# KEYS: queue, mark, indexed. ARGV: limit, head, job hash prefix. Returns {mark, newest id looked at, then
# (id, front "1"/"0", the job's data) for each id not in the index}.
_LOOK = """
local mark = redis.call('GET', KEYS[2])
local start = 0
if mark then
  local p = redis.call('LPOS', KEYS[1], mark, 'RANK', -1)
  if p then start = p + 1 end
end
local limit = tonumber(ARGV[1])
local tail = redis.call('LRANGE', KEYS[1], start, start + limit - 1)
local out = {mark or '', tail[#tail] or ''}
local seen = {}
local function add(id, front)
  if seen[id] or redis.call('SISMEMBER', KEYS[3], id) == 1 then return end
  seen[id] = true
  out[#out + 1] = id
  out[#out + 1] = front
  out[#out + 1] = redis.call('HGET', ARGV[3] .. id, 'data') or ''
end
for _, id in ipairs(tail) do add(id, '0') end
if start > 1 then  -- ahead of the mark: ids pushed to the front since
  local head = redis.call('LRANGE', KEYS[1], 0, math.min(tonumber(ARGV[2]), start - 1) - 1)
  for i = #head, 1, -1 do add(head[i], '1') end  -- pushed to the front of the tenant's list in this order
end
return out
"""

# KEYS: queue, intermediate, mark, indexed, tenants, deadlines, counters.
# ARGV: tenant list prefix, job hash prefix, expected mark, new mark, room, estimate, max pops, n weights,
# (tenant, weight) x n, c charges, (tenant, amount) x c, m entries, (id, tenant, deadline or '', front '1'/'0') x m.
# Returns {id, the job's hash (flat), ...} of the jobs claimed.
_TAKE = """
local prefix, counters = ARGV[1], KEYS[7]
local function counter(t) return tonumber(redis.call('HGET', counters, t) or '0') end
local weight = {}
local n = tonumber(ARGV[8])
local a = 9
for _ = 1, n do weight[ARGV[a]] = tonumber(ARGV[a + 1]); a = a + 2 end
local c = tonumber(ARGV[a]); a = a + 1
for _ = 1, c do redis.call('HINCRBYFLOAT', counters, ARGV[a], ARGV[a + 1]); a = a + 2 end
local function waiting_but(t)
  local lowest = nil
  for _, u in ipairs(redis.call('SMEMBERS', KEYS[5])) do
    if u ~= t and redis.call('LLEN', prefix .. u) > 0 then
      local c = counter(u)
      if lowest == nil or c < lowest then lowest = c end
    end
  end
  return lowest
end
local function lift(t)
  local target = waiting_but(t)
  if target == nil then
    target = 0
    for _, v in ipairs(redis.call('HVALS', counters)) do target = math.max(target, tonumber(v)) end
  end
  if counter(t) < target then redis.call('HSET', counters, t, tostring(target)) end
end
-- index what the look found, unless another worker moved the mark meanwhile (it indexed the same ids)
local m = tonumber(ARGV[a]); a = a + 1
if (redis.call('GET', KEYS[3]) or '') == ARGV[3] then
  for _ = 1, m do
    local id, t, deadline, front = ARGV[a], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3]
    a = a + 4
    if redis.call('SADD', KEYS[4], id) == 1 then
      if deadline ~= '' then
        redis.call('ZADD', KEYS[6], deadline, id)
      else
        local list = prefix .. t
        if redis.call('LLEN', list) == 0 then lift(t) end
        if front == '1' then redis.call('LPUSH', list, id) else redis.call('RPUSH', list, id) end
        redis.call('SADD', KEYS[5], t)
      end
    end
  end
  if ARGV[4] ~= '' then redis.call('SET', KEYS[3], ARGV[4]) end
end
-- claim
local out, left, pops = {}, tonumber(ARGV[5]), tonumber(ARGV[7])
local function claim(id)
  redis.call('SREM', KEYS[4], id)
  if redis.call('LREM', KEYS[1], 1, id) == 0 then return false end
  redis.call('RPUSH', KEYS[2], id)
  out[#out + 1] = id
  out[#out + 1] = redis.call('HGETALL', ARGV[2] .. id)
  return true
end
while left > 0 and pops > 0 do
  local first = redis.call('ZPOPMIN', KEYS[6])
  if #first == 0 then break end
  pops = pops - 1
  if claim(first[1]) then left = left - 1 end
end
local tenants, served = redis.call('SMEMBERS', KEYS[5]), {}
for _, t in ipairs(tenants) do served[t] = counter(t) end
local estimate = tonumber(ARGV[6])
while left > 0 and pops > 0 and #tenants > 0 do
  local best = 1
  for i = 2, #tenants do
    local t, b = tenants[i], tenants[best]
    if served[t] < served[b] or (served[t] == served[b] and t < b) then best = i end
  end
  local t = tenants[best]
  local id = redis.call('LPOP', prefix .. t)
  if not id then
    redis.call('SREM', KEYS[5], t)
    table.remove(tenants, best)
  else
    pops = pops - 1
    if claim(id) then
      left = left - 1
      served[t] = served[t] + estimate / (weight[t] or 1)
    end
  end
end
-- the index is empty but the queue is not (the look fell behind): its head, first come first served
if pops > 0 and #tenants == 0 and redis.call('ZCARD', KEYS[6]) == 0 then
  while left > 0 do
    local id = redis.call('LMOVE', KEYS[1], KEYS[2], 'LEFT', 'RIGHT')
    if not id then break end
    redis.call('SREM', KEYS[4], id)
    out[#out + 1] = id
    out[#out + 1] = redis.call('HGETALL', ARGV[2] .. id)
    left = left - 1
  end
end
return out
"""

# KEYS: counters. ARGV: (tenant, amount) pairs.
_CHARGE = """
for i = 1, #ARGV, 2 do redis.call('HINCRBYFLOAT', KEYS[1], ARGV[i], ARGV[i + 1]) end
return 0
"""


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
    """Add `amounts` (tokens / weight, by tenant) to the fleet's counters."""
    if amounts:
        args = [x for tenant, amount in amounts.items() for x in (tenant, repr(float(amount)))]
        conn.eval(_CHARGE, 1, keys.fair_counters_key(), *args)


def counters(conn: Redis) -> dict[str, float]:
    """The fleet's counters: each tenant's service in tokens / weight."""
    return {decoded(k): float(v) for k, v in conn.hgetall(keys.fair_counters_key()).items()}  # type: ignore[union-attr]


def waiting(conn: Redis, queue_name: str) -> dict[str, int]:
    """Each tenant's jobs in `queue_name`'s index (ids canceled since may still count), and `deadline` jobs."""
    tenants = sorted(decoded(t) for t in conn.smembers(keys.fair_key(queue_name, "tenants")))  # type: ignore[union-attr]
    with conn.pipeline(transaction=False) as pipe:
        for tenant in tenants:
            pipe.llen(keys.fair_tenant_key(queue_name, tenant))
        pipe.zcard(keys.fair_key(queue_name, "deadlines"))
        *lengths, deadlines = pipe.execute()
    found = {t: int(n) for t, n in zip(tenants, lengths, strict=True) if n}
    return {**found, "(deadlines)": int(deadlines)} if deadlines else found


class Accounts(Protocol):
    """What a take asks of the worker's accounts (rose.worker.tenants.Tenants)."""

    def estimate(self) -> float:
        """A job's expected tokens: what a take counts for each job it gives a tenant."""
        ...

    def take_pending(self) -> dict[str, float]:
        """The charges not yet added to the counters (tokens / weight, by tenant), handed over."""
        ...

    def put_back(self, charges: Mapping[str, float]) -> None:
        """Charges a failed take did not add."""
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
        self._look = conn.register_script(_LOOK)
        self._take = conn.register_script(_TAKE)

    def take(self, queues: list[Queue], room: int) -> list[tuple[str, Queue, Job | None]]:
        """Up to `room` jobs, the queues in order (a queue's jobs all come before the next queue's): (id, queue, the
        job as its hash was, None if it has none), as rq_start.dequeue gives them."""
        taken: list[tuple[str, Queue, Job | None]] = []
        for queue in queues:
            if len(taken) >= room:
                break
            pending = self.accounts.take_pending()
            try:
                flat = self._take_from(queue, room - len(taken), pending)
            except BaseException:
                self.accounts.put_back(pending)
                raise
            for i in range(0, len(flat), 2):
                job_id = decoded(flat[i])
                taken.append(
                    (job_id, queue, rq_start.restored(self.conn, job_id, flat[i + 1], self.serializer))
                )
        return taken

    def _take_from(self, queue: Queue, room: int, pending: Mapping[str, float]) -> list[Any]:
        """Index what `queue` holds past the mark, claim up to `room` of its jobs: the script's reply (flat)."""
        name = queue.name
        mark, indexed = keys.fair_key(name, "mark"), keys.fair_key(name, "indexed")
        prefix = rq_start.job_hash_prefix()
        looked = self._look(keys=[queue.key, mark, indexed], args=[LOOK_LIMIT, HEAD, prefix])
        expected, newest, found = decoded(looked[0]), decoded(looked[1]), looked[2:]
        entries: list[str] = []
        for i in range(0, len(found), 3):
            place = placement(rq_start.job_kwargs(found[i + 2], self.serializer))
            deadline = "" if place.deadline is None else repr(place.deadline)
            entries += [decoded(found[i]), place.tenant, deadline, decoded(found[i + 1])]
        charges = [x for tenant, amount in pending.items() for x in (tenant, repr(float(amount)))]
        tenants, deadlines = keys.fair_key(name, "tenants"), keys.fair_key(name, "deadlines")
        return self._take(
            keys=[
                queue.key,
                queue.intermediate_queue_key,
                mark,
                indexed,
                tenants,
                deadlines,
                keys.fair_counters_key(),
            ],
            args=[
                keys.fair_tenant_key(name, ""),
                prefix,
                expected,
                newest,
                room,
                repr(float(self.accounts.estimate())),
                MAX_POPS * room + 64,
                len(self.weights) // 2,
                *self.weights,
                len(charges) // 2,
                *charges,
                len(entries) // 4,
                *entries,
            ],
        )
