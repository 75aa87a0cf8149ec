"""`rose batch`: run a JSONL file of prompts through the workers, writing one result line per input line.

Two file formats, told apart per file: rose's own (rose.cli.batch_files.PlainFormat) and OpenAI's Batch API
format (rose.cli.openai_batch). Streaming and bounded: input is read lazily, at most --max-in-flight jobs are
queued or running at once, each result line is written (and flushed) as its job ends, and nothing else is kept
per line but its id. Resumable: ids already in the output (and error) file are skipped, and jobs a previous
run left queued or running (listed in `<output>.jobs`) are picked up rather than submitted again. Jobs go with
`stream: false` unless --stream (or the line) says otherwise: the workers publish only each job's end, so a
batch costs Redis nothing per token.
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

from rose.cli.batch_files import (
    Entry,
    LineFormat,
    failure_code,
    first_pass,
    key_of,
    read_jobs_file,
    scan_output,
    survey,
)
from rose.cli.batch_progress import Throughput, progress_text
from rose.cli.common import EXIT_FAILED, add_redis_args, connect, error
from rose.cli.openai_batch import detect_format
from rose.cli.request_args import add_placement_args, placement_kwargs
from rose.cli.sampling_args import add_sampling_args, sampling_kwargs
from rose.jobs import keys

_POLL_S = 0.2
_ENDED = {"finished", "failed", "canceled", "stopped"}
_RESUBMIT = {"canceled", "stopped"}  # a previous run's job canceled since: run the line again


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "batch",
        help="run a JSONL file of prompts through the workers (resumable)",
        description=(
            "Each input line is a JSON object with `prompt`, `prompt_token_ids` or chat `messages`, an optional "
            "`id` (default: the line number) and optional job fields (sampling fields, structured_outputs / "
            "response_format, chat options, metadata, priority, stream, lora, tenant, deadline) that override the command-line "
            "defaults. Jobs are sent with stream: false (the workers publish each job's end, no token "
            "events) unless --stream or the line says otherwise. Each output line is {id, job_id, text, "
            "finish_reason, usage[, metadata]} or "
            "{id, error}, written in completion order. A file in OpenAI's Batch API format ({custom_id, method, "
            "url, body} lines for /v1/chat/completions or /v1/completions) gets OpenAI's batch output lines. "
            "Running the same command again skips the ids already in the output and picks up the jobs a previous "
            "run left running. Exit code 1 if any line failed, 130 on Ctrl-C."
        ),
    )
    p.add_argument("input", type=Path, metavar="PROMPTS.jsonl", help="input file, one JSON object per line")
    p.add_argument("-o", "--output", type=Path, required=True, metavar="RESULTS.jsonl", help="output file")
    p.add_argument(
        "--error-file", type=Path, metavar="ERRORS.jsonl", help="write failed lines here, not in the output"
    )
    add_redis_args(p)
    p.add_argument(
        "--queue-for",
        action="append",
        metavar="MODEL=QUEUE",
        help="OpenAI format: lines whose body.model is MODEL go to QUEUE (repeatable; others: --queue)",
    )
    p.add_argument(
        "--lora-model",
        action="append",
        metavar="NAME",
        help="OpenAI format: lines whose body.model is NAME run with the LoRA adapter NAME (the job field lora), as "
        "vLLM serves an adapter under its --lora-modules name; others: the base model (repeatable, or "
        "comma-separated)",
    )
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
    p.add_argument(
        "--stream",
        action="store_true",
        help="have the workers publish every job's tokens as they are generated (the job field stream), for "
        "whoever watches a job; default: only each job's end, which costs Redis nothing per token. A line's "
        "own stream field wins",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_placement_args(p)
    add_sampling_args(p)
    p.set_defaults(func=run)


@dataclass
class Batch:
    args: argparse.Namespace
    fmt: LineFormat
    out: TextIO
    err: TextIO | None  # --error-file, else failed lines go to `out` too
    jobs_out: TextIO
    inflight: dict[str, Entry] = field(default_factory=dict)  # job id -> its line
    done: int = 0
    failed: int = 0
    duplicates: int = 0
    running: set[str] = field(default_factory=set)  # in-flight jobs the last poll saw started
    throughput: Throughput = field(default_factory=Throughput)
    stop: bool = False
    last_refresh: float = 0.0

    def write(self, line: dict[str, Any], failed: bool) -> None:
        out = self.err if failed and self.err is not None else self.out
        out.write(json.dumps(line, ensure_ascii=False) + "\n")
        out.flush()
        if failed:
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
    try:
        fmt = detect_format(args.input, parse_queue_for(args.queue_for), parse_lora_models(args.lora_model))
    except ValueError as exc:
        error(args, f"error: {exc}")
        return 2
    for flag, given in (("--queue-for", args.queue_for), ("--lora-model", args.lora_model)):
        if given and not fmt.unique_ids:
            error(args, f"error: {flag} reads body.model: only for files in OpenAI's batch format")
            return 2
    previous = scan_output(args.output, fmt) | scan_output(args.error_file, fmt)
    found = survey(args.input, fmt, previous)
    if found.problems:  # nothing submitted yet: fix the file and run again
        error(args, f"error: {args.input} refused, nothing was run:\n  " + "\n  ".join(found.problems))
        return 2
    conn = connect(args)
    jobs_path = args.output.with_name(args.output.name + ".jobs")
    prev_jobs = read_jobs_file(jobs_path, set(previous))
    done_keys = set(previous)  # only the keys are needed from here on
    del previous
    total, skipped = found.total, found.skipped
    if skipped:
        print(f"resuming: {skipped} of {total} lines already in {_files(args)}", file=sys.stderr)

    args.output.parent.mkdir(parents=True, exist_ok=True)
    if args.error_file is not None:
        args.error_file.parent.mkdir(parents=True, exist_ok=True)
    with (
        args.output.open("a", encoding="utf-8") as out,
        (args.error_file or args.output).open("a", encoding="utf-8") as err,
        jobs_path.open("a", encoding="utf-8") as jobs_out,
    ):
        batch = Batch(args, fmt, out, err if args.error_file is not None else None, jobs_out)
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
            _loop(batch, Client(conn, queue=args.queue), conn, done_keys, prev_jobs, progress)
        except redis.RedisError as exc:
            progress.close()
            error(args, f"error: lost Redis ({exc}); what is written is kept: run the same command to resume")
            return EXIT_FAILED
        finally:
            signal.signal(signal.SIGINT, old_handler)
            progress.close()
    failed = found.prev_failed + batch.failed
    duplicates = f", {batch.duplicates} duplicate ids not run" if batch.duplicates else ""
    if batch.stop:
        command = shlex.join(["rose", *sys.argv[1:]])
        print(
            f"interrupted: {batch.done + batch.failed} lines written this run to {_files(args)}; "
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
        + (f" ({skipped} were already in {_files(args)})" if skipped else "")
        + f"; results in {_files(args)}",
        file=sys.stderr,
    )
    return EXIT_FAILED if failed or batch.duplicates else 0


def parse_queue_for(values: list[str] | None) -> dict[str, str]:
    """--queue-for MODEL=QUEUE (repeatable) -> {model: queue}; ValueError on a malformed one. The queue follows the
    last '=' (model names may contain one, queue names do not)."""
    mapping: dict[str, str] = {}
    for value in values or []:
        model, sep, queue = value.rpartition("=")
        if not sep or not model or not queue:
            raise ValueError(f"--queue-for wants MODEL=QUEUE, got {value!r}")
        mapping[model] = queue
    return mapping


def parse_lora_models(values: list[str] | None) -> frozenset[str]:
    """--lora-model NAME (repeatable, or comma-separated) -> the body.model names that are LoRA adapters."""
    return frozenset(name.strip() for value in values or [] for name in value.split(",") if name.strip())


def _files(args: argparse.Namespace) -> str:
    return str(args.output) + (f" and {args.error_file}" if args.error_file is not None else "")


def _loop(
    batch: Batch,
    client: Any,
    conn: Any,
    done_keys: set[str],
    prev_jobs: dict[str, str],
    progress: Any,
) -> None:
    args = batch.args
    entries = _entries(args.input, batch.fmt, _job_defaults(args), done_keys)
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
                        batch.write(batch.fmt.invalid_line(entry), failed=True)
                    progress.update()
                    continue
                old = prev_jobs.pop(key_of(entry.id), None)
                if old is None or not _adopt(batch, conn, old, entry):
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


def _adopt(batch: Batch, conn: Any, job_id: str, entry: Entry) -> bool:
    """Wait for a previous run's job for `entry` (True), unless it is gone (expired) or was canceled since (False:
    run the line again)."""
    raw = conn.hget(keys.rq_job_key(job_id), keys.JOB_STATUS_FIELD)
    status = None if raw is None else raw.decode()
    if status is None or status in _RESUBMIT:
        return False
    batch.inflight[job_id] = entry
    # tok/s: only a job that had not started yet generates all its tokens during this run (batch_progress)
    batch.throughput.adopt(job_id, counted=status not in _ENDED and status != "started")
    return True


def _job_defaults(args: argparse.Namespace) -> dict[str, Any]:
    """The job fields the command line sets for every line (a line's own fields override them): the sampling
    flags, --tenant / --deadline, and `stream: false` unless --stream. Nobody reads a batch token by token, and a job without token
    events costs Redis only its end; with --stream the field is left out (true is the job's default)."""
    return {
        **sampling_kwargs(args),
        **placement_kwargs(args),
        **({} if args.stream else {"stream": False}),
    }


def _entries(path: Path, fmt: LineFormat, defaults: dict[str, Any], done_keys: set[str]) -> Iterator[Entry]:
    seen: set[str] = set()
    for lineno, key, _, text in first_pass(path, fmt):
        if key in done_keys:
            continue
        if key in seen:  # only in the plain format: the OpenAI one refuses such a file up front
            yield Entry(lineno, key, error=f"duplicate id {key}: only its first line is run", duplicate=True)
            continue
        seen.add(key)
        yield fmt.parse(lineno, text, defaults)


def _submit(batch: Batch, client: Any, chunk: list[Entry]) -> None:
    from rose.jobs.client import Client

    if not chunk:
        return
    args = batch.args
    rq_opts: dict[str, Any] = {"result_ttl": args.result_ttl}
    if args.job_timeout is not None:
        rq_opts["job_timeout"] = args.job_timeout
    by_queue: dict[str | None, list[tuple[Entry, dict[str, Any]]]] = {}
    for entry in chunk:
        job_id = uuid.uuid4().hex
        # recorded before enqueueing: an interrupted run never leaves a job the next run cannot find
        batch.jobs_out.write(json.dumps({"id": entry.id, "job_id": job_id}) + "\n")
        by_queue.setdefault(entry.queue, []).append((entry, {**entry.request, **rq_opts, "job_id": job_id}))
    batch.jobs_out.flush()
    for queue, group in by_queue.items():  # one round trip per queue (--queue-for)
        to = client if queue is None else Client(client.redis, queue=queue)
        jobs = to.submit_many([request for _, request in group], **_job_defaults(args))
        for (entry, _), job in zip(group, jobs, strict=True):
            batch.inflight[job.id] = entry


def _poll(batch: Batch, client: Any, conn: Any) -> int:
    """Write the lines of the jobs that ended; returns how many."""
    from rose.jobs.client import JobCanceled, JobFailed

    if not batch.inflight:
        return 0
    ids = list(batch.inflight)
    with conn.pipeline(transaction=False) as pipe:
        for job_id in ids:
            pipe.hget(keys.rq_job_key(job_id), keys.JOB_STATUS_FIELD)
        statuses = pipe.execute()
    ended = 0
    fmt = batch.fmt
    batch.running.clear()
    for job_id, status in zip(ids, statuses, strict=True):
        if status is not None and status.decode() not in _ENDED:
            if status == b"started":
                batch.running.add(job_id)
            continue
        entry = batch.inflight.pop(job_id)
        tokens: int | None = None
        try:
            result = client.job(job_id).result(timeout=0)
        except JobFailed as exc:
            batch.write(fmt.failed_line(entry, job_id, exc.message, failure_code(exc.message)), failed=True)
        except JobCanceled as exc:
            batch.write(fmt.failed_line(entry, job_id, f"job {exc.reason}", f"job_{exc.reason}"), failed=True)
        except TimeoutError:  # status moved back (requeued) between the two reads: keep waiting
            batch.inflight[job_id] = entry
            continue
        else:
            batch.write(fmt.result_line(entry, job_id, result), failed=False)
            tokens = int((result.get("usage") or {}).get("completion_tokens", 0))
        batch.throughput.ended(job_id, tokens)
        ended += 1
    return ended


def _show(batch: Batch, progress: Any) -> None:
    now = time.monotonic()
    running = len(batch.running)
    progress.set_postfix_str(
        progress_text(
            batch.done, batch.failed, running, len(batch.inflight) - running, batch.throughput.rate(now)
        ),
        refresh=False,
    )
    if (
        now - batch.last_refresh >= 0.5
    ):  # update() redraws at most every 0.1 s on its own; this covers idle waits
        batch.last_refresh = now
        progress.refresh()
