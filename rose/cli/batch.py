"""`rose batch`: run a JSONL file of prompts through the workers, writing one result line per input line.

Streaming and bounded: input is read lazily, at most --max-in-flight jobs are queued or running at once, each result
line is written (and flushed) as its job ends, and nothing else is kept per line but its id. Resumable: ids already
in the output are skipped, and jobs a previous run left queued or running (listed in `<output>.jobs`) are picked
up rather than submitted again.
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from rose.cli.common import EXIT_FAILED, add_redis_args, connect, error
from rose.cli.sampling_args import add_sampling_args, sampling_kwargs

_POLL_S = 0.2
_ENDED = {"finished", "failed", "canceled", "stopped"}
_RESUBMIT = {"canceled", "stopped"}  # a previous run's job canceled since: run the line again


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "batch",
        help="run a JSONL file of prompts through the workers (resumable)",
        description=(
            "Each input line is a JSON object with `prompt` or `prompt_token_ids`, an optional `id` (default: "
            "the line number) and optional job fields (sampling fields, metadata, priority) that override the "
            "command-line defaults. Each output line is {id, job_id, text, finish_reason, usage[, metadata]} or "
            "{id, error}, written in completion order. Running the same command again skips the ids already in "
            "the output and picks up the jobs a previous run left running. Exit code 1 if any line failed, 130 "
            "on Ctrl-C."
        ),
    )
    p.add_argument("input", type=Path, metavar="PROMPTS.jsonl", help="input file, one JSON object per line")
    p.add_argument("-o", "--output", type=Path, required=True, metavar="RESULTS.jsonl", help="output file")
    add_redis_args(p)
    p.add_argument(
        "--max-in-flight", type=int, default=512, help="most jobs queued or running at once (default 512)"
    )
    p.add_argument("--chunk-size", type=int, default=128, help="jobs per enqueue round trip (default 128)")
    p.add_argument("--job-timeout", type=int, default=None, metavar="S", help="RQ job_timeout per job")
    p.add_argument(
        "--result-ttl",
        type=int,
        default=3600,
        metavar="S",
        help="seconds RQ keeps each result (default 3600)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_sampling_args(p)
    p.set_defaults(func=run)


def _key(line_id: Any) -> str:
    return json.dumps(line_id, sort_keys=True)


@dataclass
class Entry:
    lineno: int
    id: Any
    request: dict[str, Any] | None = None
    error: str | None = None
    duplicate: bool = False  # an id seen on an earlier line: reported, not run, no output line


def _parse(lineno: int, text: str, defaults: dict[str, Any]) -> Entry:
    from rose.jobs.schemas import GenerateRequest, ValidationError, format_validation_error

    try:
        obj = json.loads(text)
    except ValueError as exc:
        return Entry(lineno, lineno, error=f"invalid JSON: {exc}")
    if not isinstance(obj, dict):
        return Entry(lineno, lineno, error=f"expected a JSON object, got {type(obj).__name__}")
    line_id = obj.pop("id", lineno)
    if not isinstance(line_id, str | int) or isinstance(line_id, bool):
        return Entry(lineno, lineno, error="'id' must be a string or an integer")
    try:
        GenerateRequest(**{**defaults, **obj})
    except ValidationError as exc:
        return Entry(
            lineno,
            line_id,
            error=format_validation_error(exc).removeprefix("invalid rose.jobs.generate arguments: "),
        )
    except (TypeError, ValueError) as exc:
        return Entry(lineno, line_id, error=str(exc))
    return Entry(lineno, line_id, request=obj)


def _first_pass(path: Path) -> Iterator[tuple[int, str, str]]:
    """(line number, key, text) of each non-blank line; the key is the line's id as far as it can be read."""
    with path.open(encoding="utf-8", errors="replace") as f:
        for lineno, text in enumerate(f, 1):
            if not text.strip():
                continue
            line_id: Any = lineno
            try:
                obj = json.loads(text)
                if isinstance(obj, dict) and type(obj.get("id")) in (str, int):
                    line_id = obj["id"]
            except ValueError:
                pass
            yield lineno, _key(line_id), text


def _scan_output(path: Path) -> dict[str, bool]:
    """key -> failed, for the lines already written; drops a torn last line (a crash mid-write)."""
    done: dict[str, bool] = {}
    if not path.exists():
        return done
    good_end = 0
    with path.open("rb") as f:
        for raw in f:
            if not raw.endswith(b"\n"):
                break
            try:
                obj = json.loads(raw)
                done[_key(obj["id"])] = "error" in obj
            except (ValueError, KeyError, TypeError):
                pass  # a line we cannot read is kept, not counted
            good_end += len(raw)
    if good_end < path.stat().st_size:
        with path.open("r+b") as f:
            f.truncate(good_end)
    return done


