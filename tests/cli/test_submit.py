"""`rose submit`, `rose result`, `rose cancel`: real subprocesses against a real redis-server and rose-worker."""

from __future__ import annotations

import json
import subprocess
import zlib

import pytest
from cli_helpers import rose_cmd, wait_for

from rose.harness.job_audit import stream_events

pytestmark = pytest.mark.timeout(300)


def test_help_lists_the_flags(rose) -> None:
    for command in ("submit", "batch", "status", "cancel", "result"):
        res = rose(command, "--help")
        assert res.returncode == 0, res.stderr
        assert "--redis-url" in res.stdout
    assert "--max-tokens" in rose("submit", "--help").stdout
    assert "--no-token-events" in rose("submit", "--help").stdout
    assert "--max-in-flight" in rose("batch", "--help").stdout
    assert "--stream" in rose("batch", "--help").stdout


def test_submit_stream_prints_id_tokens_then_usage(rose, cli_worker) -> None:
    res = rose("submit", "--stream", "--max-tokens", "6", "--ignore-eos", "--temperature", "0", "Hello")
    assert res.returncode == 0, res.stderr
    job_id, rest = res.stdout.split("\n", 1)
    streamed, _, tail = rest.rpartition("\n[finish_reason=")
    assert tail.startswith("length ") and "completion_tokens=6]" in tail

    stored = rose("result", job_id)
    assert stored.returncode == 0, stored.stderr
    result = json.loads(stored.stdout)
    assert result["text"] == streamed
    assert result["usage"]["completion_tokens"] == 6
    assert result["finish_reason"] == "length"


def test_submit_waits_and_prints_the_text(rose, cli_worker) -> None:
    res = rose("submit", "--max-tokens", "5", "--ignore-eos", "--seed", "3", "Bonjour")
    assert res.returncode == 0, res.stderr
    assert "no worker serves" not in res.stderr  # the session's worker serves the default queue
    job_id, rest = res.stdout.split("\n", 1)
    text, _, tail = rest.rpartition("\n[finish_reason=")
    assert tail.startswith("length ") and "completion_tokens=5]" in tail
    assert json.loads(rose("result", job_id).stdout)["text"] == text


def test_submit_no_token_events_publishes_only_the_end_and_prints_the_text(
    rose, cli_redis, cli_worker
) -> None:
    res = rose("submit", "--no-token-events", "--max-tokens", "5", "--ignore-eos", "--seed", "3", "Bonjour")
    assert res.returncode == 0, res.stderr
    job_id, rest = res.stdout.split("\n", 1)
    text, _, tail = rest.rpartition("\n[finish_reason=")
    assert tail.startswith("length ") and "completion_tokens=5]" in tail
    assert json.loads(rose("result", job_id).stdout)["text"] == text
    conn = cli_redis.client()
    # sent with stream: false; the worker published the done event (seq 0) and no token event
    assert json.loads(zlib.decompress(conn.hget(f"rq:job:{job_id}", "data")))[3]["stream"] is False
    assert [(e["type"], e["seq"]) for e in stream_events(conn, job_id)] == [("done", 0)]


def test_submit_n_prints_each_choice(rose, cli_worker) -> None:
    res = rose("submit", "--n", "2", "--max-tokens", "3", "--ignore-eos", "--seed", "3", "Bonjour")
    assert res.returncode == 0, res.stderr
    job_id, rest = res.stdout.split("\n", 1)
    result = json.loads(rose("result", job_id).stdout)
    texts = [c["text"] for c in result["choices"]]
    assert rest == f"[choice 0]\n{texts[0]}\n[choice 1]\n{texts[1]}\n" + rest.split("\n")[-2] + "\n"
    assert "completion_tokens=6]" in rest
    streamed = rose("submit", "--stream", "--n", "2", "Bonjour")
    assert streamed.returncode == 2 and "--n > 1" in streamed.stderr


def test_submit_stream_with_no_token_events_is_a_usage_error(rose) -> None:
    res = rose("submit", "--stream", "--no-token-events", "Hello")
    assert res.returncode == 2 and res.stdout == ""
    assert len(res.stderr.splitlines()) == 1
    assert "--stream" in res.stderr and "--no-token-events" in res.stderr


def test_submit_failed_job_exits_1_with_the_workers_message(rose, cli_worker) -> None:
    res = rose("submit", "--max-tokens", "5000", "Hello")  # the worker's context is 4096
    assert res.returncode == 1
    job_id = res.stdout.split("\n", 1)[0]
    assert "failed" in res.stderr and "max_tokens" in res.stderr
    res = rose("result", job_id)
    assert res.returncode == 1 and "max_tokens" in res.stderr


