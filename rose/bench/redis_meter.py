"""What a workload costs Redis, by Redis's own accounting: its main thread's CPU time (`INFO cpu`), round trips
(`total_reads_processed`), commands (`INFO commandstats`) and memory (`used_memory`), between two snapshots.

Redis 7 allocates a latency histogram (`latency-tracking`, on by default) for each command at its first call, ~24 KB,
once a server: a run of a few hundred jobs that calls a command first would bill it to their tokens (61.3 against
55.0 bytes a token streamed, with the tracking off). `histogram_bytes` measures one on a fresh server and `usage`
takes out the histograms made between the snapshots (`INFO latencystats`), reported apart as `histograms`.

Redis's thread also works when nothing is asked of it (its cron: expiry, client bookkeeping), so `idle()` measures
that rate beforehand and `Usage.net_cpu_s` takes it out: what is left is what the workload cost. commandstats count
a command run by a script or inside MULTI/EXEC twice (itself, and within the EVAL's or EXEC's time): its sum is
given as Redis reports it, and the CPU time is the figure to judge by.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import redis


@dataclass(frozen=True, slots=True)
class Snapshot:
    at: float  # time.monotonic()
    cpu_s: float  # main thread, user + sys
    reads: int  # read events: one per batch of commands a client sent (a round trip, or a pipeline)
    commands: int
    memory: int
    commandstats: dict[str, dict[str, float]]
    histograms: int = 0  # commands with a latency histogram (INFO latencystats)


@dataclass(slots=True)
class Usage:
    """Redis's work between two snapshots, `idle_cpu_per_s` (its own idle rate) taken out of `net_cpu_s`."""

    wall_s: float
    cpu_s: float
    idle_cpu_per_s: float
    reads: int
    commands: int
    memory: int  # bytes added (used_memory), less the latency histograms made meanwhile
    # latency histograms made meanwhile (commands called first), ~24 KB each, once a server
    histograms: int = 0
    commandstats: dict[str, dict[str, float]] = field(default_factory=dict)  # name -> calls, usec (deltas)

    @property
    def net_cpu_s(self) -> float:
        return max(0.0, self.cpu_s - self.idle_cpu_per_s * self.wall_s)

    @property
    def command_usec(self) -> float:
        """commandstats' usec sum (scripted and transaction commands counted twice)."""
        return sum(s["usec"] for s in self.commandstats.values())

    def per(self, n: float) -> dict[str, float]:
        """The figures per unit (token, job): CPU in microseconds, memory in bytes."""
        return {
            "cpu_us": self.net_cpu_s * 1e6 / n,
            "cpu_raw_us": self.cpu_s * 1e6 / n,
            "command_usec": self.command_usec / n,
            "commands": self.commands / n,
            "round_trips": self.reads / n,
            "bytes": self.memory / n,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "wall_s": self.wall_s,
            "cpu_s": self.cpu_s,
            "net_cpu_s": self.net_cpu_s,
            "idle_cpu_per_s": self.idle_cpu_per_s,
            "round_trips": self.reads,
            "commands": self.commands,
            "memory_bytes": self.memory,
            "histograms": self.histograms,
            "commandstats": self.commandstats,
        }


def snapshot(r: redis.Redis) -> Snapshot:
    info = r.info("everything")
    stats = {
        name.removeprefix("cmdstat_"): {"calls": float(v["calls"]), "usec": float(v["usec"])}
        for name, v in info.items()
        if name.startswith("cmdstat_")
    }
    return Snapshot(
        at=time.monotonic(),
        cpu_s=float(info["used_cpu_user_main_thread"]) + float(info["used_cpu_sys_main_thread"]),
        reads=int(info["total_reads_processed"]),
        commands=int(info["total_commands_processed"]),
        memory=int(info["used_memory"]),
        commandstats=stats,
        histograms=sum(name.startswith("latency_percentiles_usec_") for name in info),
    )


def histogram_bytes(r: redis.Redis) -> int:
    """The bytes Redis allocates for a command at its first call (its latency histogram; 0 with `latency-tracking
    no`, or before Redis 7), measured with a command nobody has called yet: call it on a server before any load."""
    tracked = set(r.info("latencystats"))
    for name in ("LASTSAVE", "TIME", "DBSIZE"):
        if f"latency_percentiles_usec_{name.lower()}" not in tracked:
            before = int(r.info("memory")["used_memory"])
            r.execute_command(name)
            return max(0, int(r.info("memory")["used_memory"]) - before)
    return 0


def idle(r: redis.Redis, seconds: float = 3.0) -> float:
    """Redis's main-thread CPU seconds per second while nothing is asked of it (but this measure)."""
    a = snapshot(r)
    time.sleep(seconds)
    b = snapshot(r)
    return max(0.0, b.cpu_s - a.cpu_s) / max(b.at - a.at, 1e-9)


def usage(a: Snapshot, b: Snapshot, idle_cpu_per_s: float = 0.0, histogram: int = 0) -> Usage:
    """Redis's work from `a` to `b`; `histogram`: what a command's first call allocates (`histogram_bytes`), taken
    out of the memory for each command first called in between."""
    stats: dict[str, dict[str, float]] = {}
    for name, v in b.commandstats.items():
        before = a.commandstats.get(name, {"calls": 0.0, "usec": 0.0})
        calls, usec = v["calls"] - before["calls"], v["usec"] - before["usec"]
        if calls > 0:
            stats[name] = {"calls": calls, "usec": usec}
    return Usage(
        wall_s=b.at - a.at,
        cpu_s=b.cpu_s - a.cpu_s,
        idle_cpu_per_s=idle_cpu_per_s,
        reads=b.reads - a.reads - 1,  # less the INFO of the first snapshot
        commands=b.commands - a.commands - 1,
        memory=b.memory - a.memory - histogram * max(0, b.histograms - a.histograms),
        histograms=max(0, b.histograms - a.histograms),
        commandstats=stats,
    )


def memory_by_family(r: redis.Redis, sample: int = 200) -> dict[str, dict[str, float]]:
    """Bytes held per key family (`rose:stream`, `rq:job`, `rq:results`, ...): keys, bytes per key (MEMORY USAGE of
    up to `sample` keys each), estimated total."""
    keys: dict[str, list[bytes]] = {}
    for key in r.scan_iter(count=1000):
        parts = key.decode(errors="replace").split(":")
        keys.setdefault(":".join(parts[:2]), []).append(key)
    out: dict[str, dict[str, float]] = {}
    for family, members in keys.items():
        sampled = members[:sample]
        sizes = [r.memory_usage(k, samples=0) or 0 for k in sampled]
        per_key = sum(sizes) / max(1, len(sizes))
        out[family] = {"keys": len(members), "bytes_per_key": per_key, "bytes": per_key * len(members)}
    return out
