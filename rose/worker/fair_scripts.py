"""The Lua scripts of the fair intake (rose.worker.fair_queue, whose docstring states the policy and the keys):
`LOOK` reads what a queue holds past the index's mark, `TAKE` indexes it and claims jobs, `LOOK_TAKE` looks and,
finding nothing new, takes in the same script (a take's first script); `CHARGE` adds to the fleet's counters. Each
runs atomically in Redis."""

# The mark's record, read by both scripts: "<id>|<its job's enqueued_at as a look read it>" (TAKE's set_mark; with
# no mark, "|<the last one's stamp>"). Against the mark `id` ('' for none): the stamp it holds and whether the mark's
# job came back since (a requeue stamps it anew); nil, false: no record of this mark (one an earlier version set).
_MARK_RECORD = """
local function mark_record(key, prefix, field, id)
  local rid, at = string.match(redis.call('GET', key) or '', '^(.*)|([^|]*)$')
  if rid ~= id then return nil, false end
  return at, id ~= '' and redis.call('HGET', prefix .. id, field) ~= at
end
"""

# KEYS: queue, mark, order (the index: its ids), the mark's record ("<id>|<its job's enqueued_at>" as a look read it,
# TAKE's set_mark).
# ARGV: limit, head (at least 1), job hash prefix, scan back, ids read around where the mark should be (from the tail,
# then around as many ids from the head as the index holds), the job hash's enqueued_at field. Returns {mark, newest
# id looked at, its enqueued_at as read, then (id, front "1"/"0", the job's data) for each id not in the index}.
_LOOK = """
local mark = redis.call('GET', KEYS[2])
-- the mark's job left the queue and came back (a canceled job requeued: RQ puts it at the tail and stamps it anew),
-- past ids no look read: the mark says nothing of them. They follow the newest indexed id enqueued no later than the
-- mark was (`since`; an indexed id stamped later came back as well), found from the tail, as when the mark's job has
-- left. A mark without its record (set by an earlier version) is trusted, and the tail's indexed ids with it.
local since, came_back = mark_record(KEYS[4], ARGV[3], ARGV[6], mark or '')  -- with no mark, the last one's stamp
local start = nil
if mark and not came_back then  -- LPOS reads one id after another: where the mark should be is read first
  local near, n = tonumber(ARGV[5]), redis.call('LLEN', KEYS[1])
  local p = redis.call('LPOS', KEYS[1], mark, 'RANK', -1, 'MAXLEN', near)  -- a look that keeps up: near the tail
  if p then
    start = p + 1
  else  -- behind a burst: the ids up to the mark are about the indexed ones (fewer when some left the queue)
    local guess = math.min(redis.call('ZCARD', KEYS[3]), n) - 1
    local lo = math.max(0, guess - near)
    local around = redis.call('LRANGE', KEYS[1], lo, guess + 16)
    for j = #around, 1, -1 do
      if around[j] == mark then start = lo + j; break end
    end
    if start == nil then  -- from the nearer end
      if guess * 2 < n then
        p = redis.call('LPOS', KEYS[1], mark)
      else
        p = redis.call('LPOS', KEYS[1], mark, 'RANK', -1)
      end
      if p then start = p + 1 end
    end
  end
end
local function stayed(id)  -- an indexed id: the ids after it were read, unless it came back after the mark was set
  if not since then return true end
  local at = redis.call('HGET', ARGV[3] .. id, ARGV[6])
  return at ~= false and at <= since  -- RQ's stamps (ISO 8601, UTC, fixed width) sort as they read
end
if start == nil then  -- no mark, its job left the queue, or came back: after the newest indexed id, from the tail
  start = 0
  local n, back = redis.call('LLEN', KEYS[1]), tonumber(ARGV[4])
  local i = n - 1
  while i >= 0 and i >= n - back and start == 0 do
    local lo = math.max(0, i - 255, n - back)
    local chunk = redis.call('LRANGE', KEYS[1], lo, i)
    local indexed = #chunk > 0 and redis.call('ZMSCORE', KEYS[3], unpack(chunk)) or {}  -- one call a chunk
    for j = #chunk, 1, -1 do
      if indexed[j] and stayed(chunk[j]) then start = lo + j; break end
    end
    i = lo - 1
  end
end
local limit = tonumber(ARGV[1])
local tail = redis.call('LRANGE', KEYS[1], start, start + limit - 1)
local newest = tail[#tail]
local out = {mark or '', newest or '', newest and redis.call('HGET', ARGV[3] .. newest, ARGV[6]) or ''}
local seen = {}
-- the ids not in the index, with their data: one ZMSCORE tells which are in it (a call for the tail, one for the
-- head's window; not one an id)
local function add(ids, from, to, step, front)
  if #ids == 0 then return end
  local known = redis.call('ZMSCORE', KEYS[3], unpack(ids))
  for i = from, to, step do
    local id = ids[i]
    if not seen[id] and not known[i] then
      seen[id] = true
      out[#out + 1] = id
      out[#out + 1] = front
      out[#out + 1] = redis.call('HGET', ARGV[3] .. id, 'data') or ''
    end
  end
end
add(tail, 1, #tail, 1, '0')
if start > 1 then  -- ahead of the mark: ids pushed to the front since
  local head = redis.call('LRANGE', KEYS[1], 0, math.min(tonumber(ARGV[2]), start - 1) - 1)
  add(head, #head, 1, -1, '1')  -- pushed to the front of the tenant's list in this order
end
return out
"""