def test_submit_invalid_value_is_a_usage_error(rose) -> None:
    res = rose("submit", "--temperature", "-1", "Hello")
    assert res.returncode == 2
    assert "temperature" in res.stderr and res.stdout == ""


def test_timeout_then_cancel_a_queued_job(rose, cli_worker) -> None:
    res = rose("submit", "--queue", "nobody-serves-this", "--timeout", "1", "Hello")
    assert res.returncode == 124, res.stderr
    job_id = res.stdout.strip()
    assert f"rose cancel {job_id}" in res.stderr

    res = rose("result", job_id)
    assert res.returncode == 124 and "queued" in res.stderr

    res = rose("cancel", job_id)
    assert res.returncode == 0, res.stderr
    assert f"{job_id} canceled" in res.stdout
    res = rose("result", job_id, "--wait", "5")
    assert res.returncode == 1 and "canceled" in res.stderr
    res = rose("cancel", job_id)  # already ended: not an error
    assert res.returncode == 0 and "already canceled" in res.stdout


def test_a_queue_no_worker_serves_is_said_at_once_and_the_hints_keep_the_url(
    rose, cli_redis, cli_worker
) -> None:
    """Submitting where no worker listens (a wrong queue, or a wrong database: the default URL is db 0) says so at
    once; the commands printed to follow the job carry the --redis-url the user gave, so they work as copied."""
    env = {
        k: v for k, v in rose.env.items() if k != "ROSE_REDIS_URL"
    }  # the URL given on the command line only

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            rose_cmd(*args), capture_output=True, text=True, timeout=180, check=False, env=env
        )

    url = cli_redis.url
    res = run("submit", "--redis-url", url, "--queue", "nobody-serves-this", "--timeout", "1", "Hello")
    assert res.returncode == 124, res.stderr
    job_id = res.stdout.strip()
    assert f"warning: no worker serves queue 'nobody-serves-this' on {url}" in res.stderr
    assert f"`rose result {job_id} --wait S --redis-url {url}`" in res.stderr
    assert f"`rose cancel {job_id} --redis-url {url}`" in res.stderr
    res = run("result", job_id, "--redis-url", url)  # as printed: the job is found, still queued
    assert res.returncode == 124 and "queued" in res.stderr
    res = run("cancel", job_id, "--redis-url", url)
    assert res.returncode == 0 and f"{job_id} canceled" in res.stdout


def test_version_and_a_misspelled_flag(rose) -> None:
    res = rose("--version")
    assert res.returncode == 0 and res.stdout.startswith("rose ") and res.stdout.split()[1][0].isdigit()
    # the prompt after a misspelled flag's value is not taken silently: the flag meant is named
    res = rose("submit", "--temprature", "0.5", "Hi")
    assert res.returncode == 2 and res.stdout == ""
    assert "unrecognized arguments: --temprature Hi (--temprature: did you mean --temperature?)" in res.stderr
    assert res.stderr.startswith("usage: rose submit")  # the subcommand's usage, not rose's
    res = rose("status", "--jsn")
    assert res.returncode == 2 and "did you mean --json?" in res.stderr


def test_cancel_unknown_ids_exit_1(rose, cli_worker) -> None:
    res = rose("cancel", "no-such-job")
    assert res.returncode == 1 and "no-such-job" in res.stderr
    res = rose("result", "no-such-job")
    assert res.returncode == 1 and "no such job" in res.stderr


def test_cancel_a_streaming_job(rose, cli_worker) -> None:
    # long enough (up to the context) that it cannot finish before it is canceled
    proc = subprocess.Popen(
        rose_cmd("submit", "--stream", "--max-tokens", "4000", "--ignore-eos", "Tell me a long story"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=rose.env,
    )
    try:
        job_id = proc.stdout.readline().strip()
        assert job_id, proc.stderr.read()
        assert proc.stdout.read(1)  # tokens are streaming: the job runs on the worker
        res = rose("cancel", job_id, "another-unknown-id")
        assert res.returncode == 1  # one id was unknown ...
        assert f"{job_id} canceled" in res.stdout  # ... and the known one was canceled all the same
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1
    assert "canceled" in err
    wait_for(lambda: rose("result", job_id).returncode == 1, 30, "canceled status")
