"""`rose submit`: enqueue one generation job, then stream its tokens or wait for its text."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from rose.cli.common import (
    EXIT_TIMEOUT,
    add_redis_args,
    connect,
    ended_badly,
    error,
    later,
    usage_line,
    workers_serving,
)
from rose.cli.request_args import (
    add_placement_args,
    add_request_args,
    add_tool_args,
    json_arg,
    placement_kwargs,
    request_kwargs,
    tool_kwargs,
)
from rose.cli.sampling_args import add_sampling_args, sampling_kwargs

if TYPE_CHECKING:
    from rose.jobs.client import Job


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "submit",
        help="submit one prompt (or chat) to the workers and print its text",
        description=(
            "Enqueue one rose.jobs.generate job: a PROMPT, or chat messages (--messages) that the worker renders "
            "with its model's chat template. Prints the job id, then the text (live with --stream), then "
            "its tool calls (with --tools), the finish reason and token usage. --no-token-events: the worker "
            "publishes only the job's end, no tokens (the text comes with the result). Exit code: 0 done, 1 failed or canceled (message on "
            "stderr), "
            "124 --timeout passed (the job goes on: `rose result JOB_ID --wait S`), 130 Ctrl-C."
        ),
    )
    p.add_argument(
        "prompt", metavar="PROMPT", nargs="?", default=None, help="prompt text (or give --messages)"
    )
    p.add_argument(
        "--messages",
        type=json_arg,
        default=None,
        metavar="JSON|@FILE",
        help='chat messages instead of a PROMPT: a JSON list such as \'[{"role": "user", "content": "Hi"}]\'',
    )
    add_redis_args(p)
    p.add_argument("--stream", action="store_true", help="print the tokens as the worker generates them")
    p.add_argument(
        "--no-token-events",
        action="store_true",
        help="send the job with stream: false: the worker publishes no token events, only the job's end "
        "(cheaper for Redis); the text is printed when the result comes (not with --stream)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="S",
        help="give up waiting after S seconds (with --stream: S seconds without a token); default: wait",
    )
    p.add_argument(
        "--priority", type=int, default=None, help="engine priority among waiting jobs (lower first)"
    )
    p.add_argument(
        "--lora",
        default=None,
        metavar="NAME",
        help="generate with this LoRA adapter (the job field lora: a NAME of the worker's --lora-modules); "
        "default: the base model",
    )
    p.add_argument("--job-timeout", type=int, default=None, metavar="S", help="RQ job_timeout (default 180)")
    p.add_argument("--result-ttl", type=int, default=None, metavar="S", help="RQ result_ttl (default 500)")
    add_placement_args(p)
    add_sampling_args(p)
    add_request_args(p)
    add_tool_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rose.jobs.client import JobCanceled, JobFailed
    from rose.jobs.schemas import GenerateRequest, ValidationError, format_validation_error

    if (args.prompt is None) == (args.messages is None):
        error(args, "error: give a PROMPT or --messages (one of the two)")
        return 2
    if args.stream and args.no_token_events:
        error(
            args,
            "error: --stream prints the token events that --no-token-events turns off: give one of the two",
        )
        return 2
    fields: dict[str, Any] = {**sampling_kwargs(args), **request_kwargs(args), **tool_kwargs(args)}
    if args.stream and fields.get("n", 1) > 1:
        error(
            args, "error: --stream prints one text as it comes; with --n > 1 the choices print when they end"
        )
        return 2
    if args.messages is not None:
        fields["messages"] = args.messages
    else:
        fields["prompt"] = args.prompt
    if args.priority is not None:
        fields["priority"] = args.priority
    if args.lora is not None:
        fields["lora"] = args.lora
    fields.update(placement_kwargs(args))
    if args.no_token_events:
        # only false is sent: true is the job's default, and a job without the field runs on older workers too
        fields["stream"] = False
    rq_opts = {n: getattr(args, n) for n in ("job_timeout", "result_ttl") if getattr(args, n) is not None}
    try:
        # checked before connecting: bad messages, or a chat option without messages, fail at once
        GenerateRequest(**fields)
    except ValidationError as exc:
        error(args, f"error: {format_validation_error(exc)}")
        return 2
    from rose.jobs.client import Client
    from rose.jobs.connection import redact_url

    conn = connect(args)
    job = Client(conn, queue=args.queue).submit(**fields, **rq_opts)
    out = sys.stdout
    print(job.id, file=out, flush=True)
    if not workers_serving(conn, args.queue):  # say so now rather than wait in silence
        error(
            args,
            f"warning: no worker serves queue {args.queue!r} on {redact_url(args.redis_url)}: the job waits until "
            f"one does (rose-worker --queue {args.queue}; a worker on another database of this Redis does not "
            "count: the URL's /N picks the database, 0 by default)",
        )
    try:
        result = _stream(job, args.timeout) if args.stream else job.result(timeout=args.timeout)
        if args.stream and "tools" in fields:  # the calls come with the stored result, not the events
            result = job.result(timeout=args.timeout)
    except (JobFailed, JobCanceled) as exc:
        return ended_badly(args, job.id, exc)
    except TimeoutError as exc:
        error(args, f"{exc}; the job goes on: {later(args, job.id)}")
        return EXIT_TIMEOUT
    except KeyboardInterrupt:
        error(
            args,
            f"interrupted; job {job.id} goes on: {later(args, job.id)}",
        )
        return 130
    choices = result.get("choices") or [result]  # n > 1: each choice under a [choice i] line
    for i, choice in enumerate(choices):
        if len(choices) > 1:
            out.write(f"[choice {i}]\n")
        if not args.stream:
            out.write(choice.get("text", "") + "\n")
        for call in choice.get("tool_calls") or ():
            function = call["function"]
            out.write(
                f"[tool_call id={call['id']} name={function['name']} arguments={function['arguments']}]\n"
            )
    out.write(usage_line(result) + "\n")
    out.flush()
    return 0


def _stream(job: Job, timeout: float | None) -> dict[str, Any]:
    """Write the deltas as they come; return the `done` event's fields (finish_reason, usage)."""
    from rose.jobs.client import JobCanceled, JobFailed

    out = sys.stdout
    started = False
    for event in job.events(timeout=timeout):
        if event.type == "token":
            started = True
            out.write(event.text)
            out.flush()
        elif event.type == "reset":
            if started:
                out.write("\n")
                print("[the job restarted from scratch on a worker; its text again:]", file=sys.stderr)
                started = False
        elif event.type == "done":
            out.write("\n")
            return {"finish_reason": event.finish_reason, "usage": event.usage.model_dump()}
        elif event.type == "error":
            out.write("\n" if started else "")
            raise JobFailed(job.id, event.message)
        elif event.type == "canceled":
            out.write("\n" if started else "")
            raise JobCanceled(job.id, event.reason)
    raise JobFailed(job.id, "the job's events ended without a terminal event")
