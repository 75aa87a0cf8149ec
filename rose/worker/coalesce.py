"""A batch's writes in fewer commands, for a script or a transaction that runs them at once.

RQ writes the keys a batch of jobs shares (the StartedJobRegistry, the FinishedJobRegistry, the worker's execution
index and counters) once a job, and each execution's hash with a DEL of its own: `coalesced` merges those writes,
one command a key, only where the result cannot differ from the writes one by one (tests/worker/test_coalesced.py
checks it on a real Redis against random batches and the cases that once broke it). Nothing here knows RQ: it
reasons on command names and arguments.
"""

from __future__ import annotations

import re
from typing import Any

# Commands that add or remove members: several of one kind on one key merge into one.
_MEMBERSHIP = frozenset({"ZADD", "ZREM", "SADD", "SREM"})
_COUNTERS = frozenset({"HINCRBY", "HINCRBYFLOAT"})
# A merged command takes at most this many arguments: a script passes a command's arguments through Lua's
# unpack(), which refuses about 8,000 (and a script that fails halfway keeps what it wrote).
MAX_ARGS = 1024
# A score ZADD takes as it is (Redis's own syntax: no NaN, no spaces, no underscores)
_SCORE = re.compile(rb"[+-]?(inf|(\d+\.?\d*|\.\d+)(e[+-]?\d+)?)", re.IGNORECASE)


def coalesced(commands: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """The same writes in fewer commands. A key is merged only where every command naming it (as any argument) is of
    one mergeable kind, or a plain EXPIRE with a positive TTL:
    - ZADDs (score-member pairs, no flags) / ZREMs / SADDs / SREMs of one key: into its first; of the key's
      EXPIREs, the last of each TTL is kept (membership writes leave a TTL as it is);
    - HINCRBY / HINCRBYFLOAT of one field: one increment of the sum, at the first (float sums: to rounding);
    - DELs: of keys no other command names, into the first DEL.
    A merged command that reaches MAX_ARGS arguments is followed by a new one, where the next write stood."""
    named: dict[bytes, set[str]] = {}  # every argument -> the commands naming it
    for command in commands:
        name = _name(command)
        for arg in command[1:]:
            named.setdefault(_b(arg), set()).add(name)
    mergeable_keys = {key for key, names in named.items() if _mergeable_names(names)}
    increments: dict[tuple[bytes, bytes], set[str]] = {}  # (key, field) -> the counter commands on it
    for command in commands:  # a flagged ZADD, an EXPIRE with options or a TTL <= 0 leaves its key alone
        name, key = _name(command), _b(command[1]) if len(command) > 1 else b""
        if key in mergeable_keys and not _plain(name, command):
            mergeable_keys.discard(key)
        elif name in _COUNTERS and len(command) == 4:
            increments.setdefault((key, _b(command[2])), set()).add(name)
    mergeable_keys -= {key for (key, _), names in increments.items() if len(names) > 1}  # int and float
    last_expire = {
        (_b(command[1]), _b(command[2])): i
        for i, command in enumerate(commands)
        if _name(command) == "EXPIRE" and _b(command[1]) in mergeable_keys
    }
    sums: dict[tuple[str, bytes, bytes], float] = {}
    out: list[tuple[Any, ...]] = []
    merged_at: dict[tuple[str, bytes, bytes], int] = {}
    for i, command in enumerate(commands):
        name = _name(command)
        key = _b(command[1]) if len(command) > 1 else b""
        if name == "EXPIRE" and key in mergeable_keys:
            if last_expire[(key, _b(command[2]))] == i:
                out.append(command)
            continue
        if name == "DEL" and all(named[_b(k)] == {"DEL"} for k in command[1:]):
            group, tail = ("DEL", b"", b""), command[1:]
        elif name in _MEMBERSHIP and key in mergeable_keys:
            group, tail = (name, key, b""), command[2:]
        elif name in _COUNTERS and key in mergeable_keys:
            group = (name, key, _b(command[2]))
            if group not in sums:
                sums[group] = 0.0
                merged_at[group] = len(out)
                out.append(command)
            sums[group] += float(command[3])
            continue
        else:
            out.append(command)
            continue
        at = merged_at.get(group)
        if at is None or len(out[at]) + len(tail) > MAX_ARGS:
            merged_at[group] = len(out)
            out.append(tuple(command))
        else:
            out[at] = (*out[at], *tail)
    for group, total in sums.items():
        first = out[merged_at[group]]
        out[merged_at[group]] = (*first[:3], int(total) if group[0] == "HINCRBY" else total)
    return out


def _name(command: tuple[Any, ...]) -> str:
    return str(command[0]).upper()


def _b(value: Any) -> bytes:
    """An argument as Redis sees it (redis-py's encoding), so that "k" and b"k" name one key."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    return repr(value).encode() if isinstance(value, float) else str(value).encode()


def _mergeable_names(names: set[str]) -> bool:
    """A key named only by EXPIREs and one kind of membership write, or only by counter increments."""
    others = names - {"EXPIRE"}
    if len(others) == 1 and others <= _MEMBERSHIP:
        return True
    return bool(names) and names <= _COUNTERS


def _plain(name: str, command: tuple[Any, ...]) -> bool:
    """The command names its key first and has no option that would make merging change what it does."""
    if name == "EXPIRE":
        return len(command) == 3 and _b(command[2]).isdigit() and int(command[2]) > 0
    if name == "ZADD":
        pairs = command[2:]
        return bool(pairs) and len(pairs) % 2 == 0 and all(_is_score(score) for score in pairs[::2])
    if name in _COUNTERS:
        return len(command) == 4
    return name in _MEMBERSHIP and len(command) > 2


def _is_score(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int | float):
        return value == value  # not NaN
    return _SCORE.fullmatch(_b(value)) is not None
