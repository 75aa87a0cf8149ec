"""`rose demo` driven as a user would: a subprocess, its plain (non-TTY) output parsed line by line."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from rose.demo.runner import DEFAULT_PROMPTS

LINE = re.compile(r"^\[(\d+)\] (job|\+|end|result) ?(.*)$")


def run_demo(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rose", "demo", "--max-tokens", "8", "--duration-limit", "240", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=None if env is None else {**os.environ, **env},
    )


def parse(stdout: str) -> tuple[dict[int, str], dict[int, dict], dict[int, str]]:
    streamed: dict[int, list[str]] = {}
    results: dict[int, dict] = {}
    ends: dict[int, str] = {}
    for line in stdout.splitlines():
        m = LINE.match(line)
        if not m:
            continue
        i, kind, rest = int(m.group(1)), m.group(2), m.group(3)
        if kind == "+":
            streamed.setdefault(i, []).append(json.loads(rest))
        elif kind == "result":
            results[i] = json.loads(rest)
        elif kind == "end":
            ends[i] = rest
    return {i: "".join(parts) for i, parts in streamed.items()}, results, ends


def port_of(stdout: str) -> int:
    m = re.search(r"on 127\.0\.0\.1:(\d+)", stdout)
    assert m, stdout
    return int(m.group(1))


def processes_mentioning(text: str) -> list[str]:
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(f"{proc.name}: {cmdline}")
    return found


def assert_nothing_left(stdout: str) -> None:
    port = port_of(stdout)
    with socket.socket() as s:
        s.settimeout(2)
        assert s.connect_ex(("127.0.0.1", port)) != 0, f"something still listens on the demo's port {port}"
    if sys.platform.startswith("linux"):
        assert not processes_mentioning(f"127.0.0.1:{port}"), "redis-server left behind"
        assert not processes_mentioning(f"--port {port}"), "redis-server left behind"
        m = re.search(r"redis-server pid (\d+)", stdout)
        if m:
            proc = Path(f"/proc/{m.group(1)}/cmdline")
            assert not (proc.exists() and b"redis-server" in proc.read_bytes()), "redis-server left behind"


def check_run(res: subprocess.CompletedProcess[str], prompts: tuple[str, ...]) -> None:
    assert res.returncode == 0, f"stdout:\n{res.stdout[-3000:]}\nstderr:\n{res.stderr[-3000:]}"
    streamed, results, ends = parse(res.stdout)
    n = len(prompts)
    assert sorted(results) == list(range(1, n + 1)), res.stdout
    assert all(ends.get(i) == "finished" for i in range(1, n + 1)), ends
    for i, result in results.items():
        assert result["finish_reason"] in ("length", "stop")
        assert result["usage"]["completion_tokens"] == len(result["token_ids"]) <= 8
        assert {"queue_s", "ttft_s", "generation_s", "tokens_per_s"} <= set(result["metrics"])
        assert streamed.get(i, "") == result["text"], f"job {i}: streamed text differs from the stored text"
    jobs = [line for line in res.stdout.splitlines() if re.match(r"^\[\d+\] job ", line)]
    assert {json.JSONDecoder().raw_decode(line.split(" ", 3)[3])[0] for line in jobs} == set(prompts)
    assert_nothing_left(res.stdout)


@pytest.mark.timeout(600)
def test_demo_streams_and_stores_every_prompt() -> None:
    res = run_demo()
    assert "redis-server pid" in res.stdout or "fakeredis" in res.stdout
    check_run(res, DEFAULT_PROMPTS)


@pytest.mark.timeout(600)
def test_demo_with_fakeredis_and_own_prompts() -> None:
    prompts = ("Hello", 'Quote " and ünïcode')
    res = run_demo("--redis", "fake", "--prompts", *prompts)
    assert "fakeredis" in res.stdout
    check_run(res, prompts)


def test_first_run_says_it_compiles_the_cpu_kernels_once(tmp_path) -> None:
    """A cold numba cache (a fresh NUMBA_CACHE_DIR): the demo says why its first tokens are slow; the next run,
    with the kernels cached on disk, says nothing of it."""
    env = {"NUMBA_CACHE_DIR": str(tmp_path / "numba"), "ROSE_ATTENTION_BACKEND": "numba"}
    notice = "compiling CPU kernels (numba), first run only"
    first = run_demo("--prompts", "Hello", "--redis", "fake", env=env)
    assert first.returncode == 0, first.stderr
    assert first.stdout.count(notice) == 1, first.stdout
    assert any((tmp_path / "numba").rglob("*.nbi")), "numba wrote no cache index"
    second = run_demo("--prompts", "Hello", "--redis", "fake", env=env)
    assert second.returncode == 0, second.stderr
    assert notice not in second.stdout and notice not in second.stderr
