"""`rose batch`: a real subprocess against a real redis-server and rose-worker."""

from __future__ import annotations

import collections
import json
import subprocess
import zlib
from pathlib import Path

import pytest
from cli_helpers import checkout_env, interrupt_when, rose_cmd

from rose.harness.job_audit import stream_events

pytestmark = pytest.mark.timeout(400)

MALFORMED = {17: "{not json", 60: '{"prompt": "x", "temprature": 1.0}', 150: '{"id": "no-prompt", "seed": 1}'}


def write_input(path: Path, n: int = 200) -> dict:
    """n lines: text prompts (some with their own id and max_tokens), token-id prompts, and MALFORMED.
    Returns {id: expected completion tokens or None for a malformed line}."""
    expected: dict = {}
    with path.open("w") as f:
        for i in range(1, n + 1):
            if i in MALFORMED:
                f.write(MALFORMED[i] + "\n")
                expected["no-prompt" if i == 150 else i] = None
            elif i % 7 == 0:
                f.write(
                    json.dumps({"id": f"tok-{i}", "prompt_token_ids": [5, 6, 7, i], "max_tokens": 2}) + "\n"
                )
                expected[f"tok-{i}"] = 2
            else:
                f.write(json.dumps({"prompt": f"Hello number {i}"}) + "\n")
                expected[i] = 4
    return expected


def read_output(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def check_complete(output: list[dict], expected: dict) -> None:
    counts = collections.Counter(line["id"] for line in output)
    assert counts == collections.Counter(expected.keys())  # every id exactly once
    for line in output:
        want = expected[line["id"]]
        if want is None:
            assert "error" in line and "text" not in line
        else:
            assert "error" not in line, line
            assert line["finish_reason"] == "length"
            assert line["usage"]["completion_tokens"] == want
            assert isinstance(line["text"], str) and line["job_id"]


BATCH_ARGS = ("--max-tokens", "4", "--ignore-eos", "--temperature", "0", "--chunk-size", "16")


def test_batch_with_malformed_lines_interrupted_then_resumed(tmp_path, rose, cli_worker) -> None:
    inp, out = tmp_path / "prompts.jsonl", tmp_path / "results.jsonl"
    expected = write_input(inp)
    args = ("batch", str(inp), "-o", str(out), *BATCH_ARGS, "--max-in-flight", "8")

    returncode, err = interrupt_when(
        args, rose.env, lambda: out.exists() and len(out.read_text().splitlines()) >= 30, "30 result lines"
    )
    first = read_output(out)
    if returncode == 130:  # interrupted mid-way (the usual case): clean stop, resume instructions
        assert "interrupted" in err and "resume" in err and "rose cancel" in err, err
        assert (tmp_path / "results.jsonl.jobs").exists()
        assert len(first) < len(expected)
        # what the message says: cancel what the run left queued or running (the resume runs those lines again)
        res = rose("cancel", "--jobs-file", str(tmp_path / "results.jsonl.jobs"))
        assert res.returncode == 0 and "jobs canceled from" in res.stdout, res.stderr
    else:  # the machine was fast enough to finish before the signal
        assert returncode == 1, err
    assert f"{inp}:17:" in err and "invalid JSON" in err
    assert len({line["id"] for line in first}) == len(first)

    res = rose(*args[:-2], "--max-in-flight", "32")  # same command (a different window is fine too)
    assert res.returncode == 1, res.stderr  # three lines failed
    assert f"{len(first)} of 200 lines already in" in res.stderr
    assert "197 done, 3 failed" in res.stderr
    check_complete(read_output(out), expected)
    assert not (tmp_path / "results.jsonl.jobs").exists()

    again = rose(*args)  # nothing left to do
    assert again.returncode == 1 and "200 of 200 lines already in" in again.stderr
    assert len(read_output(out)) == 200


def test_resume_skips_lines_already_written_and_a_torn_last_line(tmp_path, rose, cli_worker) -> None:
    inp, out = tmp_path / "prompts.jsonl", tmp_path / "results.jsonl"
    expected = write_input(inp, n=40)
    done_before = {
        i: {
            "id": i,
            "job_id": "earlier",
            "text": "kept",
            "finish_reason": "length",
            "usage": {"completion_tokens": 4},
        }
        for i in (1, 2, 3, 5)
    }
    with out.open("w") as f:
        for line in done_before.values():
            f.write(json.dumps(line) + "\n")
        f.write('{"id": 6, "text": "torn by a cra')  # no newline: a crash mid-write
    res = rose("batch", str(inp), "-o", str(out), *BATCH_ARGS, "--no-progress")
    assert res.returncode == 1, res.stderr  # line 17 is malformed
    output = read_output(out)
    check_complete(output, expected)
    for line in output:
        if line["id"] in done_before:
            assert line["text"] == "kept"  # not run again


def test_per_line_fields_override_the_defaults_and_all_good_exits_0(tmp_path, rose, cli_worker) -> None:
    inp, out = tmp_path / "in.jsonl", tmp_path / "sub" / "out.jsonl"
    lines = [
        {"id": "a", "prompt": "one", "max_tokens": 1},
        {"id": "b", "prompt": "two", "metadata": {"k": 1}},
        {"id": "c", "prompt_token_ids": [3, 4, 5], "max_tokens": 3, "seed": 7, "temperature": 0.8},
        {"id": "d", "messages": [{"role": "user", "content": "one"}]},
        {"id": "e", "prompt": "yes?", "structured_outputs": {"choice": ["yes", "no"]}, "max_tokens": 8},
    ]
    inp.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")  # a blank line is ignored
    res = rose("batch", str(inp), "-o", str(out), "--max-tokens", "2", "--ignore-eos")
    assert res.returncode == 0, res.stderr
    by_id = {line["id"]: line for line in read_output(out)}
    completion = {k: v["usage"]["completion_tokens"] for k, v in by_id.items()}
    assert completion == {"a": 1, "b": 2, "c": 3, "d": 2, "e": completion["e"]}
    assert by_id["b"]["metadata"] == {"k": 1}
    assert by_id["d"]["usage"]["prompt_tokens"] > by_id["a"]["usage"]["prompt_tokens"]  # the chat template's
    # constrained: ends when its grammar does, despite --ignore-eos
    assert by_id["e"]["text"] in ("yes", "no") and by_id["e"]["finish_reason"] == "stop"


def test_duplicate_ids_are_reported_and_run_once(tmp_path, rose, cli_worker) -> None:
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text('{"id": "x", "prompt": "a"}\n{"id": "y", "prompt": "b"}\n{"id": "x", "prompt": "c"}\n')
    res = rose("batch", str(inp), "-o", str(out), "--max-tokens", "2")
    assert res.returncode == 1
    assert f"{inp}:3: duplicate id" in res.stderr
    assert sorted(line["id"] for line in read_output(out)) == ["x", "y"]
    assert all("error" not in line for line in read_output(out))


def test_unreachable_redis_is_one_line(tmp_path, unused_port) -> None:
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "x"}\n')
    res = subprocess.run(
        rose_cmd(
            "batch",
            str(inp),
            "-o",
            str(tmp_path / "o.jsonl"),
            "--redis-url",
            f"redis://127.0.0.1:{unused_port}/0",
        ),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=checkout_env(),
    )
    assert res.returncode != 0
    assert "cannot reach Redis" in res.stderr and "Traceback" not in res.stderr


