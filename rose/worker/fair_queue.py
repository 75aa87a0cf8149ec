"""Fair share between tenants on one RQ queue (VTC: virtual token counters), with deadline jobs ahead of the rest.

Producers enqueue to the RQ queue as ever, and its list stays the truth: `rq info`, KEDA's list scaler, cancel and
`Job.get_position` read it as they always did. Beside it rose keeps an index of the queue's waiting jobs in Redis,
shared by the fleet (`keys.fair_key`):

    rose:fair:<queue>:mark          the newest id indexed, while it waits: the next look starts after it
    rose:fair:<queue>:indexed       hash: the ids in the index -> "<prompt tokens>|<all its tokens>", expected
    rose:fair:<queue>:tenant:<T>    list: tenant T's waiting ids, in queue order
    rose:fair:<queue>:tenants       set: the tenants whose list may hold ids
    rose:fair:<queue>:deadlines     sorted set: "<id>|<tenant>" of the waiting jobs with a deadline, by deadline
    rose:fair:counters              sorted set: each tenant's service in tokens / its weight (the fleet, all queues)

`FairQueue.take` is two round trips a queue: `look` reads what the queue holds past the mark (found from the tail;
when the mark's job has left the queue, the newest indexed id found from the tail stands for it) and at its head
(where ids pushed to the front land), with each new job's data; the worker reads each one's tenant and deadline
(`placement`); then one script indexes them (unless another worker moved the mark meanwhile: it indexed the same
ids) and claims up to `room` jobs: the deadline jobs earliest first, then one at a time the oldest job of the tenant
with the lowest counter (a heap). A claim is LREM from the queue's list and RPUSH to RQ's intermediate list in one
script, as RQ's own dequeue moves ids, so a crash at any point loses nothing and rose.worker.recovery applies
unchanged; a job no longer `queued` (canceled, deleted) is dropped from the index when its turn comes, at the cost
of reading its hash (which a job taken needs anyway); taking the mark's job moves the mark to the id before it. A
take pops at most `POPS` index entries per job it may take plus `EXTRA_POPS`; an index found with the queue empty
is dropped whole. If the index is empty while the queue is not (a look that fell behind a burst), the queue's head
is taken first come, first served.

Counters: a claim charges the job's tenant its prompt's expected tokens at once, as VTC does at admission (so that
workers taking at the same moment see each other's picks), and a take spreads its picks by each job's whole expected
cost (`expected_tokens`); the worker settles each job as it is served (rose.worker.tenants: the tokens beyond the
advance, a refund of what it did not use) and each take first adds what the worker owes
(`Accounts.take_pending`). VTC's lift: a tenant whose list was empty when one of its jobs is indexed has its counter
raised to the lowest counter among the tenants with waiting jobs in this queue (to the highest of all when none
waits), so the service it did not ask for while idle is no credit later.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from rose.jobs import keys
from rose.worker import rq_start, rq_store
from rose.worker.rq_store import decoded

if TYPE_CHECKING:
    from redis import Redis
    from rq.job import Job
    from rq.queue import Queue

DEFAULT_TENANT = "default"  # the tenant of jobs that name none
LOOK_LIMIT = 512  # new ids indexed per take at most: a burst is indexed over a few takes
HEAD = 16  # ids at the queue's head looked at for ones pushed to the front
SCAN_BACK = (
    4096  # ids looked at from the tail for the newest indexed one, when the mark's job has left the queue
)
POPS = 64  # a take pops at most this many index entries per job it may take, stale ones included,
EXTRA_POPS = 4096  # and this many more

# KEYS: queue, mark, indexed. ARGV: limit, head, job hash prefix, scan back. Returns {mark, newest id looked at,
# then (id, front "1"/"0", the job's data) for each id not in the index}.
_LOOK = """
local mark = redis.call('GET', KEYS[2])
local start = nil
if mark then
  local p = redis.call('LPOS', KEYS[1], mark, 'RANK', -1)  -- from the tail: as far as the new ids go
  if p then start = p + 1 end
