"""Storing a batch of finished jobs in two rounds on one connection, only if every one is still this worker's
(rose.worker.retirer sends them; rose.worker.rq_store records RQ's writes they carry), the jobs' streams stored at
their size.

Round 1 (`check_commands`): WATCH each job's hash and dependents set, read its status, owner and dependents, ask
whether Redis takes writes (a no-op SET XX, refused by a full Redis), how large each stream is and Redis's clock.
`checked` reads the replies. Round 2 (`store_commands`), only if every job is still `started` by this worker with no
dependents: MULTI, the writes (RQ's own, `rq_store.success_commands`, and whatever must become visible with them: the
jobs' `done` events), EXEC; a stream not there yet is created by RESTORE at its size instead of XADD
(rose.worker.stream_dump; its EXPIRE folded in), and each small stream that was there is copied onto itself. `stored`
reads its replies. This is RQ's own guard (its
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

from redis.exceptions import (
    ClusterDownError,
    MasterDownError,
    NoPermissionError,
    ReadOnlyError,
    TryAgainError,
)

from rose.jobs import keys as rose_keys
from rose.worker import stream_dump
from rose.worker.redis_guard import is_oom
from rose.worker.rq_store import JOB_OWNER_FIELD, JOB_STATUS_FIELD, STARTED, decoded

if TYPE_CHECKING:
    from rose.worker.running import Running

# Redis gives a stream's newest node 4 KB at its first entry and trims it only once it is full, so a finished job's
# two streams (RQ's result, rose's events: one entry each if it does not stream) kept ~4.7 KB each. A stream round 2
# creates is RESTOREd at its size (rose.worker.stream_dump); one that is there already (a streamed job's events) is
# copied onto itself, which stores its nodes at their size. The copy grows with the stream while the saving is at
# most one node's spare room: large streams are left as they are. A token event stored as fields takes ~70 bytes at
# 4 tokens: a 128-token job streamed at a slow pace (~35-65 events) is inside.
# the most bytes (MEMORY USAGE, as round 1 read it) of a stream compacted at its job's end
COMPACT_BYTES = 16384
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
    refused the no-op write: full; nothing to send), `compact` (the streams there and small enough to copy),
    `restore` (the streams not there yet, to create by RESTORE, their entries' ids at `now_ms`: Redis's clock),
    `copy` (whether Redis has COPY, if round 1 asked; None if not)."""

    ours: bool
    refusal: Exception | None = None
    compact: list[str] = field(default_factory=list)
    restore: list[str] = field(default_factory=list)
    now_ms: int = 0
    copy: bool | None = None


@dataclass(slots=True)
class Outcome:
    """Round 2's replies read: what became of the writes (`stored`, `refusals`), and `copy`: False if Redis
    refused COPY as unknown or not allowed (an ACL: ask no more), else None (the writes stand either way);
    `unrestored`: the streams whose RESTORE Redis refused as it ran (the other writes done: `rewrites` writes them
    with XADD), `restorable` False then unless each was there already (BUSYKEY)."""

    stored: Stored
    refusals: list[str] = field(default_factory=list)
    copy: bool | None = None
    full: bool = False  # REFUSED because Redis is full (maxmemory): nothing written
    unrestored: list[str] = field(default_factory=list)
    restorable: bool | None = None  # whether Redis took the probe's stream (None: not asked, or cannot tell)


@dataclass(frozen=True, slots=True)
class Asks:
    """What round 1 asks beyond the jobs: `copy` (whether Redis has COPY: 6.2 and later, unless renamed away or
    denied), `clock` (its TIME: the ids of the entries restored)."""

    copy: bool = False
    clock: bool = False


def check_commands(
    runs: Sequence[Running], streams: Sequence[str], asks: Asks = Asks()
) -> list[tuple[Any, ...]]:
    """Round 1: WATCH every job's hash and dependents set; their status, owner and dependents; a no-op write
    (refused by a full Redis before anything is queued); each stream's bytes (None: not there); then what `asks`
    says."""
    watched = [key for run in runs for key in (run.key, run.job.dependents_key)]
    out: list[tuple[Any, ...]] = [("WATCH", *watched), ("SET", rose_keys.OOM_PROBE_KEY, "", "XX")]
    for run in runs:
        out += [("HMGET", run.key, JOB_STATUS_FIELD, JOB_OWNER_FIELD), ("SCARD", run.job.dependents_key)]
    out += [("MEMORY", "USAGE", stream, "SAMPLES", "0") for stream in streams]
    if asks.clock:
        out.append(("TIME",))
    if asks.copy:
        out.append(("COMMAND", "INFO", "COPY"))
    return out


