"""A batch's writes in fewer commands, for a script or a transaction that runs them at once.

RQ writes the keys a batch of jobs shares (the StartedJobRegistry, the FinishedJobRegistry, the worker's execution
index) once a job, and each execution's hash with a DEL of its own: `coalesced` merges those writes, one command a
key, only where the result cannot differ from the writes one by one (tests/worker/test_coalesced.py checks it on a
real Redis against random batches). Nothing here knows RQ: it reasons on command names and arguments.
"""

from __future__ import annotations

from typing import Any

# Commands that add or remove members: several of one kind on one key merge into one.
_MEMBERSHIP = frozenset({"ZADD", "ZREM", "SADD", "SREM"})


def coalesced(commands: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """The same writes in fewer commands. Merged, each only where nothing else in `commands` names the key (so the
    order it is written in does not matter): the ZADDs (plain score-member pairs) / ZREMs / SADDs / SREMs of one key
    into its first, when the key sees no other kind of write but EXPIREs; of those EXPIREs, repeated with one TTL,
    only the last is kept; DELs of keys named nowhere else into the first DEL."""
    named: dict[Any, set[str]] = {}  # every argument -> the commands naming it
    for command in commands:
        name = str(command[0]).upper()
        for arg in command[1:]:
            named.setdefault(arg, set()).add(name)

    def mergeable(name: str, command: tuple[Any, ...]) -> bool:
        if name == "ZADD" and not _plain_pairs(command[2:]):
            return False
        return name in _MEMBERSHIP and len(command) > 2 and _membership_only(named[command[1]])

    last_expire = {
        (command[1], command[2]): i
        for i, command in enumerate(commands)
        if str(command[0]).upper() == "EXPIRE" and len(command) == 3 and _membership_only(named[command[1]])
    }
    out: list[tuple[Any, ...]] = []
    merged_at: dict[tuple[str, Any], int] = {}
    for i, command in enumerate(commands):
        name = str(command[0]).upper()
        if name == "EXPIRE" and last_expire.get((command[1], command[2]), i) != i:
            continue  # an earlier EXPIRE of a key whose membership writes merged: the last one stays
        if name == "DEL" and all(named[key] == {"DEL"} for key in command[1:]):
            group: tuple[str, Any] = ("DEL", None)
        elif mergeable(name, command):
            group = (name, command[1])
        else:
            out.append(command)
            continue
        at = merged_at.get(group)
        if at is None:
            merged_at[group] = len(out)
            out.append(tuple(command))
        else:
            out[at] = (*out[at], *command[1 if name == "DEL" else 2 :])
    return out


def _membership_only(names: set[str]) -> bool:
    """A key named only by EXPIREs and one kind of membership write."""
    others = names - {"EXPIRE"}
    return len(others) == 1 and others <= _MEMBERSHIP


def _plain_pairs(args: tuple[Any, ...]) -> bool:
    """ZADD arguments that are score-member pairs only (no NX / XX / GT / LT / CH / INCR)."""
    if not args or len(args) % 2:
        return False
    try:
        for score in args[::2]:
            float(score)
    except (TypeError, ValueError):
        return False
    return True
