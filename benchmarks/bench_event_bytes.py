#!/usr/bin/env python
"""What a finished job's event stream holds in Redis, by the form of its events (a real redis-server).

    python benchmarks/bench_event_bytes.py [--tokens 128 --events 17,25,32,49]

For each count of events, a job's `--tokens` tokens split evenly into that many token events (ids of 3-4 digits,
5-character words) and a `done` event, XADDed to one stream as each form writes them, then copied onto itself as the
worker's retirement compacts a finished job's streams (rose.worker.batch_store: COPY stores the nodes at their
size), and measured with `MEMORY USAGE`. Forms: `json+id`, the event JSON with its `job_id` (workers before session
23); `json`, the JSON alone (session 23); `fields`, what the worker writes since session 24 (rose.jobs.events: a token
event as the entry's own fields, `seq`, `text`, `token_ids`, Redis keeping a node's field names once; the `done`
event as its JSON).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from rose.harness.redis_server import RedisServerProcess  # noqa: E402
from rose.jobs.events import TOKEN_ENTRY_FIELDS, DoneEvent, Usage, token_entry, token_event_json  # noqa: E402

JOB_ID = "b03550c1-48ab-447b-9f7c-69ccf2981846"  # a uuid4, as RQ names jobs


def events(n: int, tokens: int, rng: random.Random) -> list[dict]:
    """A job's `n` token events carrying `tokens` tokens, then its done event, as dicts (no job_id)."""
    sizes = [tokens // n + (i < tokens % n) for i in range(n)]
    out = []
    for seq, k in enumerate(sizes):
        ids = [rng.randint(100, 8000) for _ in range(k)]
        text = "".join(" " + "".join(rng.choice("abegkmnosuz") for _ in range(4)) for _ in range(k))
        out.append(json.loads(token_event_json(seq, text, ids)))
    done = DoneEvent(
        job_id=JOB_ID, seq=n, finish_reason="length", usage=Usage(prompt_tokens=3, completion_tokens=tokens)
    )
    return out + [json.loads(done.to_json())]


def entries(form: str, evs: list[dict]) -> list[dict[str, str]]:
    compact = {"separators": (",", ":"), "ensure_ascii": False}
    if form == "json+id":
        return [{"event": json.dumps({"job_id": JOB_ID, **e}, **compact)} for e in evs]
    if form == "json":
        return [{"event": json.dumps(e, **compact)} for e in evs]
    return [
        dict(zip(TOKEN_ENTRY_FIELDS, map(str, token_entry(e["seq"], e["text"], e["token_ids"])), strict=True))
        if e["type"] == "token"
        else {"event": json.dumps(e, **compact)}
        for e in evs
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--events", default="17,25,32,49", help="token events a job, comma-separated")
    args = ap.parse_args()
    forms = ("json+id", "json", "fields")
    print(f"{'events':>6}  " + "  ".join(f"{f + ' data':>13} {f + ' stored':>15}" for f in forms))
    with RedisServerProcess().start() as server:
        r = server.client()
        for n in (int(x) for x in args.events.split(",")):
            evs = events(n, args.tokens, random.Random(n))
            row = []
            for form in forms:
                r.delete("s", "c")
                written = entries(form, evs)
                for fields in written:
                    r.xadd("s", fields)
                r.copy("s", "c")
                data = sum(len(k) + len(v.encode()) for e in written for k, v in e.items())
                row.append(f"{data:>13,} {r.memory_usage('c', samples=0):>15,}")
            print(f"{n + 1:>6}  " + "  ".join(row))


if __name__ == "__main__":
    main()
