"""A producer installs rose without the engine (`pip install rose-worker`; the engine, the worker daemon and the
offline commands come with the `engine` extra): what Client, AsyncClient and the producer commands import is in the
base install, and the engine's commands there say what to install instead of failing on an import."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from rose.config.extras import ENGINE_MODULES

ROOT = Path(__file__).resolve().parents[2]

# what a producer does: build and check jobs (constraints included), and run the producer commands' parsers
PRODUCER = """
import json, sys
from rose import AsyncClient, Client
from rose.jobs.schemas import GenerateRequest
schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}}, "required": ["name"]}
GenerateRequest(prompt="x", structured_outputs={"json": schema})
GenerateRequest(prompt="x", structured_outputs={"regex": "[a-z]+"})
GenerateRequest(
    messages=[{"role": "user", "content": "hi"}],
    response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
)
tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
GenerateRequest(messages=[{"role": "user", "content": "hi"}], tools=tools, tool_choice="required")
import rose.jobs.contract  # the result's tool calls (rose.jobs.tools) are read with no engine either
import rose.cli
for command in ("submit", "batch", "status", "result", "cancel"):
    try:
        rose.cli.main([command, "--help"])
    except SystemExit:
        pass
sys.stderr.write(json.dumps(sorted({name.split(".")[0] for name in sys.modules})))
"""


def base_closure() -> set[str]:
    """The distributions `pip install rose-worker` brings: pyproject's dependencies and theirs (with the extras each
    requirement names), without rose's own extras."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    stack = [Requirement(r) for r in pyproject["project"]["dependencies"]]
    seen: set[tuple[str, str]] = set()  # (distribution, extra: "" for its plain requirements)
    while stack:
        req = stack.pop()
        name = canonicalize_name(req.name)
        for extra in req.extras | {""}:
            if (name, extra) in seen:
                continue
            seen.add((name, extra))
            for line in metadata.requires(name) or []:
                sub = Requirement(line)
                if sub.marker is None or sub.marker.evaluate({"extra": extra}):
                    stack.append(sub)
    return {name for name, _ in seen}


# imported only when installed (nothing a producer needs): jsonschema's format checkers, redis's TLS helpers,
# setuptools' start-up hook
OPTIONAL = frozenset(
    {
        "jsonpointer",
        "rfc3339_validator",
        "rfc3986_validator",
        "rfc3987",
        "idna",
        "fqdn",
        "isoduration",
        "uri_template",
        "webcolors",
        "certifi",
        "cryptography",
        "_distutils_hack",
    }
)


def test_what_a_producer_imports_comes_with_the_base_install():
    ran = subprocess.run(
        [sys.executable, "-c", PRODUCER], capture_output=True, text=True, timeout=120, check=True
    )
    loaded = set(json.loads(ran.stderr.strip().splitlines()[-1]))
    assert not loaded & ENGINE_MODULES, loaded & ENGINE_MODULES
    owners = metadata.packages_distributions()
    base = base_closure()
    outside = {
        module: owners[module]
        for module in loaded
        if module in owners
        and module not in OPTIONAL | {"rose"}
        and not {canonicalize_name(d) for d in owners[module]} & base
    }
    assert not outside, f"producer modules from outside the base install: {outside}"
    engine = {canonicalize_name(d) for d in ("torch", "transformers", "numba", "xgrammar")}
    assert not engine & base


def without_engine(argv: list[str]) -> list[str]:
    """The command line that runs `argv` (a rose or rose-worker command line) in a process where the engine's
    modules cannot be imported."""
    code = (
        "import sys\n"
        f"for name in {sorted(ENGINE_MODULES)!r}:\n"
        "    sys.modules[name] = None  # import raises ModuleNotFoundError, as in a producer's install\n"
        f"argv = {argv!r}\n"
        "if argv[0] == 'rose-worker':\n"
        "    from rose.worker.cli import main\n"
        "else:\n"
        "    from rose.cli import main\n"
        "sys.exit(main(argv[1:]))\n"
    )
    return [sys.executable, "-c", code]


def run_without_engine(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(without_engine(argv), capture_output=True, text=True, timeout=120, check=False)


def test_engine_commands_say_what_to_install(redis_server):
    for argv, prefix in (
        (["rose", "generate", "--model", "tiny-llama", "hi"], "rose generate"),
        (["rose", "demo"], "rose demo"),
        (["rose-worker", "--redis-url", redis_server.url, "--model", "tiny-llama"], "rose-worker"),
    ):
        ran = run_without_engine(argv)
        assert ran.returncode == 2, (argv, ran.stderr)
        assert (
            ran.stderr.startswith(f"{prefix}: error: ")
            and "is not installed: this command needs rose's engine: pip install 'rose-worker[engine]'"
            in ran.stderr
        ), ran.stderr
        assert "Traceback" not in ran.stderr


def test_only_a_missing_engine_package_is_reported_as_one():
    from rose.config.extras import missing_engine

    assert "pip install 'rose-worker[engine]'" in missing_engine(ModuleNotFoundError(name="torch"))
    assert missing_engine(ModuleNotFoundError(name="torch.nope")) is None  # torch is here: a real error
    assert missing_engine(ModuleNotFoundError(name="no_such_module")) is None


def test_producer_commands_run_against_redis_without_the_engine(redis_server, tmp_path):
    """Not only their --help: a job is enqueued, and the queue reported, in a process that cannot import torch."""
    url = redis_server.url
    ran = run_without_engine(
        ["rose", "submit", "--redis-url", url, "--queue", "producer", "--timeout", "0.5", "Hi"]
    )
    assert ran.returncode == 124, ran.stderr  # no worker serves the queue: it gives up waiting, the job stays
    assert "no worker" in ran.stderr and "Traceback" not in ran.stderr, ran.stderr
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    out = tmp_path / "out.jsonl"
    argv = [
        "rose",
        "batch",
        str(prompts),
        "-o",
        str(out),
        "--redis-url",
        url,
        "--queue",
        "producer",
        "--no-progress",
    ]
    batch = subprocess.Popen(without_engine(argv), stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while redis_server.client().llen("rq:queue:producer") < 3 and batch.poll() is None:
            assert time.monotonic() < deadline, "rose batch enqueued nothing in 60 s"
            time.sleep(0.05)
        assert batch.poll() is None  # enqueued both lines; waits for their results
        batch.send_signal(signal.SIGINT)  # Ctrl-C: it stops waiting, resumable
        _, stderr = batch.communicate(timeout=60)
    finally:
        batch.kill()
    assert batch.returncode == 130 and "Traceback" not in stderr, stderr
    ran = run_without_engine(["rose", "status", "--redis-url", url])
    assert ran.returncode == 0 and "producer" in ran.stdout, (ran.stdout, ran.stderr)