def _read_jobs_file(path: Path, done: dict[str, bool]) -> dict[str, str]:
    jobs: dict[str, str] = {}
    if path.exists():
        with path.open() as f:
            for line in f:
                try:
                    obj = json.loads(line)
                    key = _key(obj["id"])
                except (ValueError, KeyError, TypeError):
                    continue
                if key not in done:
                    jobs[key] = obj["job_id"]
    return jobs


@dataclass
class Batch:
    args: argparse.Namespace
    out: TextIO
    jobs_out: TextIO
    inflight: dict[str, Any] = field(default_factory=dict)  # job id -> line id
    done: int = 0
    failed: int = 0
    duplicates: int = 0
    tokens: int = 0
    started: float = field(default_factory=time.monotonic)
    stop: bool = False
    last_refresh: float = 0.0

    def write(self, line: dict[str, Any]) -> None:
        self.out.write(json.dumps(line, ensure_ascii=False) + "\n")
        self.out.flush()
        if "error" in line:
            self.failed += 1
        else:
            self.done += 1


def run(args: argparse.Namespace) -> int:
    import redis
    from tqdm import tqdm

    from rose.jobs.client import Client

    if args.max_in_flight < 1 or args.chunk_size < 1:
        error(args, "error: --max-in-flight and --chunk-size must be at least 1")
        return 2
    if not args.input.is_file():
        error(args, f"error: no such file: {args.input}")
        return 2
    conn = connect(args)
    client = Client(conn, queue=args.queue)
    defaults = sampling_kwargs(args)
    jobs_path = args.output.with_name(args.output.name + ".jobs")
    previous = _scan_output(args.output)
    prev_jobs = _read_jobs_file(jobs_path, previous)
    total = skipped = prev_failed = 0
    for _, key, _ in _first_pass(args.input):
        total += 1
        if key in previous:
            skipped += 1
            prev_failed += previous[key]
    done_keys = set(previous)  # only the keys are needed from here on
    del previous
    if skipped:
        print(f"resuming: {skipped} of {total} lines already in {args.output}", file=sys.stderr)

    args.output.parent.mkdir(parents=True, exist_ok=True)
    with args.output.open("a", encoding="utf-8") as out, jobs_path.open("a", encoding="utf-8") as jobs_out:
        batch = Batch(args, out, jobs_out)
        progress = tqdm(
            total=total,
            initial=skipped,
            unit="line",
            file=sys.stderr,
            dynamic_ncols=True,
            disable=True if args.no_progress else None,
        )

        def on_sigint(signum: int, frame: Any) -> None:
            batch.stop = True
            signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C interrupts at once

        old_handler = signal.signal(signal.SIGINT, on_sigint)
        try:
            _loop(batch, client, conn, defaults, done_keys, prev_jobs, progress)
        except redis.RedisError as exc:
            progress.close()
            error(args, f"error: lost Redis ({exc}); what is written is kept: run the same command to resume")
            return EXIT_FAILED
        finally:
            signal.signal(signal.SIGINT, old_handler)
            progress.close()
    failed = prev_failed + batch.failed
    duplicates = f", {batch.duplicates} duplicate ids not run" if batch.duplicates else ""
    if batch.stop:
        command = shlex.join(["rose", *sys.argv[1:]])
        print(
            f"interrupted: {batch.done + batch.failed} lines written this run to {args.output}; "
            f"{len(batch.inflight)} jobs still queued or running (listed in {jobs_path}).\n"
            f"  resume (picks those jobs' results up, submits the rest): {command}\n"
            f"  cancel them: rose cancel --redis-url {shlex.quote(args.redis_url)} --jobs-file "
            f"{shlex.quote(str(jobs_path))}",
            file=sys.stderr,
        )
        return 130
    jobs_path.unlink(missing_ok=True)
    print(
        f"{total} lines: {total - failed - batch.duplicates} done, {failed} failed{duplicates}"
        + (f" ({skipped} were already in {args.output})" if skipped else "")
        + f"; results in {args.output}",
        file=sys.stderr,
    )
    return EXIT_FAILED if failed or batch.duplicates else 0


