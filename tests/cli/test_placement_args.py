"""`--tenant` and `--deadline` (rose submit, rose batch): the job fields tenant and deadline."""

from __future__ import annotations

import argparse
import time

import pytest

from rose.cli.request_args import parse_deadline


@pytest.mark.parametrize(
    ("text", "seconds"), [("600", 600), ("90s", 90), ("10m", 600), ("2h", 7200), ("1d", 86400), ("0.5", 0.5)]
)
def test_a_deadline_from_now(text: str, seconds: float) -> None:
    before = time.time()
    when = parse_deadline(text)
    assert before + seconds <= when <= time.time() + seconds


def test_a_deadline_at_a_time_with_its_zone() -> None:
    assert parse_deadline("2036-11-27T18:00:00+00:00") == 2111421600.0
    assert parse_deadline("2036-11-27T19:00:00+01:00") == 2111421600.0
    assert parse_deadline("2036-11-27T18:00:00Z") == 2111421600.0


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("0", "must be > 0 seconds"),
        ("-5m", "must be > 0 seconds"),
        ("soon", "want seconds from now"),
        ("2036-11-27T18:00:00", "give the time's zone"),
        ("2020-01-01T00:00:00Z", "is in the past"),
        ("1795802400", "not a Unix time"),
    ],
)
def test_a_bad_deadline_is_refused_naming_it(text: str, why: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=why):
        parse_deadline(text)


def test_submit_sends_tenant_and_deadline(rose, cli_redis) -> None:
    """No worker serves the queue: the job is enqueued with the fields and rose submit gives up waiting (124); a bad
    value exits 2 before anything is enqueued."""
    from rq.job import Job
    from rq.serializers import JSONSerializer

    args = (
        "submit",
        "--queue",
        "placement",
        "--timeout",
        "0.2",
        "--tenant",
        "acme",
        "--deadline",
        "10m",
        "hi",
    )
    res = rose(*args)
    assert res.returncode == 124, res.stderr
    job = Job.fetch(res.stdout.split()[0], connection=cli_redis.client(), serializer=JSONSerializer)
    assert job.kwargs["tenant"] == "acme" and time.time() + 500 < job.kwargs["deadline"] < time.time() + 700
    bad = rose("submit", "--queue", "placement", "--deadline", "soon", "hi")
    assert bad.returncode == 2 and "--deadline: 'soon': want seconds from now" in bad.stderr


def test_batch_sends_them_to_every_line_that_has_none_of_its_own() -> None:
    from rose.cli import build_parser
    from rose.cli.batch import _job_defaults

    args = build_parser().parse_args(
        ["batch", "in.jsonl", "-o", "out.jsonl", "--tenant", "acme", "--deadline", "1h"]
    )
    defaults = _job_defaults(args)
    assert defaults["tenant"] == "acme" and time.time() + 3500 < defaults["deadline"] < time.time() + 3700
    plain = build_parser().parse_args(["batch", "in.jsonl", "-o", "out.jsonl"])
    assert "tenant" not in _job_defaults(plain) and "deadline" not in _job_defaults(plain)