# KEYS: queue, intermediate, mark, order (a sorted set: the indexed ids by their place in the queue), tenants,
# deadlines, counters (a sorted set: tenant -> service), the mark's record (LOOK).
# ARGV: tenant list prefix, job hash prefix, expected mark, new mark, room, max pops, job status field, its queued
# value, how far from the head a claim moves the head's id into its place (`unqueue`), the job hash's enqueued_at
# field, the new mark's enqueued_at as the look read it, the job hash's timeout field, n weights, (tenant, weight) x
# n, c charges, (tenant, amount) x c, m entries, (id, tenant, deadline or '', front '1'/'0', "<prompt tokens>|<all
# its tokens>" expected) x m.
# A tenant's list holds "<id>|<prompt tokens>|<all its tokens>", the deadlines "<id>|<prompt>|<all>|<tenant>".
# Returns {jobs still on the queue, then (id, tenant charged in advance or '', the advance: its prompt tokens, {the
# job's status, its timeout}) per job taken}.
_TAKE = """
local queue, prefix, order, counters, FAR = KEYS[1], ARGV[1], KEYS[4], KEYS[7], tonumber(ARGV[9])
-- the counters this take read or charged, kept here and written once a tenant at its end (`charged`): a claim adds
-- as ZINCRBY would (the same doubles), without a call a job. Nothing may read the counters from Redis once a claim
-- charged one (lift's ZREVRANGE runs while indexing, before any claim)
local known, charged = {}, {}
local function counter(t)
  if known[t] == nil then known[t] = tonumber(redis.call('ZSCORE', counters, t) or '0') end
  return known[t]
end
local function add_to(t, x)
  known[t] = counter(t) + x
  charged[t] = true
  return known[t]
end
local weight = {}
local a = 14
for _ = 1, tonumber(ARGV[13]) do weight[ARGV[a]] = tonumber(ARGV[a + 1]); a = a + 2 end
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
  if ct > counter(t) then redis.call('ZADD', counters, ct, t); known[t] = ct end
  if lowest == nil or ct < lowest then lowest = ct end  -- t waits now
end
-- the mark with its record: its job's enqueued_at when the ids up to it were read (by the look: a requeue since then
-- is a coming back), by which a look tells it came back. No mark (false): the record keeps the last one's stamp,
-- which still tells the indexed ids that came back since
local function set_mark(id, at)
  if id then
    redis.call('SET', KEYS[3], id)
    if at and at ~= '' then redis.call('SET', KEYS[8], id .. '|' .. at) else redis.call('DEL', KEYS[8]) end
  else
    redis.call('DEL', KEYS[3])
    local record = redis.call('GET', KEYS[8])
    if record then redis.call('SET', KEYS[8], string.match(record, '|[^|]*$')) end
  end
end
-- index what the look found, unless another worker moved the mark meanwhile (it indexed the same ids)
local m = tonumber(ARGV[a]); a = a + 1
if (redis.call('GET', KEYS[3]) or '') == ARGV[3] then
  -- each id's place: after the newest indexed for the ids past the mark, before the first for those at the head
  local last = m > 0 and redis.call('ZRANGE', order, -1, -1, 'WITHSCORES') or {}
  local first = m > 0 and redis.call('ZRANGE', order, 0, 0, 'WITHSCORES') or {}
  local back, front_place = tonumber(last[2] or '0'), tonumber(first[2] or '0')
  local listed = {}
  for _ = 1, m do
    local id, t, deadline, front, cost = ARGV[a], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3], ARGV[a + 4]
    a = a + 5
    local place = front == '1' and front_place - 1 or back + 1
    if redis.call('ZADD', order, 'NX', place, id) == 1 then  -- not indexed yet (by another take)
      if front == '1' then front_place = place else back = place end
      if deadline ~= '' then
        redis.call('ZADD', KEYS[6], deadline, id .. '|' .. cost .. '|' .. t)
      else  -- pushed first (the reply is the list's length); a list that was empty lifts its tenant
        local list = prefix .. t
        if redis.call(front == '1' and 'LPUSH' or 'RPUSH', list, id .. '|' .. cost) == 1 then lift(t) end
        if not listed[t] then  -- every take: a set that lost a tenant is mended by its next job
          redis.call('SADD', KEYS[5], t)
          listed[t] = true
        end
      end
    end
  end
  if ARGV[4] ~= '' then set_mark(ARGV[4], ARGV[11]) end
end
if redis.call('LLEN', queue) == 0 then  -- nothing waits: whatever the index holds is stale (canceled, emptied)
  for _, t in ipairs(redis.call('SMEMBERS', KEYS[5])) do redis.call('DEL', prefix .. t) end
  redis.call('DEL', KEYS[3], order, KEYS[5], KEYS[6], KEYS[8])
  return {0}
end
local out, left, pops = {0}, tonumber(ARGV[5]), tonumber(ARGV[6])
local extra = {}  -- by tenant: the tokens expected of the jobs this take gave it, beyond their prompts
local mark = redis.call('GET', KEYS[3])
-- where an indexed id is in the queue's list: its place in the order, checked, else searched around it (ids that
-- left the queue put it off); nil: not found there
local function locate(id, place)
  if not place then return nil end
  if redis.call('LINDEX', queue, place) == id then return place end
  local lo = math.max(0, place - FAR)
  local around = redis.call('LRANGE', queue, lo, place + 16)
  for j = #around, 1, -1 do
    if around[j] == id then return lo + j - 1 end
  end
  return nil
end
-- off the queue's list into the intermediate one (false: it was not on the queue's list). First in the order
-- (`place` 0): most likely the queue's head, moved in one LMOVE (another id found there, one no look indexed, goes
-- back). LREM reads every id ahead of it, so one far from the head (`at`, located) has the head's id moved into its
-- place instead (LSET, then LPOP: a walk over the list's nodes, not its ids), which takes its place in the order too.
-- Not the mark (the ids it would jump would be before the mark unread), and only an indexed id (its tenant's list
-- keeps its turn; no look need see it again).
local function unqueue(id, at, score, place)
  if place == 0 then
    local moved = redis.call('LMOVE', queue, KEYS[2], 'LEFT', 'RIGHT')
    if moved == id then return true end
    if moved then redis.call('LMOVE', KEYS[2], queue, 'RIGHT', 'LEFT') end
  end
  if score and at and at >= FAR then  -- its place known far from the head, and where it is
    local head = redis.call('LINDEX', queue, 0)
    if head ~= id and head ~= mark and redis.call('ZSCORE', order, head) then
      redis.call('LSET', queue, at, head)
      redis.call('LPOP', queue)
      redis.call('ZADD', order, score, head)
      redis.call('RPUSH', KEYS[2], id)
      return true
    end
  end
  if redis.call('LREM', queue, 1, id) == 0 then return false end
  redis.call('RPUSH', KEYS[2], id)
  return true
end
local function claim(id, t, prompt, all)
  local place = redis.call('ZRANK', order, id)
  local score = place and place >= FAR and redis.call('ZSCORE', order, id)  -- far: the head's id takes it
  redis.call('ZREM', order, id)
  -- its status and timeout (rq_start.CLAIM_FIELDS), all a start needs: not the whole hash (stale ids may be many;
  -- the start reads the hash of those it starts)
  local head = redis.call('HMGET', ARGV[2] .. id, ARGV[7], ARGV[12])
  local status = head[1]
  if not status then  -- its hash is gone (deleted, expired): off the queue too, as RQ drops such ids
    redis.call('LREM', queue, 1, id)
    return false
  end
  if status ~= ARGV[8] then return false end  -- canceled, ended
  local at = (id == mark or score) and locate(id, place)
  -- the mark moves to the id before it (none: look from the head), unless its job came back since the ids up to it
  -- were read (its stamp is not the record's): those before it now arrived meanwhile, and the next look reads them
  if id == mark and not select(2, mark_record(KEYS[8], ARGV[2], ARGV[10], id)) then
    local p = at or redis.call('LPOS', queue, id)
    mark = p and p > 0 and redis.call('LINDEX', queue, p - 1)
    set_mark(mark, mark and redis.call('HGET', ARGV[2] .. mark, ARGV[10]))
  end
  if not unqueue(id, at, score, place) then return false end
  local now = nil
  if t ~= '' then  -- its prompt charged now, as VTC does at admission; the rest as it is generated
    now = add_to(t, prompt / (weight[t] or 1))
    extra[t] = (extra[t] or 0) + (all - prompt) / (weight[t] or 1)
  end
  out[#out + 1] = id
  out[#out + 1] = t
  out[#out + 1] = tostring(prompt)
  out[#out + 1] = head
  return true, now
end
while left > 0 and pops > 0 do  -- deadline jobs first, earliest first
  local first = redis.call('ZPOPMIN', KEYS[6])
  if #first == 0 then break end
  pops = pops - 1
  local id, prompt, all, t = string.match(first[1], '^([^|]*)|([^|]*)|([^|]*)|(.*)$')  -- RQ's job ids have no |
  if claim(id, t, tonumber(prompt), tonumber(all)) then left = left - 1 end
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
  local entry = redis.call('LPOP', prefix .. e[2])
  if not entry then
    redis.call('SREM', KEYS[5], e[2])
  else
    pops = pops - 1
    local id, prompt, all = string.match(entry, '^([^|]*)|([^|]*)|(.*)$')
    local taken, now = claim(id, e[2], tonumber(prompt), tonumber(all))
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
    redis.call('ZREM', order, id)
    if id == mark then
      mark = false
      set_mark(false)
    end
    out[#out + 1] = id
    out[#out + 1] = ''
    out[#out + 1] = '0'
    out[#out + 1] = redis.call('HMGET', ARGV[2] .. id, ARGV[7], ARGV[12])
    left = left - 1
  end
end
for t in pairs(charged) do redis.call('ZADD', counters, known[t], t) end
out[1] = redis.call('LLEN', queue)
return out
"""

