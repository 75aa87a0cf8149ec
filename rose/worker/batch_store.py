"""Storing a batch of finished jobs in two rounds on one connection, only if every one is still this worker's
(rose.worker.retirer sends them; rose.worker.rq_store records RQ's writes they carry), the jobs' streams stored at
their size.

Round 1 (`check_commands`): WATCH each job's hash and dependents set, read its status, owner and dependents, ask
whether Redis takes writes (a no-op SET XX, refused by a full Redis) and how large each stream is. `checked` reads the
replies. Round 2 (`store_commands`), only if every job is still `started` by this worker with no dependents: MULTI, the
writes (RQ's own, `rq_store.success_commands`, and whatever must become visible with them: the jobs' `done` events),
each small stream copied onto itself, EXEC. `stored` reads its replies. This is RQ's own guard (its
`handle_job_success` WATCHes the dependents key and writes in MULTI/EXEC): EXEC writes nothing if a watched key
changed since round 1 (a cancel, a stop, a dependent enqueued), and nothing if Redis refused a command as it was
queued (a full Redis: EXECABORT). A write Redis refuses as it runs (a wrong type) does not stop the others.

Why not one script: a Lua script pays for each write twice (its arguments made Lua strings, then Redis objects again,
and its reply parsed back into Lua): the same batch cost Redis 301k instructions a job through the script against
169k in two rounds (callgrind; benchmarks/README.md "What a not-streamed job costs Redis").
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from redis.exceptions import NoPermissionError

from rose.jobs import keys as rose_keys
from rose.worker.redis_guard import is_oom
from rose.worker.rq_store import JOB_OWNER_FIELD, JOB_STATUS_FIELD, STARTED, decoded

if TYPE_CHECKING:
    from rose.worker.running import Running

# Redis gives a stream's newest node 4 KB at its first entry and trims it only once it is full, so a finished job's
# two streams (RQ's result, rose's events: one entry each if it does not stream) kept ~4.7 KB each. A COPY stores the
# nodes at their size: 9.6 -> 3.4 KB a job for 13-18 µs of Redis's CPU on the benchmarks' VM
# (benchmarks/bench_command_price.py; DUMP + RESTORE: twice that). The copy grows with
# the stream while the saving is at most one node's spare room: large streams are left as they are. A token event
# stored as fields takes ~70 bytes at 4 tokens: a 128-token job streamed at a slow pace (~35-65 events) is inside.
COMPACT_ENTRIES = 256  # the most entries of a stream compacted at its job's end (as round 1 read it),
COMPACT_BYTES = 16384  # and the most bytes (MEMORY USAGE)
_COMPACTING = ":compacting"  # the copy's key: the stream's own, with this suffix


class Stored(enum.Enum):
    """What round 2 did: `STORED` (every write done); `ABORTED` (a watched key changed: nothing written);
    `REFUSED` (Redis refused a write as it was queued, nothing written, or as it ran, the others written)."""

    STORED = "stored"
    ABORTED = "aborted"
    REFUSED = "refused"


@dataclass(slots=True)
class Checked:
    """Round 1's findings: `ours` (every job still `started` by this worker, with no dependents), `refusal` (Redis
    refused the no-op write: full; nothing to send), `compact` (the streams small enough to copy), `copy` (whether
    Redis has COPY, if round 1 asked; None if not)."""

    ours: bool
    refusal: Exception | None = None
    compact: list[str] = field(default_factory=list)
    copy: bool | None = None


@dataclass(slots=True)
class Outcome:
    """Round 2's replies read: what became of the writes (`stored`, `refusals`), and `copy`: False if Redis
    refused COPY as unknown or not allowed (an ACL: ask no more), else None (the writes stand either way)."""

    stored: Stored
    refusals: list[str] = field(default_factory=list)
    copy: bool | None = None
    full: bool = False  # REFUSED because Redis is full (maxmemory): nothing written


def check_commands(
    runs: Sequence[Running], streams: Sequence[str], ask_copy: bool = False
) -> list[tuple[Any, ...]]:
    """Round 1: WATCH every job's hash and dependents set; their status, owner and dependents; a no-op write
    (refused by a full Redis before anything is queued); each stream's entries and bytes; `ask_copy`: whether Redis
    has COPY (6.2 and later, unless renamed away or denied)."""
    watched = [key for run in runs for key in (run.key, run.job.dependents_key)]
    out: list[tuple[Any, ...]] = [("WATCH", *watched), ("SET", rose_keys.OOM_PROBE_KEY, "", "XX")]
    for run in runs:
        out += [("HMGET", run.key, JOB_STATUS_FIELD, JOB_OWNER_FIELD), ("SCARD", run.job.dependents_key)]
    for stream in streams:
        out += [("XLEN", stream), ("MEMORY", "USAGE", stream, "SAMPLES", "0")]
    return out + [("COMMAND", "INFO", "COPY")] if ask_copy else out


def checked(
    worker_name: str,
    runs: Sequence[Running],
    streams: Sequence[str],
    writes: Sequence[tuple[Any, ...]],
    replies: list[Any],
) -> Checked:
    """Round 1's replies (an error reply as its exception) read; `writes`: round 2's, whose XADDs size a stream not
    there yet. A Redis error but the no-op write's and the streams' (a WATCH or a job's read refused) is raised."""
    watch, probe, *rest = replies
    for reply in (watch, *rest[: 2 * len(runs)]):
        if isinstance(reply, Exception):
            raise reply
    if isinstance(probe, Exception):
        return Checked(ours=False, refusal=probe)
    mine = [STARTED, worker_name]
    for i in range(len(runs)):
        state, dependents = rest[2 * i], rest[2 * i + 1]
        if [decoded(v) for v in state] != mine or dependents:
            return Checked(ours=False)
    sizes = rest[2 * len(runs) : 2 * len(runs) + 2 * len(streams)]
    asked = rest[2 * len(runs) + 2 * len(streams) :]
    copy = None if not asked else isinstance(asked[0], list) and bool(asked[0] and asked[0][0])
    if copy is False:
        return Checked(ours=True, copy=False)
    added = _added_bytes(writes)
    # round 2 adds an entry to each; a reply that is no number (MEMORY renamed away, a key of another type): left
    # as it is; a stream not there yet (0 entries, no size) is what round 2 adds to it, if anything
    compact = [
        stream
        for stream, entries, size in zip(streams, sizes[::2], sizes[1::2], strict=True)
        if isinstance(entries, int) and entries < COMPACT_ENTRIES
        if (size is None and 0 < added.get(stream, 0) <= COMPACT_BYTES)
        or (isinstance(size, int) and size <= COMPACT_BYTES)
    ]
    return Checked(ours=True, compact=compact, copy=copy)


def _added_bytes(writes: Sequence[tuple[Any, ...]]) -> dict[str, int]:
    """The bytes of the arguments each stream's XADDs in `writes` carry, by stream."""
    added: dict[str, int] = {}
    for write in writes:
        if str(write[0]).upper() == "XADD":
            key = decoded(write[1]) or ""
            added[key] = added.get(key, 0) + sum(len(str(a)) for a in write[2:])
    return added


def store_commands(writes: Sequence[tuple[Any, ...]], compact: Sequence[str]) -> list[tuple[Any, ...]]:
    """Round 2: the writes in one MULTI/EXEC; then, in a second (an unknown or denied COPY aborts that one, not
    the writes), each stream of `compact` copied (REPLACE: a copy left by anything else is no matter) and the copy
    renamed over it: the same entries, ids, groups and expiry, stored at their size. The copies run even if the
    writes did not (a WATCH abort): a stream round 2 was to create is then not there (COPY 0, RENAME an error
    reply, nothing changed), one that was is copied as it is."""
    copies = [
        command
        for stream in compact
        for command in (
            ("COPY", stream, stream + _COMPACTING, "REPLACE"),
            ("RENAME", stream + _COMPACTING, stream),
        )
    ]
    return [("MULTI",), *writes, ("EXEC",), *([("MULTI",), *copies, ("EXEC",)] if copies else [])]


def stored(replies: list[Any], writes: int) -> Outcome:
    """Round 2's replies read (`store_commands`'s: MULTI's, one per write queued, EXEC's; then the copies' own
    MULTI, queued and EXEC, if any). `writes`: how many writes the first transaction held."""
    queued, done, copies = replies[1 : writes + 1], replies[writes + 1], replies[writes + 2 :]
    denied = any(
        isinstance(r, NoPermissionError) or (isinstance(r, Exception) and "unknown command" in str(r))
        for r in copies
    )
    copy = False if denied else None
    if done is None:
        return Outcome(Stored.ABORTED, copy=copy)
    if isinstance(done, Exception):  # EXECABORT: a command refused as it was queued (OOM, unknown command)
        errors = [r for r in queued if isinstance(r, Exception)] or [done]
        full = any(map(is_oom, errors))
        return Outcome(Stored.REFUSED, [str(r) for r in errors], copy, full)
    refused = [str(r) for r in done if isinstance(r, Exception)]
    return Outcome(Stored.REFUSED if refused else Stored.STORED, refused, copy)