end
if start == nil then  -- no mark, or its job left the queue: after the newest indexed id, found from the tail
  start = 0
  local n, back = redis.call('LLEN', KEYS[1]), tonumber(ARGV[4])
  local i = n - 1
  while i >= 0 and i >= n - back and start == 0 do
    local lo = math.max(0, i - 255, n - back)
    local chunk = redis.call('LRANGE', KEYS[1], lo, i)
    for j = #chunk, 1, -1 do
      if redis.call('HEXISTS', KEYS[3], chunk[j]) == 1 then start = lo + j; break end
    end
    i = lo - 1
  end
end
local limit = tonumber(ARGV[1])
local tail = redis.call('LRANGE', KEYS[1], start, start + limit - 1)
local out = {mark or '', tail[#tail] or ''}
local seen = {}
local function add(id, front)
  if seen[id] or redis.call('HEXISTS', KEYS[3], id) == 1 then return end
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

# KEYS: queue, intermediate, mark, indexed, tenants, deadlines, counters (a sorted set: tenant -> service).
# ARGV: tenant list prefix, job hash prefix, expected mark, new mark, room, a job's tokens (unindexed), max pops,
# job status field,
# its queued value, n weights, (tenant, weight) x n, c charges, (tenant, amount) x c, m entries,
# (id, tenant, deadline or '', front '1'/'0', "<prompt tokens>|<all its tokens>" expected) x m.
# Returns {jobs still on the queue, then (id, tenant charged in advance or '', the advance: its prompt tokens, the
# job's hash (flat)) per job taken}.
_TAKE = """
local queue, prefix, counters = KEYS[1], ARGV[1], KEYS[7]
local function counter(t) return tonumber(redis.call('ZSCORE', counters, t) or '0') end
local weight = {}
local a = 11
for _ = 1, tonumber(ARGV[10]) do weight[ARGV[a]] = tonumber(ARGV[a + 1]); a = a + 2 end
local c = tonumber(ARGV[a]); a = a + 1
for _ = 1, c do redis.call('ZINCRBY', counters, ARGV[a + 1], ARGV[a]); a = a + 2 end
-- VTC's lift: the lowest counter among the tenants with waiting jobs (found once), else the highest of all
local lowest = false
local function lift(t)
  if lowest == false then
    lowest = nil
    for _, u in ipairs(redis.call('SMEMBERS', KEYS[5])) do
      if u ~= t and redis.call('LLEN', prefix .. u) > 0 then
        local cu = counter(u)
        if lowest == nil or cu < lowest then lowest = cu end
      end
    end
  end
  local target = lowest
  if target == nil then
    local top = redis.call('ZREVRANGE', counters, 0, 0, 'WITHSCORES')
    target = tonumber(top[2] or '0')
  end
  local ct = math.max(counter(t), target)
  if ct > counter(t) then redis.call('ZADD', counters, ct, t) end
  if lowest == nil or ct < lowest then lowest = ct end  -- t waits now
end
-- index what the look found, unless another worker moved the mark meanwhile (it indexed the same ids)
local m = tonumber(ARGV[a]); a = a + 1
if (redis.call('GET', KEYS[3]) or '') == ARGV[3] then
  for _ = 1, m do
    local id, t, deadline, front, cost = ARGV[a], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3], ARGV[a + 4]
    a = a + 5
    if redis.call('HSETNX', KEYS[4], id, cost) == 1 then
      if deadline ~= '' then
        redis.call('ZADD', KEYS[6], deadline, id .. '|' .. t)
      else  -- pushed first (the reply is the list's length); a list that was empty lifts its tenant
        local list = prefix .. t
        local n = redis.call(front == '1' and 'LPUSH' or 'RPUSH', list, id)
        if n == 1 then
          lift(t)
          redis.call('SADD', KEYS[5], t)  -- a tenant with waiting ids is in the set from its first on
        end
      end
    end
  end
  if ARGV[4] ~= '' then redis.call('SET', KEYS[3], ARGV[4]) end
end
if redis.call('LLEN', queue) == 0 then  -- nothing waits: whatever the index holds is stale (canceled, emptied)
  for _, t in ipairs(redis.call('SMEMBERS', KEYS[5])) do redis.call('DEL', prefix .. t) end
  redis.call('DEL', KEYS[3], KEYS[4], KEYS[5], KEYS[6])
  return {0}
end
local out, left, pops, estimate = {0}, tonumber(ARGV[5]), tonumber(ARGV[7]), tonumber(ARGV[6])
local extra = {}  -- by tenant: the tokens expected of the jobs this take gave it, beyond their prompts
local mark = redis.call('GET', KEYS[3])
local function claim(id, t)
  local cost = redis.call('HGET', KEYS[4], id) or ('0|' .. estimate)
  local prompt, all = string.match(cost, '^([^|]*)|(.*)$')
  prompt, all = tonumber(prompt), tonumber(all)
  redis.call('HDEL', KEYS[4], id)
  local hash = redis.call('HGETALL', ARGV[2] .. id)
  if #hash == 0 then  -- its hash is gone (deleted, expired): off the queue too, as RQ drops such ids
    redis.call('LREM', queue, 1, id)
    return false
  end
  local status = nil
  for i = 1, #hash, 2 do
    if hash[i] == ARGV[8] then status = hash[i + 1]; break end
  end
  if status ~= ARGV[9] then return false end  -- canceled, ended
  if id == mark then  -- the mark moves to the id before it (none: look from the head)
    local p = redis.call('LPOS', queue, id)
    mark = p and p > 0 and redis.call('LINDEX', queue, p - 1)
    if mark then redis.call('SET', KEYS[3], mark) else redis.call('DEL', KEYS[3]) end
  end
  if redis.call('LREM', queue, 1, id) == 0 then return false end
  redis.call('RPUSH', KEYS[2], id)
  local now = nil
  if t ~= '' then  -- its prompt charged now, as VTC does at admission; the rest as it is generated
    now = tonumber(redis.call('ZINCRBY', counters, prompt / (weight[t] or 1), t))
    extra[t] = (extra[t] or 0) + (all - prompt) / (weight[t] or 1)
  end
  out[#out + 1] = id
  out[#out + 1] = t
  out[#out + 1] = tostring(prompt)
  out[#out + 1] = hash
  return true, now
end
while left > 0 and pops > 0 do  -- deadline jobs first, earliest first
  local first = redis.call('ZPOPMIN', KEYS[6])
  if #first == 0 then break end
  pops = pops - 1
  local id, t = string.match(first[1], '^([^|]*)|(.*)$')  -- RQ's job ids have no |
  if claim(id, t) then left = left - 1 end
end
-- then the tenant with the lowest counter, plus what this take gave it: a heap of (counter, tenant)
local heap = {}
local function less(x, y) return x[1] < y[1] or (x[1] == y[1] and x[2] < y[2]) end
local function push(x)
  heap[#heap + 1] = x
  local i = #heap
  while i > 1 do
    local p = math.floor(i / 2)
    if not less(heap[i], heap[p]) then break end
    heap[i], heap[p] = heap[p], heap[i]
    i = p
  end
end
local function pop()
  local top, last = heap[1], table.remove(heap)
  if #heap > 0 then
    heap[1] = last
    local i = 1
    while true do
      local l, r, s = 2 * i, 2 * i + 1, i
      if l <= #heap and less(heap[l], heap[s]) then s = l end
      if r <= #heap and less(heap[r], heap[s]) then s = r end
      if s == i then break end
      heap[i], heap[s] = heap[s], heap[i]
      i = s
    end
  end
  return top
end
if left > 0 then
  for _, t in ipairs(redis.call('SMEMBERS', KEYS[5])) do push({counter(t) + (extra[t] or 0), t}) end
end
while left > 0 and pops > 0 and #heap > 0 do
  local e = pop()
  local id = redis.call('LPOP', prefix .. e[2])
  if not id then
    redis.call('SREM', KEYS[5], e[2])
  else
    pops = pops - 1
    local taken, now = claim(id, e[2])
    if taken then
      left = left - 1
      e[1] = (now or counter(e[2])) + (extra[e[2]] or 0)  -- the counter as the claim left it
    end
    push(e)
  end
end
-- the index is empty but the queue is not (the look fell behind): its head, first come first served
if left > 0 and pops > 0 and redis.call('SCARD', KEYS[5]) == 0 and redis.call('ZCARD', KEYS[6]) == 0 then
  while left > 0 do
    local id = redis.call('LMOVE', queue, KEYS[2], 'LEFT', 'RIGHT')
    if not id then break end
    redis.call('HDEL', KEYS[4], id)
    if id == mark then
      mark = false
      redis.call('DEL', KEYS[3])
    end
    out[#out + 1] = id
    out[#out + 1] = ''
    out[#out + 1] = '0'
    out[#out + 1] = redis.call('HGETALL', ARGV[2] .. id)
    left = left - 1
  end
end
out[1] = redis.call('LLEN', queue)
return out
"""

# KEYS: counters. ARGV: (tenant, amount) pairs.
_CHARGE = """
for i = 1, #ARGV, 2 do redis.call('ZINCRBY', KEYS[1], ARGV[i + 1], ARGV[i]) end
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
    """Add `amounts` (tokens / weight, by tenant; negative: a refund) to the fleet's counters."""
    if amounts:
        args = [x for tenant, amount in amounts.items() for x in (tenant, repr(float(amount)))]
        conn.eval(_CHARGE, 1, keys.fair_counters_key(), *args)


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
        tenant = decoded(member).partition("|")[2]
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

    def estimate(self) -> float:
        """A job's expected tokens when its data does not say (taken unindexed)."""
        ...

    def typical(self) -> float | None:
        """The tokens this worker's jobs generated so far, on average (None: none ended yet)."""
        ...

    def take_pending(self) -> dict[str, float]:
        """The charges not yet added to the counters (tokens / weight, by tenant), handed over."""
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
        self._look = conn.register_script(_LOOK)
        self._take = conn.register_script(_TAKE)

    def take(self, queues: list[Queue], room: int) -> list[tuple[str, Queue, Job | None]]:
        """Up to `room` jobs, the queues in order (a queue's jobs all come before the next queue's: a queue that
        still holds jobs after a short take ends it): (id, queue, the job as its hash was, None if it has none), as
        rq_start.dequeue gives them. A Redis error after a queue's jobs were taken returns those (the next take
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
                taken.append(
                    (job_id, queue, rq_start.restored(self.conn, job_id, flat[i + 3], self.serializer))
                )
            if flat[0] and len(taken) < room:
                break  # jobs still wait here that this take did not reach: no lower queue goes first
        return taken

    def _take_from(self, queue: Queue, room: int) -> list[Any]:
        """Index what `queue` holds past the mark, claim up to `room` of its jobs: the script's reply (flat)."""
        name = queue.name
        mark, indexed = keys.fair_key(name, "mark"), keys.fair_key(name, "indexed")
        prefix = rq_start.job_hash_prefix()
        looked = self._look(keys=[queue.key, mark, indexed], args=[LOOK_LIMIT, HEAD, prefix, SCAN_BACK])
        expected, newest, found = decoded(looked[0]), decoded(looked[1]), looked[2:]
        entries: list[str] = []
        for i in range(0, len(found), 3):
            kwargs = rq_start.job_kwargs(found[i + 2], self.serializer)
            place = placement(kwargs)
            deadline = "" if place.deadline is None else repr(place.deadline)
            prompt, total = expected_tokens(kwargs, self.accounts.typical())
            cost = f"{prompt!r}|{total!r}"
            entries += [decoded(found[i]), place.tenant, deadline, decoded(found[i + 1]), cost]
        pending = self.accounts.take_pending()  # handed over last: an error before the script keeps them owed
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
                POPS * room + EXTRA_POPS,
                rq_store.JOB_STATUS_FIELD,
                rq_store.QUEUED,
                len(self.weights) // 2,
                *self.weights,
                len(charges) // 2,
                *charges,
                len(entries) // 5,
                *entries,
            ],
        )