LOOK, TAKE = _MARK_RECORD + _LOOK, _MARK_RECORD + _TAKE


def _function(name: str, body: str) -> str:
    """A script's `body` (it reads KEYS and ARGV) as the Lua function `name(KEYS, ARGV)` another script calls."""
    return f"local function {name}(KEYS, ARGV)\n{body}end\n"


# A look that, finding nothing new (no id past the mark, none pushed to the front unread), takes at once: one round
# trip a take while the index holds every waiting job (a burst read, a worker taking as its sequences end). KEYS:
# TAKE's. ARGV: LOOK's six, then TAKE's (its expected mark, new mark and the new mark's enqueued_at set here, from
# the look; no entries). Returns {"took", TAKE's reply...}, or {"looked", LOOK's reply...} with nothing taken: the
# caller places what the look found and sends TAKE.
_LOOK_TAKE = """
local looked = look({KEYS[1], KEYS[3], KEYS[4], KEYS[8]}, {ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]})
if #looked > 3 then
  table.insert(looked, 1, 'looked')
  return looked
end
local args = {}
for i = 7, #ARGV do args[#args + 1] = ARGV[i] end
args[3], args[4], args[11] = looked[1], looked[2], looked[3]
local took = take(KEYS, args)
table.insert(took, 1, 'took')
return took
"""
LOOK_TAKE = _MARK_RECORD + _function("look", _LOOK) + _function("take", _TAKE) + _LOOK_TAKE

# KEYS: counters. ARGV: (tenant, amount) pairs.
CHARGE = """
for i = 1, #ARGV, 2 do redis.call('ZINCRBY', KEYS[1], ARGV[i + 1], ARGV[i]) end
return 0
"""
