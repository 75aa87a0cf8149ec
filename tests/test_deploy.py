"""The deployment files agree with the code: docker-compose.yml parses, its services are set up as documented,
and every command line and ROSE_* variable in it (and in the Dockerfile) is accepted by rose's own parsers."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from rose.cli import build_parser as rose_parser
from rose.config import WorkerSettings
from rose.jobs.connection import parse_sentinel_url
from rose.worker.cli import build_parser as worker_parser
from rose.worker.cli import load_settings

ROOT = Path(__file__).resolve().parents[1]
_INTERPOLATION = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}")


def interpolate(value: Any) -> Any:
    """Compose's `${VAR:-default}` with nothing set in the environment: the default (the file's own values)."""
    if isinstance(value, str):

        def sub(m: re.Match[str]) -> str:
            if m.group(2) is None:
                raise AssertionError(f"{m.group(0)} in docker-compose.yml has no default")
            return m.group(2)

        return _INTERPOLATION.sub(sub, value)
    if isinstance(value, list):
        return [interpolate(v) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v) for k, v in value.items()}
    return value


class ComposeLoader(yaml.SafeLoader):
    """YAML with Compose's merge tags: `!reset` (drop the value) and `!override` (replace it) load as
    Reset(value) / the plain value, so an override file parses like Compose reads it."""


class Reset:
    def __init__(self, value: Any) -> None:
        self.value = value


ComposeLoader.add_constructor("!reset", lambda loader, node: Reset(None))
ComposeLoader.add_constructor(
    "!override",
    lambda loader, node: (
        loader.construct_mapping(node, deep=True)
        if isinstance(node, yaml.MappingNode)
        else loader.construct_sequence(node, deep=True)
    ),
)


def load_compose(path: Path) -> dict[str, Any]:
    return interpolate(yaml.load(path.read_text(), Loader=ComposeLoader))  # noqa: S506 - a SafeLoader subclass


def merge_override(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Compose's merge of a second -f file, as far as these files use it: mappings merge key by key, `!reset`
    removes a key, anything else replaces the base's value."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, Reset):
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_override(out[key], value)
        else:
            out[key] = value
    return out


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_compose(ROOT / "docker-compose.yml")


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, Any]:
    return compose["services"]


def dockerfile() -> dict[str, list[str]]:
    """Instructions of the Dockerfile (continuation lines joined): {"ENV": [...], "ENTRYPOINT": [...], ...}."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.setdefault(word.upper(), []).append(rest.strip())
    return out


def exec_form(instruction: str) -> list[str]:
    value = json.loads(instruction)
    assert isinstance(value, list), f"use the exec (JSON) form: {instruction}"
    return value


def dockerfile_argv() -> list[str]:
    d = dockerfile()
    return exec_form(d["ENTRYPOINT"][-1]) + (exec_form(d["CMD"][-1]) if "CMD" in d else [])


def dockerfile_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for instruction in dockerfile().get("ENV", []):
        for item in shlex.split(instruction):
            key, sep, value = item.partition("=")
            assert sep, f"use ENV KEY=value: {instruction}"
            env[key] = value
    return env


def as_list(value: Any) -> list[str]:
    return shlex.split(value) if isinstance(value, str) else [str(v) for v in value]


