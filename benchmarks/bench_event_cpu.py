#!/usr/bin/env python
"""What the publisher's script costs Redis an event, by the form its token events are stored in (a real
redis-server, the worker's own `Publisher`).

    python benchmarks/bench_event_cpu.py [--jobs 64 --events 32 --tokens 4 --repeats 8]

Batches of one token event for each of `--jobs` jobs (`--tokens` tokens each, 4-digit ids, words of 3-8
letters), `--events` batches, as one engine step's events: sent as the worker sends them (`fields`: each token
event stored as its entry's fields, rose.jobs.events `token_entry`) or stored as their JSON (`json`: what workers
wrote before session 24), alternating form by form on a fresh database, `--repeats` times. Prints Redis's own time
in the script (`INFO commandstats`, EVAL's µs) an event, and the streams' bytes a job after `COPY` (the retirement
stores a finished job's streams at their size). Medians.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from rose.harness.redis_server import RedisServerProcess  # noqa: E402
from rose.jobs import keys  # noqa: E402
from rose.jobs.events import token_entry, token_event_json  # noqa: E402
from rose.worker.publisher import KEEP_TTL, Outgoing, Publisher  # noqa: E402

WORDS = ["mona", "luwesi", "tobe", "veherabu", "vacu", "hiz", "witu", "povivoma"]


def batches(args: argparse.Namespace, form: str, rng: random.Random) -> list[list[Outgoing]]:
    jobs = [f"{rng.getrandbits(128):032x}" for _ in range(args.jobs)]
    out = []
    for seq in range(args.events):
        batch = []
        for job in jobs:
            ids = [rng.randint(1000, 8191) for _ in range(args.tokens)]
            text = "".join(" " + rng.choice(WORDS) for _ in ids)
            token = token_entry(seq, text, ids) if form == "fields" else None
            ttl = 600 if seq == 0 else KEEP_TTL
            batch.append(Outgoing(job, token_event_json(seq, text, ids), ttl, token=token))
        out.append(batch)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=64)
    ap.add_argument("--events", type=int, default=32, help="token events a job")
    ap.add_argument("--tokens", type=int, default=4, help="tokens an event")
    ap.add_argument("--repeats", type=int, default=8)
    args = ap.parse_args()
    forms = ("json", "fields")
    usec: dict[str, list[float]] = {f: [] for f in forms}
    size: dict[str, list[float]] = {f: [] for f in forms}
    with RedisServerProcess().start() as server:
        r = server.client()
        for rep in range(args.repeats):
            for form in forms:
                todo = batches(args, form, random.Random(rep))
                r.flushall()
                r.config_resetstat()
                pub = Publisher(r)
                for batch in todo:
                    pub.send(batch)
                    assert pub.flush(timeout=30)
                pub.close()
                usec[form].append(r.info("commandstats")["cmdstat_eval"]["usec"] / (args.jobs * args.events))
                total = 0
                for job in {e.job_id for e in todo[0]}:
                    r.copy(keys.stream_key(job), "compact", replace=True)
                    total += r.memory_usage("compact", samples=0)
                size[form].append(total / args.jobs)
    print(f"{args.jobs} jobs x {args.events} token events of {args.tokens} tokens; medians of {args.repeats}")
    print(f"{'form':>7} {'Redis µs an event':>18} {'runs':>30} {'stream bytes a job':>19}")
    for form in forms:
        runs = ", ".join(f"{x:.2f}" for x in sorted(usec[form]))
        print(
            f"{form:>7} {statistics.median(usec[form]):>18.2f} {runs:>30} {statistics.median(size[form]):>19,.0f}"
        )
    print(
        f"fields / json: {statistics.median(usec['fields']) / statistics.median(usec['json']):.2f} of the time"
    )


if __name__ == "__main__":
    main()