def _loop(
    batch: Batch,
    client: Any,
    conn: Any,
    defaults: dict[str, Any],
    done_keys: set[str],
    prev_jobs: dict[str, str],
    progress: Any,
) -> None:
    args = batch.args
    entries = _entries(args.input, defaults, done_keys)
    exhausted = False
    while not batch.stop and (not exhausted or batch.inflight):
        # fill the window
        while not exhausted and not batch.stop and len(batch.inflight) < args.max_in_flight:
            room = min(args.chunk_size, args.max_in_flight - len(batch.inflight))
            chunk: list[Entry] = []
            for entry in entries:
                if entry.error is not None:
                    print(f"{args.input}:{entry.lineno}: {entry.error}", file=sys.stderr)
                    if entry.duplicate:
                        batch.duplicates += 1
                    else:
                        batch.write({"id": entry.id, "error": f"line {entry.lineno}: {entry.error}"})
                    progress.update()
                    continue
                old = prev_jobs.pop(_key(entry.id), None)
                if old is not None:
                    status = conn.hget(f"rq:job:{old}", "status")
                    if status is not None and status.decode() not in _RESUBMIT:
                        batch.inflight[old] = entry.id  # a previous run's job: wait for it
                    else:
                        chunk.append(entry)  # gone (expired) or canceled since: run the line again
                else:
                    chunk.append(entry)
                if len(chunk) >= room or len(batch.inflight) + len(chunk) >= args.max_in_flight:
                    break
            else:
                exhausted = True
            _submit(batch, client, chunk)
            _show(batch, progress)
        ended = _poll(batch, client, conn)
        progress.update(ended)
        _show(batch, progress)
        if not ended and batch.inflight and not batch.stop:
            time.sleep(_POLL_S)


def _entries(path: Path, defaults: dict[str, Any], done_keys: set[str]) -> Iterator[Entry]:
    seen: set[str] = set()
    for lineno, key, text in _first_pass(path):
        if key in done_keys:
            continue
        if key in seen:
            yield Entry(lineno, key, error=f"duplicate id {key}: only its first line is run", duplicate=True)
            continue
        seen.add(key)
        yield _parse(lineno, text, defaults)


def _submit(batch: Batch, client: Any, chunk: list[Entry]) -> None:
    if not chunk:
        return
    args = batch.args
    rq_opts: dict[str, Any] = {"result_ttl": args.result_ttl}
    if args.job_timeout is not None:
        rq_opts["job_timeout"] = args.job_timeout
    requests = []
    for entry in chunk:
        job_id = uuid.uuid4().hex
        # recorded before enqueueing: an interrupted run never leaves a job the next run cannot find
        batch.jobs_out.write(json.dumps({"id": entry.id, "job_id": job_id}) + "\n")
        requests.append({**entry.request, **rq_opts, "job_id": job_id})
    batch.jobs_out.flush()
    jobs = client.submit_many(requests, **sampling_kwargs(args))
    for entry, job in zip(chunk, jobs, strict=True):
        batch.inflight[job.id] = entry.id


def _poll(batch: Batch, client: Any, conn: Any) -> int:
    """Write the lines of the jobs that ended; returns how many."""
    from rose.jobs.client import JobCanceled, JobFailed

    if not batch.inflight:
        return 0
    ids = list(batch.inflight)
    with conn.pipeline(transaction=False) as pipe:
        for job_id in ids:
            pipe.hget(f"rq:job:{job_id}", "status")
        statuses = pipe.execute()
    ended = 0
    for job_id, status in zip(ids, statuses, strict=True):
        if status is not None and status.decode() not in _ENDED:
            continue
        line_id = batch.inflight.pop(job_id)
        try:
            result = client.job(job_id).result(timeout=0)
        except JobFailed as exc:
            batch.write({"id": line_id, "job_id": job_id, "error": exc.message})
        except JobCanceled as exc:
            batch.write({"id": line_id, "job_id": job_id, "error": f"job {exc.reason}"})
        except TimeoutError:  # status moved back (requeued) between the two reads: keep waiting
            batch.inflight[job_id] = line_id
            continue
        else:
            line = {"id": line_id, "job_id": job_id}
            line.update({k: result.get(k) for k in ("text", "finish_reason", "usage")})
            if result.get("metadata") is not None:
                line["metadata"] = result["metadata"]
            batch.write(line)
            batch.tokens += int((result.get("usage") or {}).get("completion_tokens", 0))
        ended += 1
    return ended


def _show(batch: Batch, progress: Any) -> None:
    elapsed = max(time.monotonic() - batch.started, 1e-6)
    progress.set_postfix_str(
        f"done={batch.done} failed={batch.failed} in_flight={len(batch.inflight)} "
        f"tok/s={batch.tokens / elapsed:.1f}",
        refresh=False,
    )
    now = time.monotonic()
    if (
        now - batch.last_refresh >= 0.5
    ):  # update() redraws at most every 0.1 s on its own; this covers idle waits
        batch.last_refresh = now
        progress.refresh()