def env_of(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def is_rose(service: dict[str, Any]) -> bool:
    return "build" in service or str(service.get("image", "")).startswith("rose")


def gpu_ids(service: dict[str, Any]) -> list[str]:
    """The GPUs a service reserves, by id (each device request must name its GPUs: `count` would hand every
    replica or service the same first GPU)."""
    devices = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    ids: list[str] = []
    for d in devices:
        assert d["driver"] == "nvidia" and "gpu" in d["capabilities"], d
        assert "count" not in d and d.get("device_ids"), f"pin GPUs by device_ids, not count: {d}"
        ids += [str(i) for i in d["device_ids"]]
    return ids


def service_argv(service: dict[str, Any]) -> list[str]:
    d = dockerfile()
    entry = as_list(service["entrypoint"]) if "entrypoint" in service else exec_form(d["ENTRYPOINT"][-1])
    if "command" in service:
        return entry + as_list(service["command"])
    return entry + (exec_form(d["CMD"][-1]) if "CMD" in d and "entrypoint" not in service else [])


def check_rose_env(env: dict[str, str]) -> None:
    fields = WorkerSettings.model_fields
    unknown = sorted(k for k in env if k.startswith("ROSE_") and k[5:].lower() not in fields)
    assert not unknown, f"ROSE_* variables that rose-worker does not know: {unknown}"


def check_argv(argv: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The command line parses with the real parser, and (for the worker) gives valid settings with `env`."""
    program, args = argv[0], argv[1:]
    parser = {"rose-worker": worker_parser, "rose": rose_parser}.get(program)
    assert parser is not None, f"unknown program {program!r} in {argv}"
    try:
        parser().parse_args(args)
    except SystemExit as exc:
        raise AssertionError(f"{program} rejects {args}") from exc
    if program == "rose-worker":
        with monkeypatch.context() as m:
            for key in [k for k in os.environ if k.startswith("ROSE_")]:
                m.delenv(key)
            for key, value in env.items():
                m.setenv(key, value)
            settings, _ = load_settings(args)  # raises on a bad value (pydantic ValidationError)
            assert settings.redis_url == env.get("ROSE_REDIS_URL", settings.redis_url)


# ---- compose ------------------------------------------------------------------------------------------------


def test_compose_has_the_documented_services(services: dict[str, Any]) -> None:
    assert {"redis", "worker", "dashboard", "prometheus"} <= set(services)
    assert services["dashboard"]["profiles"] == ["dashboard"]
    assert services["prometheus"]["profiles"] == ["monitoring"]
    assert not services["redis"].get("profiles") and not services["worker"].get("profiles")


def test_redis_is_persistent_and_health_checked(services: dict[str, Any]) -> None:
    redis = services["redis"]
    command = as_list(redis["command"])
    assert command[0] == "redis-server"
    assert command[command.index("--appendonly") + 1] == "yes"
    assert any(str(v).endswith(":/data") for v in redis["volumes"])
    assert as_list(redis["healthcheck"]["test"])[-2:] == ["redis-cli", "ping"]


def test_worker_service(services: dict[str, Any]) -> None:
    worker = services["worker"]
    assert "build" in worker
    # Scaling (`--scale worker=4`) needs a distinct name per replica: nothing may pin it.
    assert "container_name" not in worker
    assert "ROSE_NAME" not in env_of(worker)
    assert "--name" not in service_argv(worker)
    assert "ROSE_NAME" not in dockerfile_env()
    assert worker["depends_on"]["redis"]["condition"] == "service_healthy"
    assert worker["restart"] in ("always", "unless-stopped", "on-failure")
    assert gpu_ids(worker) == ["0"]
    assert any(str(v).endswith(":/models:ro") for v in worker["volumes"])
    assert env_of(worker)["ROSE_REDIS_URL"].startswith("redis://redis:6379")


def test_rose_services_command_lines_and_env_are_accepted(
    services: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    rose_services = {name: s for name, s in services.items() if is_rose(s)}
    assert "worker" in rose_services
    for service in rose_services.values():
        env = {**dockerfile_env(), **env_of(service)}
        check_rose_env(env)
        check_argv(service_argv(service), env, monkeypatch)


def test_unknown_rose_variable_is_caught() -> None:
    with pytest.raises(AssertionError, match="ROSE_NO_SUCH_SETTING"):
        check_rose_env({"ROSE_REDIS_URL": "redis://x", "ROSE_NO_SUCH_SETTING": "1"})


def test_prometheus_scrapes_the_workers_metrics_port(services: dict[str, Any]) -> None:
    prometheus = services["prometheus"]
    mounts = [str(v).split(":") for v in prometheus["volumes"]]
    config_path = next(src for src, dst, *_ in mounts if dst.endswith("prometheus.yml"))
    config = yaml.safe_load((ROOT / config_path).read_text())
    port = int(env_of(services["worker"])["ROSE_METRICS_PORT"])
    ports = [
        sd["port"]
        for job in config["scrape_configs"]
        for sd in job.get("dns_sd_configs", [])
        if "worker" in sd["names"]
    ]
    assert ports == [port]


def test_dashboard_points_at_the_compose_redis_and_reads_json_jobs(services: dict[str, Any]) -> None:
    env = env_of(services["dashboard"])
    assert env["RQ_DASHBOARD_REDIS_URL"].startswith("redis://redis:6379")
    # rose jobs are JSON-serialized: rq-dashboard's CLI (--json, env RQ_DASHBOARD_JSON) and its WSGI app factory
    # (RQ_DASHBOARD_JSON_SERIALIZER) must both be told, or job pages fail to unpickle them (HTTP 500)
    assert env["RQ_DASHBOARD_JSON"].lower() == "true"
    assert env["RQ_DASHBOARD_JSON_SERIALIZER"].lower() == "true"
    # its workers list ignores both (HTTP 500 while a worker is busy): the settings file that fixes it is mounted
    # where RQ_DASHBOARD_SETTINGS points (tests/worker/test_rq_dashboard.py checks what it does)
    mounts = [str(v).split(":") for v in services["dashboard"]["volumes"]]
    (src,) = [src for src, dst, *_ in mounts if dst == env["RQ_DASHBOARD_SETTINGS"]]
    assert (ROOT / src).resolve() == ROOT / "deploy" / "rq_dashboard_settings.py"


def test_each_gpu_worker_service_has_its_own_gpu(services: dict[str, Any]) -> None:
    """One service per GPU (`--profile gpuN`), each pinned by device_ids to a GPU no other service has; apart
    from that (and its profile) every GPU worker is the `worker` service."""
    workers = {name: s for name, s in services.items() if name == "worker" or name.startswith("worker-gpu")}
    assert len(workers) == 8
    ids = {name: gpu_ids(s) for name, s in workers.items()}
    assert all(len(v) == 1 for v in ids.values()), ids
    assert sorted(v[0] for v in ids.values()) == [str(i) for i in range(8)]
    strip = ("deploy", "profiles")
    base = {k: v for k, v in services["worker"].items() if k not in strip}
    for name, service in workers.items():
        if name != "worker":
            gpu = ids[name][0]
            assert name == f"worker-gpu{gpu}" and service["profiles"] == [f"gpu{gpu}"]
            assert {k: v for k, v in service.items() if k not in strip} == base


def test_cpu_override_drops_the_gpu_and_takes_cpu_torch(
    compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    override = load_compose(ROOT / "deploy" / "compose.cpu.yml")
    merged = merge_override(compose, override)
    worker = merged["services"]["worker"]
    assert "deploy" not in worker
    assert env_of(worker)["ROSE_DEVICE"] == "cpu"
    assert worker["build"]["args"]["TORCH_INDEX_URL"].endswith("/whl/cpu")
    assert worker["build"]["context"] == "."  # still the repository's Dockerfile
    env = {**dockerfile_env(), **env_of(worker)}
    check_rose_env(env)
    check_argv(service_argv(worker), env, monkeypatch)


# ---- Redis Sentinel example ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sentinel_services() -> dict[str, Any]:
    return load_compose(ROOT / "deploy" / "compose.sentinel.yml")["services"]


def written_config(service: dict[str, Any]) -> list[str]:
    """The lines a service's start script writes to its config file (`printf '%s\\n' 'line' "line" ...`)."""
    script = as_list(service["command"])[-1]
    return re.findall(r"""^\s*(?:\[ -f \S+ \] \|\| printf '%s\\n' )?['"]([^'"]+)['"]""", script, re.MULTILINE)


def test_sentinel_compose_runs_a_primary_a_replica_and_three_sentinels(
    sentinel_services: dict[str, Any],
) -> None:
    assert {"redis-1", "redis-2", "sentinel-1", "sentinel-2", "sentinel-3", "worker"} <= set(
        sentinel_services
    )
    primary, replica = (
        written_config(sentinel_services["redis-1"]),
        written_config(sentinel_services["redis-2"]),
    )
    assert "appendonly yes" in primary and "appendonly yes" in replica
    assert not any(line.startswith("replicaof") for line in primary)
    assert "replicaof redis-1 6379" in replica
    for name in ("sentinel-1", "sentinel-2", "sentinel-3"):
        sentinel = sentinel_services[name]
        config = written_config(sentinel)
        assert "sentinel monitor rose redis-1 6379 2" in config  # quorum 2 of 3
        assert {"sentinel resolve-hostnames yes", "sentinel announce-hostnames yes"} <= set(config)
        assert "sentinel announce-ip $$SENTINEL_NAME" in config and env_of(sentinel)["SENTINEL_NAME"] == name
        assert (
            as_list(sentinel["command"])[-1].rstrip().endswith("redis-server /data/sentinel.conf --sentinel")
        )
        # its own volume: Sentinel rewrites its config file (what it learned must survive a restart)
        assert any(str(v) == f"{name}-data:/data" for v in sentinel["volumes"])


def test_sentinel_compose_worker_follows_the_sentinels(
    sentinel_services: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = sentinel_services["worker"]
    env = {**dockerfile_env(), **env_of(worker)}
    check_rose_env(env)
    check_argv(service_argv(worker), env, monkeypatch)
    url = parse_sentinel_url(env["ROSE_REDIS_URL"])
    sentinels = sorted(name for name in sentinel_services if name.startswith("sentinel-"))
    assert sorted(host for host, _ in url.hosts) == sentinels
    assert {port for _, port in url.hosts} == {26379}
    monitored = {
        line.split()[2]
        for s in sentinels
        for line in written_config(sentinel_services[s])
        if " monitor " in line
    }
    assert monitored == {url.service_name}
    assert all(worker["depends_on"][s]["condition"] == "service_healthy" for s in sentinels)
    assert worker["build"]["context"] == ".."  # a standalone file in deploy/: the repository is one level up


def compose_binary() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if (
        shutil.which("docker")
        and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0
    ):
        return ["docker", "compose"]
    return None


@pytest.mark.skipif(compose_binary() is None, reason="Docker Compose is not installed")
@pytest.mark.parametrize(
    "files,profiles",
    [
        (["docker-compose.yml"], ["gpu1", "gpu7", "dashboard"]),
        (["docker-compose.yml", "deploy/compose.cpu.yml"], []),
        (["deploy/compose.sentinel.yml"], []),
    ],
)
def test_docker_compose_itself_accepts_the_files(files: list[str], profiles: list[str]) -> None:
    """Compose's own parser (no daemon needed): the anchors, merges and `!reset` mean what the tests above read."""
    argv = [
        *compose_binary(),
        *(a for f in files for a in ("-f", f)),
        *(a for p in profiles for a in ("--profile", p)),
    ]
    out = subprocess.run([*argv, "config", "--format", "json"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    services = json.loads(out.stdout)["services"]
    if "deploy/compose.sentinel.yml" in files:
        assert {"redis-1", "redis-2", "sentinel-1", "sentinel-2", "sentinel-3", "worker"} <= set(services)
        assert services["worker"]["environment"]["ROSE_REDIS_URL"].startswith("redis+sentinel://")
    elif "deploy/compose.cpu.yml" in files:
        assert (
            "deploy" not in services["worker"] and services["worker"]["environment"]["ROSE_DEVICE"] == "cpu"
        )
    else:
        assert {"worker", "worker-gpu1", "worker-gpu7", "dashboard"} <= set(services)
        assert gpu_ids(services["worker-gpu7"]) == ["7"]


# ---- Dockerfile ---------------------------------------------------------------------------------------------


def test_dockerfile_entrypoint_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    argv = dockerfile_argv()
    assert argv[0] == "rose-worker"
    env = dockerfile_env()
    check_rose_env(env)
    check_argv(argv, env, monkeypatch)


def test_dockerfile_runs_unprivileged_and_picks_its_torch_base() -> None:
    d = dockerfile()
    assert d["USER"] and d["USER"][-1] not in ("root", "0")
    assert any(arg.startswith("BASE_IMAGE") for arg in d["ARG"])
    assert d["FROM"][0] == "${BASE_IMAGE}"
    # the worker's image installs the engine: `pip install .` alone is a producer's install (no torch, no worker)
    assert any('pip install ".[engine]"' in run for run in d["RUN"]), d["RUN"]


def test_dockerfile_pins_the_readme_torch() -> None:
    readme = re.findall(r"pip install (torch==[0-9][^\s`]*)", (ROOT / "README.md").read_text())
    assert readme, "the README names no torch version"
    specs = [arg.partition("=")[2] for arg in dockerfile()["ARG"] if arg.startswith("TORCH_SPEC=")]
    assert specs and set(readme) == {specs[-1]}, (specs, readme)


def test_dockerignore_keeps_the_build_context_small() -> None:
    lines = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()]
    assert "**" in lines
    assert {"!pyproject.toml", "!README.md", "!rose/"} <= set(lines)