def checked(
    worker_name: str,
    runs: Sequence[Running],
    streams: Sequence[str],
    writes: Sequence[tuple[Any, ...]],
    replies: list[Any],
    asks: Asks = Asks(),
    copy: bool | None = None,
) -> Checked:
    """Round 1's replies (an error reply as its exception) read, `check_commands(..., asks)`'s; `writes`: round 2's,
    whose XADDs size a stream not there yet (or make it, RESTOREd: with `asks.clock`, Redis taking restored streams);
    `copy`: whether Redis has COPY, as known before (None: unknown; what round 1 asked is read instead). A Redis
    error but the no-op write's, the streams' and the questions' (a WATCH or a job's read refused) is raised."""
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
    sizes = rest[2 * len(runs) : 2 * len(runs) + len(streams)]
    asked = iter(rest[2 * len(runs) + len(streams) :])
    clock = next(asked) if asks.clock else None
    now_ms = int(clock[0]) * 1000 + int(clock[1]) // 1000 if isinstance(clock, list) else 0
    if asks.copy:
        reply = next(asked)
        copy = isinstance(reply, list) and bool(reply and reply[0])
    added = _added_bytes(writes)
    made = set(_made(writes)) if now_ms > 0 else set()
    # a stream not there yet (no size) that round 2 makes with one XADD: RESTOREd at its size; else, once round 2
    # added its entry, copied if small; a reply that is no number (MEMORY renamed away, a key of another type): left
    # as it is
    restored = [
        stream for stream, size in zip(streams, sizes, strict=True) if size is None and stream in made
    ]
    compact = [
        stream
        for stream, size in zip(streams, sizes, strict=True)
        if copy is not False and stream not in restored
        if (size is None and 0 < added.get(stream, 0) <= COMPACT_BYTES)
        or (isinstance(size, int) and size <= COMPACT_BYTES)
    ]
    return Checked(
        ours=True, compact=compact, restore=restored, now_ms=now_ms, copy=copy if asks.copy else None
    )


def _added_bytes(writes: Sequence[tuple[Any, ...]]) -> dict[str, int]:
    """The bytes of the arguments each stream's XADDs in `writes` carry, by stream."""
    added: dict[str, int] = {}
    for write in writes:
        if str(write[0]).upper() == "XADD":
            key = decoded(write[1]) or ""
            added[key] = added.get(key, 0) + sum(len(str(a)) for a in write[2:])
    return added


def _made(writes: Sequence[tuple[Any, ...]]) -> dict[str, int]:
    """The streams `writes` add exactly one entry to, with an id Redis picks (`*`): stream -> where the XADD is."""
    made: dict[str, int] = {}
    seen: set[str] = set()
    for i, write in enumerate(writes):
        if str(write[0]).upper() == "XADD":
            key = decoded(write[1]) or ""
            if key in seen or _xadd_fields(write) is None:
                made.pop(key, None)
            else:
                made[key] = i
            seen.add(key)
    return made


def _xadd_fields(write: tuple[Any, ...]) -> list[tuple[bytes, bytes]] | None:
    """An XADD's (field, value) pairs if its id is `*` (its options skipped: MAXLEN / MINID [=|~] n [LIMIT n]),
    else None; None for NOMKSTREAM too (a RESTORE would make the stream it must not)."""
    args = [_encoded(a) for a in write[2:]]
    if b"NOMKSTREAM" in (a.upper() for a in args[: args.index(b"*") if b"*" in args else len(args)]):
        return None
    i = 0
    if i < len(args) and args[i].upper() in (b"MAXLEN", b"MINID"):
        i += 1
        i += 1 if i < len(args) and args[i] in (b"=", b"~") else 0
        i += 1
        i += 2 if i < len(args) and args[i].upper() == b"LIMIT" else 0
    if i >= len(args) or args[i] != b"*" or (len(args) - i - 1) % 2 or len(args) - i < 3:
        return None
    pairs = args[i + 1 :]
    return list(zip(pairs[::2], pairs[1::2], strict=True))


def _encoded(value: Any) -> bytes:
    """An argument as redis-py sends it."""
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    if isinstance(value, float):
        return repr(value).encode()
    return str(value).encode()


def _restoring(
    writes: Sequence[tuple[Any, ...]], streams: Sequence[str], now_ms: int
) -> list[tuple[Any, ...]]:
    """`writes` with each of `streams`' one XADD made a RESTORE of the stream it would create (its id: Redis's
    clock at round 1, `now_ms`-0), an EXPIRE or PERSIST of it right after folded in."""
    made = _made(writes)
    at = {made[stream]: stream for stream in streams if stream in made}
    out: list[tuple[Any, ...]] = []
    skip = -1
    for i, write in enumerate(writes):
        if i == skip:
            continue
        stream = at.get(i)
        if stream is None:
            out.append(write)
            continue
        fields = _xadd_fields(write)
        assert fields is not None
        ttl_ms = 0
        following = writes[i + 1] if i + 1 < len(writes) else ()
        if len(following) >= 2 and decoded(following[1]) == stream:
            name = str(following[0]).upper()
            if name == "EXPIRE" and len(following) == 3 and int(following[2]) > 0:
                ttl_ms, skip = int(following[2]) * 1000, i + 1
            elif name == "PERSIST":
                skip = i + 1
        out.append(("RESTORE", stream, ttl_ms, stream_dump.payload([((now_ms, 0), fields)])))
    return out


