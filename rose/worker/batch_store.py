"""The script that stores a batch of finished jobs in one round trip, only if every one is still this worker's
(rose.worker.retirer sends it; rose.worker.rq_store records RQ's writes it carries), and then stores the jobs'
streams at their size.

Contract: `store_if_ours` builds the command (`resp.pack_command` items), `stored_if_ours` reads its reply. The writes
are RQ's own (`rq_store.success_commands`) plus whatever must become visible with them (the jobs' `done` events); the
check is RQ's status and owner fields and its dependents set, as RQ's WATCH + MULTI/EXEC would guard them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from rose.jobs import keys as rose_keys
from rose.worker.rq_store import JOB_OWNER_FIELD, JOB_STATUS_FIELD, STARTED, decoded

if TYPE_CHECKING:
    from rose.worker.running import Running


# KEYS: each job's hash, then its dependents set; last, keys.OOM_PROBE_KEY. ARGV[1]: the status `started`;
# ARGV[2]: this worker's name;
# ARGV[3], ARGV[4]: the status and owner fields of a job hash; ARGV[5], ARGV[6]: the most entries and bytes of a
# stream compacted; ARGV[7]: how many streams to compact, their keys next; then the writes, each as its argument count
# followed by its arguments. The writes go through only if every job is still started by this worker and has no
# dependents to enqueue, all at once (a script is atomic, as RQ's WATCH + MULTI/EXEC is); a write Redis refuses does
# not stop the others (as in a MULTI/EXEC). Then each stream named of at most ARGV[5] entries and ARGV[6] bytes is
# copied and the copy renamed over it (`COMPACT_ENTRIES`, `COMPACT_BYTES`): the same entries, ids, groups and expiry,
# stored at their size; a Redis without COPY (before 6.2, or renamed away) leaves it as it was. Returns
# {1, refusals...} once written, {0} with nothing written. A full Redis (maxmemory) refuses a script's writes only
# until one is done: the first is a write that changes nothing (SET XX on a key never set), refused there with
# nothing written, rather than the pcall'd writes half refused.
_STORE_IF_OURS = """
for i = 1, #KEYS - 1, 2 do
  local f = redis.call('HMGET', KEYS[i], ARGV[3], ARGV[4])
  if f[1] ~= ARGV[1] or f[2] ~= ARGV[2] then return {0} end
  if redis.call('SCARD', KEYS[i + 1]) > 0 then return {0} end
end
local most, largest, streams = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local out, a = {1}, 8 + streams
redis.call('SET', KEYS[#KEYS], '', 'XX')
while a <= #ARGV do
  local n = tonumber(ARGV[a])
  local r = redis.pcall(unpack(ARGV, a + 1, a + n))
  if type(r) == 'table' and r.err then out[#out + 1] = r.err end
  a = a + n + 1
end
for i = 8, 7 + streams do
  local key = ARGV[i]
  local entries = redis.pcall('XLEN', key)
  if type(entries) == 'number' and entries > 0 and entries <= most then
    local size = redis.pcall('MEMORY', 'USAGE', key, 'SAMPLES', 0)
    if type(size) == 'number' and size <= largest then
      local copy = key .. ':compacting'
      if redis.pcall('COPY', key, copy) == 1 then redis.call('RENAME', copy, key) end
    end
  end
end
return out
"""

# Redis gives a stream's newest node 4 KB at its first entry and trims it only once it is full, so a finished job's
# two streams (RQ's result, rose's events: one entry each if it does not stream) kept ~4.7 KB each. A COPY stores the
# nodes at their size: 9.6 -> 3.4 KB a job for 13-18 µs of Redis's CPU on the benchmarks' VM
# (benchmarks/bench_command_price.py; DUMP + RESTORE: twice that). The copy grows with
# the stream while the saving is at most one node's spare room: large streams are left as they are. A token event
# stored as fields takes ~70 bytes at 4 tokens: a 128-token job streamed at a slow pace (~35-65 events) is inside.
COMPACT_ENTRIES = 256  # the most entries of a stream compacted at its job's end,
COMPACT_BYTES = 16384  # and the most bytes (MEMORY USAGE)


def store_if_ours(
    worker_name: str, runs: list[Running], writes: list[tuple[Any, ...]], compact: Iterable[str] = ()
) -> list[Any]:
    """The command (as `resp.pack_command` items) that stores a batch of finished jobs in one round trip: `writes`
    (`success_commands`, and whatever else must become visible with them), only if every job is still `started`
    by this worker and has no dependents; then the streams `compact` names are stored at their size
    (`COMPACT_ENTRIES`, `COMPACT_BYTES`). `stored_if_ours` reads its reply."""
    keys = [*(key for run in runs for key in (run.key, run.job.dependents_key)), rose_keys.OOM_PROBE_KEY]
    streams = list(compact)
    args: list[Any] = [STARTED, worker_name, JOB_STATUS_FIELD, JOB_OWNER_FIELD]
    args += [COMPACT_ENTRIES, COMPACT_BYTES, len(streams), *streams]
    for write in writes:
        args += [len(write), *write]
    return ["EVAL", _STORE_IF_OURS, len(keys), *keys, *args]


def stored_if_ours(reply: list[Any]) -> tuple[bool, list[str]]:
    """(stored, the refusals of writes Redis rejected) from `store_if_ours`'s reply."""
    return int(reply[0]) == 1, [decoded(err) or "" for err in reply[1:]]