def job_kwargs(conn, job_id: str) -> dict:
    """The kwargs the job was enqueued with (JSON serializer: zlib-compressed [func, instance, args, kwargs])."""
    return json.loads(zlib.decompress(conn.hget(f"rq:job:{job_id}", "data")))[3]


def event_types(conn, job_id: str) -> list[str]:
    return [event["type"] for event in stream_events(conn, job_id)]


def test_jobs_publish_only_their_end_unless_streamed(tmp_path, rose, cli_redis, cli_worker) -> None:
    """Default: stream false (no token events, only `done` seq 0); a line's own `stream` wins over the command
    line's default both ways; --stream turns token events on for the other lines."""
    inp = tmp_path / "in.jsonl"
    lines = [
        {"id": "plain", "prompt": "one"},
        {"id": "on", "prompt": "two", "stream": True},
        {"id": "off", "prompt": "three", "stream": False},
    ]
    inp.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    conn = cli_redis.client()
    streamed = {}
    for flags in ((), ("--stream",)):
        out = tmp_path / f"out{len(flags)}.jsonl"
        res = rose("batch", str(inp), "-o", str(out), "--max-tokens", "5", "--ignore-eos", *flags)
        assert res.returncode == 0, res.stderr
        by_id = {line["id"]: line for line in read_output(out)}
        assert all(line["usage"]["completion_tokens"] == 5 for line in by_id.values())
        for line_id, line in by_id.items():
            kwargs, types = job_kwargs(conn, line["job_id"]), event_types(conn, line["job_id"])
            streamed[line_id, flags] = types != ["done"]
            # streamed: token events (coalesced, so maybe fewer than the tokens) whose text is the result's
            if streamed[line_id, flags]:
                assert types[-1] == "done" and set(types[:-1]) == {"token"}, types
                tokens = stream_events(conn, line["job_id"])[:-1]
                assert "".join(event["text"] for event in tokens) == line["text"]
            else:
                assert kwargs["stream"] is False
                assert stream_events(conn, line["job_id"])[0]["seq"] == 0
        if flags:  # --stream leaves the field out (the job's default): jobs also run on workers without it
            assert "stream" not in job_kwargs(conn, by_id["plain"]["job_id"])
    assert streamed == {
        ("plain", ()): False,
        ("on", ()): True,
        ("off", ()): False,
        ("plain", ("--stream",)): True,
        ("on", ("--stream",)): True,
        ("off", ("--stream",)): False,
    }