def store_commands(
    writes: Sequence[tuple[Any, ...]],
    compact: Sequence[str],
    restore: Sequence[str] = (),
    now_ms: int = 0,
    probe: bool = False,
) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """Round 2 and the writes its first transaction holds (for `stored`): the writes in one MULTI/EXEC, each stream of
    `restore` RESTOREd instead of XADDed (`_restoring`); then, in a second (an unknown or denied COPY aborts that
    one, not the writes), each stream of `compact` copied (REPLACE: a copy left by anything else is no matter) and
    the copy renamed over it: the same entries, ids, groups and expiry, stored at their size. The copies run even if
    the writes did not (a WATCH abort): a stream round 2 was to create is then not there (COPY 0, RENAME an error
    reply, nothing changed), one that was is copied as it is. `probe`: last, on its own, a stream restored onto
    `RESTORE_PROBE_KEY` (expiring at once): does Redis take them (`stored` reads its reply)?"""
    sent = _restoring(writes, restore, now_ms) if restore else list(writes)
    copies = [
        command
        for stream in compact
        for command in (
            ("COPY", stream, stream + _COMPACTING, "REPLACE"),
            ("RENAME", stream + _COMPACTING, stream),
        )
    ]
    commands = [("MULTI",), *sent, ("EXEC",), *([("MULTI",), *copies, ("EXEC",)] if copies else [])]
    if probe:
        payload = stream_dump.payload([((1, 0), [(b"probe", b"1")])])
        commands.append(("RESTORE", rose_keys.RESTORE_PROBE_KEY, 1, payload, "REPLACE"))
    return commands, sent


def stored(replies: list[Any], sent: Sequence[tuple[Any, ...]], probe: bool = False) -> Outcome:
    """Round 2's replies read (`store_commands`'s: MULTI's, one per write queued, EXEC's; then the copies' own
    MULTI, queued and EXEC, if any; then the probe's, if `probe`). `sent`: the writes the first transaction held."""
    restorable = _restorable(replies[-1]) if probe else None
    replies = replies[:-1] if probe else replies
    writes = len(sent)
    queued, done, copies = replies[1 : writes + 1], replies[writes + 1], replies[writes + 2 :]
    denied = any(
        isinstance(r, NoPermissionError) or (isinstance(r, Exception) and "unknown command" in str(r))
        for r in copies
    )
    copy = False if denied else None
    if done is None:
        return Outcome(Stored.ABORTED, copy=copy, restorable=restorable)
    if isinstance(done, Exception):  # EXECABORT: a command refused as it was queued (OOM, unknown command)
        errors = [r for r in queued if isinstance(r, Exception)] or [done]
        full = any(map(is_oom, errors))
        if any(  # RESTORE denied (an ACL, renamed away: a failover to another server?): restore no more
            str(c[0]).upper() == "RESTORE" and _restorable(r) is False
            for c, r in zip(sent, queued, strict=True)
        ):
            restorable = False
        return Outcome(Stored.REFUSED, [str(r) for r in errors], copy, full, restorable=restorable)
    unrestorable = [
        (decoded(command[1]) or "", reply)
        for command, reply in zip(sent, done, strict=True)
        if isinstance(reply, Exception) and str(command[0]).upper() == "RESTORE"
    ]
    # a stream made between the rounds (BUSYKEY: nothing but this batch should write it) is no reason to restore no
    # more; a payload or an ACL refused is
    if any(not str(reply).startswith("BUSYKEY") and _restorable(reply) is False for _, reply in unrestorable):
        restorable = False
    unrestored = [stream for stream, _ in unrestorable]
    refused = [
        str(reply)
        for command, reply in zip(sent, done, strict=True)
        if isinstance(reply, Exception) and str(command[0]).upper() != "RESTORE"
    ]
    stored = Stored.REFUSED if refused else Stored.STORED
    return Outcome(stored, refused, copy, unrestored=unrestored, restorable=restorable)


# refusals that say nothing of RESTORE (as redis-py names them; a Redis loading its data raises instead): a replica
# (mid-failover), its primary down, a cluster's move, a script running
_PASSING = (ReadOnlyError, MasterDownError, TryAgainError, ClusterDownError)


def _restorable(reply: Any) -> bool | None:
    """Whether a RESTORE's reply says Redis takes a restored stream: None if it cannot tell (full, failing over)."""
    if not isinstance(reply, Exception):
        return True
    return None if is_oom(reply) or isinstance(reply, _PASSING) or str(reply).startswith("BUSY ") else False


def rewrites(writes: Sequence[tuple[Any, ...]], streams: Sequence[str]) -> list[tuple[Any, ...]]:
    """The writes of `writes` to `streams` (a RESTORE refused: their XADD, its EXPIRE or PERSIST), to send again."""
    wanted = set(streams)
    return [
        write
        for write in writes
        if str(write[0]).upper() in ("XADD", "EXPIRE", "PERSIST") and decoded(write[1]) in wanted
    ]
