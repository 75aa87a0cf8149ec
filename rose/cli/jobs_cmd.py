"""`rose cancel` and `rose result`: act on jobs by id."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rose.cli.common import EXIT_FAILED, EXIT_TIMEOUT, add_redis_args, connect, ended_badly, error
from rose.jobs import keys


def add_parser(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser(
        "cancel",
        help="cancel jobs (queued ones never start, running ones stop within about 50 ms)",
        description=(
            "Cancel jobs by id. Jobs that already ended are left as they are. Exit code 1 if any id is unknown "
            "(never existed, or expired)."
        ),
    )
    c.add_argument("job_ids", nargs="*", metavar="JOB_ID", help="job ids")
    c.add_argument(
        "--jobs-file",
        type=Path,
        default=None,
        metavar="FILE",
        help="also cancel every job listed in FILE (the `<output>.jobs` file `rose batch` keeps); ids "
        "that ended or expired are skipped quietly",
    )
    add_redis_args(c, queue=False)
    c.set_defaults(func=run_cancel)

    r = sub.add_parser(
        "result",
        help="print a job's stored result as JSON",
        description=(
            "Print the stored result of a job as JSON. Exit code 1 (message on stderr) if the job failed, was "
            "canceled or is unknown; 124 if it has not finished (after --wait S seconds)."
        ),
    )
    r.add_argument("job_id", metavar="JOB_ID")
    r.add_argument(
        "--wait",
        type=float,
        default=0,
        metavar="S",
        help="wait up to S seconds for the job to end (default 0)",
    )
    add_redis_args(r, queue=False)
    r.set_defaults(func=run_result)


def _jobs_file_ids(path: Path) -> list[str]:
    ids = []
    with path.open() as f:
        for line in f:
            try:
                ids.append(json.loads(line)["job_id"])
            except (ValueError, KeyError, TypeError):
                continue
    return ids


def run_cancel(args: argparse.Namespace) -> int:
    from rose.jobs.client import Client

    if not args.job_ids and args.jobs_file is None:
        error(args, "error: give job ids or --jobs-file")
        return 2
    conn = connect(args)
    client = Client(conn)
    unknown = 0
    for job_id in args.job_ids:
        if not conn.exists(keys.rq_job_key(job_id)):
            error(args, f"{job_id}: no such job (unknown, or expired)")
            unknown += 1
        elif client.cancel(job_id):
            print(f"{job_id} canceled", flush=True)
        else:
            status = (conn.hget(keys.rq_job_key(job_id), keys.JOB_STATUS_FIELD) or b"ended").decode()
            print(f"{job_id} already {status}", flush=True)
    if args.jobs_file is not None:
        canceled = sum(client.cancel(job_id) for job_id in _jobs_file_ids(args.jobs_file))
        print(f"{canceled} jobs canceled from {args.jobs_file}", flush=True)
    return EXIT_FAILED if unknown else 0


def run_result(args: argparse.Namespace) -> int:
    from rose.jobs.client import Client, JobCanceled, JobFailed

    conn = connect(args)
    if not conn.exists(keys.rq_job_key(args.job_id)):
        error(args, f"{args.job_id}: no such job (unknown, or expired)")
        return EXIT_FAILED
    try:
        result = Client(conn).job(args.job_id).result(timeout=max(args.wait, 0))
    except (JobFailed, JobCanceled) as exc:
        return ended_badly(args, args.job_id, exc)
    except TimeoutError:
        status = (conn.hget(keys.rq_job_key(args.job_id), keys.JOB_STATUS_FIELD) or b"unknown").decode()
        error(args, f"job {args.job_id} has not finished (status: {status}); wait with --wait S")
        return EXIT_TIMEOUT
    json.dump(result, sys.stdout, ensure_ascii=False)
    sys.stdout.write("\n")
    return 0
