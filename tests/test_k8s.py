"""The Kubernetes recipe (deploy/k8s/) agrees with the code and with itself: the worker's command line and ROSE_*
variables parse with rose-worker's own parser, the probes hit the endpoints rose serves (and those answer as the
probes assume), the grace period outlasts the drain, and the KEDA triggers read the list rose's queues use, on the
Redis and with the credentials the worker uses. No kubectl or cluster needed."""

from __future__ import annotations

import json
import os
import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import fakeredis
import pytest
import redis
import yaml
from rq import Queue
from test_deploy import check_argv, check_rose_env, dockerfile, dockerfile_argv, dockerfile_env

from rose.config import WorkerSettings
from rose.worker.cli import load_settings
from rose.worker.metrics import HealthServer, WorkerMetrics, health

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
PLAIN = K8S / "keda-scaledobject.yaml"
SENTINEL = K8S / "keda-scaledobject-sentinel.yaml"

# What the Secret `rose-redis` holds in these tests (README: a hex password, URL-safe) and a pod's name.
SECRET_NAME = "rose-redis"
SECRET = {"username": "rose-worker", "password": "0123456789abcdef" * 4}
POD_NAME = "rose-worker-7d9f8c6b5-x2x4q"

# After the drain, the worker's exit path (RoseWorker._shutdown): the token publisher's final flush,
# `publisher.close(timeout=10)`; requeueing the unfinished jobs, retried 5 times with 0.5 + 1 + 2 + 4 + 8 s of
# backoff while Redis fails; then unregistering and closing the engine (a few seconds).
EXIT_PATH_S = 10 + 15.5 + 4.5


def load_all(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


@pytest.fixture(scope="module")
def worker_docs() -> list[dict[str, Any]]:
    return load_all(K8S / "worker.yaml")


@pytest.fixture(scope="module")
def deployment(worker_docs: list[dict[str, Any]]) -> dict[str, Any]:
    return one(worker_docs, "Deployment")


@pytest.fixture(scope="module")
def container(deployment: dict[str, Any]) -> dict[str, Any]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


@pytest.fixture(scope="module", params=[PLAIN, SENTINEL], ids=["redis", "sentinel"])
def keda(request: pytest.FixtureRequest) -> tuple[dict[str, Any], dict[str, Any]]:
    """(ScaledObject, TriggerAuthentication) of one variant."""
    docs = load_all(request.param)
    return one(docs, "ScaledObject"), one(docs, "TriggerAuthentication")


_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' dependent variables: `$(NAME)` is the value of a variable defined earlier in the list (else
    left as is), `$$` a literal `$`."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _VAR.sub(sub, value)


def resolve_env(entries: list[dict[str, Any]]) -> dict[str, str]:
    """A container's environment as the kubelet builds it, with the test's Secret and pod name."""
    env: dict[str, str] = {}
    for entry in entries:
        name = entry["name"]
        if "value" in entry:
            env[name] = expand(str(entry["value"]), env)
            continue
        source = entry["valueFrom"]
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            assert ref["name"] == SECRET_NAME, ref
            env[name] = SECRET[ref["key"]]
        elif source.get("fieldRef", {}).get("fieldPath") == "metadata.name":
            env[name] = POD_NAME
        else:
            raise AssertionError(f"{name}: unexpected valueFrom {source}")
    return env


def container_argv(container: dict[str, Any]) -> list[str]:
    """The process the container runs: its `command` (else the image's ENTRYPOINT) and `args` (else CMD)."""
    if "command" in container:
        return [*container["command"], *container.get("args", [])]
    entrypoint = dockerfile_argv()[:1]
    return [*entrypoint, *(container["args"] if "args" in container else dockerfile_argv()[1:])]


def container_env(container: dict[str, Any]) -> dict[str, str]:
    return {**dockerfile_env(), **resolve_env(container.get("env", []))}


@contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ROSE_")}
    with mock.patch.dict(os.environ, {**clean, **env}, clear=True):
        yield


@pytest.fixture(scope="module")
def settings(container: dict[str, Any]) -> WorkerSettings:
    """What rose-worker makes of the container's command line and environment."""
    with environment(container_env(container)):
        return load_settings(container_argv(container)[1:])[0]


def secret_refs(entries: list[dict[str, Any]]) -> dict[str, tuple[str, str]]:
    return {
        e["name"]: (e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
        for e in entries
        if "secretKeyRef" in e.get("valueFrom", {})
    }


def trigger_auth_values(auth: dict[str, Any]) -> dict[str, str]:
    """The parameters KEDA reads from the Secret, resolved with the test's Secret."""
    out = {}
    for ref in auth["spec"]["secretTargetRef"]:
        assert ref["name"] == SECRET_NAME, ref
        out[ref["parameter"]] = SECRET[ref["key"]]
    return out


def redis_trigger(scaled: dict[str, Any]) -> dict[str, Any]:
    triggers = [t for t in scaled["spec"]["triggers"] if t["type"] in ("redis", "redis-sentinel")]
    assert len(triggers) == 1, triggers
    return triggers[0]


# ---- the worker ---------------------------------------------------------------------------------------------


def test_manifests_parse(worker_docs: list[dict[str, Any]]) -> None:
    files = sorted(K8S.glob("*.yaml"))
    assert {f.name for f in files} >= {"worker.yaml", PLAIN.name, SENTINEL.name}
    for f in files:
        for d in load_all(f):
            assert d["apiVersion"] and d["kind"] and d["metadata"]["name"], f
    assert {d["kind"] for d in worker_docs} == {"Deployment", "PodDisruptionBudget"}


def test_worker_command_line_and_env_are_accepted(
    container: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = container_argv(container)
    assert argv[0] == "rose-worker"
    env = container_env(container)
    check_rose_env(env)
    check_argv(argv, env, monkeypatch)


def test_the_redis_url_is_built_from_the_secret(container: dict[str, Any], settings: WorkerSettings) -> None:
    """No password in the manifest: the URL's credentials are the Secret's (the variables it names are defined
    before it, or Kubernetes would leave `$(...)` in the URL)."""
    entries = container["env"]
    url_entry = next(e for e in entries if e["name"] == "ROSE_REDIS_URL")
    assert SECRET["password"] not in yaml.safe_dump(entries)
    assert "$(" not in settings.redis_url
    parts = redis.connection.parse_url(settings.redis_url)
    assert (parts["username"], parts["password"]) == (SECRET["username"], SECRET["password"])
    refs = secret_refs(entries)
    used = set(re.findall(r"\$\((\w+)\)", url_entry["value"]))
    assert used and used <= set(refs), (used, refs)


def test_each_pod_is_a_worker_of_its_own_name(container: dict[str, Any], settings: WorkerSettings) -> None:
    """Replicas must not share a worker name (a live name is refused): ROSE_NAME, if set, is the pod's."""
    assert "--name" not in container_argv(container)
    name = next((e for e in container["env"] if e["name"] == "ROSE_NAME"), None)
    if name is not None:
        assert name["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        assert settings.name == POD_NAME


def test_one_gpu_per_pod(
    deployment: dict[str, Any], container: dict[str, Any], settings: WorkerSettings
) -> None:
    resources = container["resources"]
    assert int(resources["limits"]["nvidia.com/gpu"]) == 1
    assert int(resources.get("requests", {}).get("nvidia.com/gpu", 1)) == 1
    assert settings.device.startswith("cuda")
    # a rollout that surges needs a free GPU for the extra pod
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0


def test_keda_owns_the_replica_count(deployment: dict[str, Any]) -> None:
    assert "replicas" not in deployment["spec"]


def test_selectors_match_the_pods(worker_docs: list[dict[str, Any]], deployment: dict[str, Any]) -> None:
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    pdb = one(worker_docs, "PodDisruptionBudget")
    for selector in (deployment["spec"]["selector"], pdb["spec"]["selector"]):
        assert selector["matchLabels"].items() <= labels.items()


def test_runs_as_the_images_user(deployment: dict[str, Any]) -> None:
    uid = re.search(r"useradd .*--uid (\d+)", " ".join(dockerfile()["RUN"]))
    assert uid
    pod_security = deployment["spec"]["template"]["spec"]["securityContext"]
    assert pod_security["runAsNonRoot"] is True and pod_security["runAsUser"] == int(uid.group(1))


def test_the_model_is_on_a_read_only_volume(
    deployment: dict[str, Any], container: dict[str, Any], settings: WorkerSettings
) -> None:
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    mounts = [
        m for m in container["volumeMounts"] if settings.model.startswith(m["mountPath"].rstrip("/") + "/")
    ]
    assert len(mounts) == 1 and mounts[0]["readOnly"] is True
    assert volumes[mounts[0]["name"]]["persistentVolumeClaim"]["readOnly"] is True
    assert dockerfile_env().get("HF_HUB_OFFLINE") == "1"


# ---- probes, metrics and the drain ------------------------------------------------------------------------------


def probe_port(container: dict[str, Any], probe: dict[str, Any]) -> int:
    port = probe["httpGet"]["port"]
    if isinstance(port, str):
        return next(p["containerPort"] for p in container["ports"] if p.get("name") == port)
    return int(port)


def test_probes_and_scrape_target_are_the_metrics_port(
    deployment: dict[str, Any], container: dict[str, Any], settings: WorkerSettings
) -> None:
    assert settings.metrics_port is not None
    assert settings.metrics_host in ("0.0.0.0", "::")  # the kubelet probes the pod's IP, not loopback
    assert any(p["containerPort"] == settings.metrics_port and p.get("name") for p in container["ports"])
    paths = {}
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = container[kind]
        assert probe_port(container, probe) == settings.metrics_port, kind
        paths[kind] = probe["httpGet"]["path"]
    assert paths == {
        "startupProbe": "/health/live",
        "readinessProbe": "/health",
        "livenessProbe": "/health/live",
    }
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == settings.metrics_port
    assert annotations["prometheus.io/path"] == "/metrics"


def test_the_startup_probe_waits_for_the_model(container: dict[str, Any]) -> None:
    """The server answers only once the model is loaded (minutes for a large one)."""
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600


def test_the_probes_answer_as_the_manifest_assumes(container: dict[str, Any]) -> None:
    """rose's /health server with the worker in each state: a Redis outage makes the pod unready but never fails
    liveness; a stuck loop fails both; a draining worker passes both."""
    settings = WorkerSettings(health_timeout=60)
    worker = SimpleNamespace(
        name="w",
        settings=settings,
        loop_beat=time.monotonic(),
        stopped=False,
        redis_ok=True,
        running={},
        draining=False,
    )
    metrics = WorkerMetrics(
        name="w", model="m", device="cuda", dtype="bfloat16", queues=["rose"], version="0"
    )
    server = HealthServer(metrics.registry, lambda: health(worker), "127.0.0.1", 0).start()

    def status(kind: str) -> int:
        url = f"http://127.0.0.1:{server.port}{container[kind]['httpGet']['path']}"
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                json.loads(resp.read())
                return resp.status
        except urllib.error.HTTPError as exc:
            json.loads(exc.read())
            return exc.code

    def statuses() -> tuple[int, int, int]:
        return status("startupProbe"), status("readinessProbe"), status("livenessProbe")

    try:
        assert statuses() == (200, 200, 200)
        worker.redis_ok = False  # Redis unreachable, loop turning
        assert statuses() == (200, 503, 200)
        worker.redis_ok, worker.loop_beat = True, time.monotonic() - 61  # loop stuck
        assert statuses() == (503, 503, 503)
        worker.loop_beat, worker.draining, worker.running = time.monotonic(), True, {"job": object()}
        assert statuses() == (200, 200, 200)
    finally:
        server.close()


def test_the_grace_period_outlasts_the_drain(deployment: dict[str, Any], settings: WorkerSettings) -> None:
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= settings.drain_timeout + EXIT_PATH_S, (grace, settings.drain_timeout)
    assert dockerfile().get("STOPSIGNAL", ["SIGTERM"])[-1] == "SIGTERM"  # the signal that drains


# ---- KEDA -------------------------------------------------------------------------------------------------------


def test_scaled_object_targets_the_deployment(
    keda: tuple[dict[str, Any], dict[str, Any]], deployment: dict[str, Any]
) -> None:
    scaled, _ = keda
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    target = scaled["spec"]["scaleTargetRef"]
    assert target["name"] == deployment["metadata"]["name"]
    assert target.get("kind", "Deployment") == "Deployment"
    assert target.get("apiVersion", "apps/v1") == deployment["apiVersion"]
    spec = scaled["spec"]
    assert spec["minReplicaCount"] == 0 and spec["maxReplicaCount"] >= 1


def test_triggers_read_the_workers_queues(
    keda: tuple[dict[str, Any], dict[str, Any]], settings: WorkerSettings
) -> None:
    """One trigger per queue the worker serves, on RQ's list of that queue (not its started registry)."""
    scaled, _ = keda
    conn = fakeredis.FakeRedis()
    lists = [t["metadata"]["listName"] for t in scaled["spec"]["triggers"] if "listName" in t["metadata"]]
    assert sorted(lists) == sorted(Queue(q, connection=conn).key for q in settings.queues)


def test_trigger_metadata_are_strings(keda: tuple[dict[str, Any], dict[str, Any]]) -> None:
    """KEDA's trigger metadata is a map of strings: a bare number in YAML is rejected by its CRD."""
    scaled, _ = keda
    for trigger in scaled["spec"]["triggers"]:
        metadata = trigger["metadata"]
        assert all(isinstance(v, str) for v in metadata.values()), metadata
        if "listName" in metadata:
            assert int(metadata["listLength"]) >= 1 and int(metadata["activationListLength"]) >= 0


def test_scale_down_behaviour_is_valid(keda: tuple[dict[str, Any], dict[str, Any]]) -> None:
    """Within the HPA API's limits (window <= 1 h, policy period 1 s to 30 min), and slower than the default."""
    scaled, _ = keda
    down = scaled["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
    assert 300 <= down["stabilizationWindowSeconds"] <= 3600
    for policy in down["policies"]:
        assert policy["type"] in ("Pods", "Percent") and policy["value"] > 0
        assert 0 < policy["periodSeconds"] <= 1800
    assert scaled["spec"]["cooldownPeriod"] >= 300


def test_trigger_authentication_uses_the_workers_secret(
    keda: tuple[dict[str, Any], dict[str, Any]], container: dict[str, Any]
) -> None:
    scaled, auth = keda
    trigger = redis_trigger(scaled)
    assert trigger["authenticationRef"]["name"] == auth["metadata"]["name"]
    assert trigger["authenticationRef"].get("kind", "TriggerAuthentication") == "TriggerAuthentication"
    worker_refs = set(secret_refs(container["env"]).values())
    keda_refs = {(r["name"], r["key"]) for r in auth["spec"]["secretTargetRef"]}
    assert keda_refs <= worker_refs, (keda_refs, worker_refs)


def test_redis_trigger_reads_the_workers_redis(settings: WorkerSettings) -> None:
    scaled, auth = (one(load_all(PLAIN), kind) for kind in ("ScaledObject", "TriggerAuthentication"))
    metadata = redis_trigger(scaled)["metadata"]
    url = redis.connection.parse_url(settings.redis_url)
    assert metadata["address"] == f"{url['host']}:{url['port']}"
    assert int(metadata["databaseIndex"]) == url.get("db", 0)
    # the KEDA operator resolves the address from its own namespace: a bare Service name would not do
    assert ".svc" in url["host"]
    creds = trigger_auth_values(auth)
    assert (creds["username"], creds["password"]) == (url["username"], url["password"])


def sentinel_url_example(container: dict[str, Any]) -> str:
    """The ROSE_REDIS_URL the Sentinel file gives for worker.yaml, expanded with the worker's variables."""
    found = re.findall(r"value:\s*(redis\+sentinel://\S+)", SENTINEL.read_text())
    assert len(found) == 1, found
    entries = [
        {"name": e["name"], "value": found[0]} if e["name"] == "ROSE_REDIS_URL" else e
        for e in container["env"]
    ]
    return resolve_env(entries)["ROSE_REDIS_URL"]


def test_sentinel_trigger_reads_the_workers_sentinels(container: dict[str, Any]) -> None:
    from rose.jobs.connection import parse_sentinel_url

    url = sentinel_url_example(container)
    parsed = parse_sentinel_url(url)  # rose's own parser: the URL the worker would be given
    scaled, auth = (one(load_all(SENTINEL), kind) for kind in ("ScaledObject", "TriggerAuthentication"))
    trigger = redis_trigger(scaled)
    assert trigger["type"] == "redis-sentinel"
    metadata = trigger["metadata"]
    assert metadata["sentinelMaster"] == parsed.service_name
    assert [a.strip() for a in metadata["addresses"].split(",")] == [f"{h}:{p}" for h, p in parsed.hosts]
    assert int(metadata["databaseIndex"]) == parsed.db
    creds = trigger_auth_values(auth)
    assert (
        (creds["username"], creds["password"]) == (parsed.username, parsed.password) == tuple(SECRET.values())
    )
    assert creds.get("sentinelPassword") == parsed.sentinel_password == SECRET["password"]


def test_the_two_variants_differ_only_in_their_trigger() -> None:
    """Same ScaledObject name (applying one replaces the other) and the same scaling settings."""
    plain, sentinel = (one(load_all(f), "ScaledObject") for f in (PLAIN, SENTINEL))
    assert plain["metadata"] == sentinel["metadata"]
    strip = ("triggers",)
    assert {k: v for k, v in plain["spec"].items() if k not in strip} == {
        k: v for k, v in sentinel["spec"].items() if k not in strip
    }
    keep = ("listName", "listLength", "activationListLength", "databaseIndex")
    a, b = redis_trigger(plain)["metadata"], redis_trigger(sentinel)["metadata"]
    assert {k: a.get(k) for k in keep} == {k: b.get(k) for k in keep}


def commented_trigger(path: Path, trigger_type: str) -> dict[str, Any]:
    """A trigger left commented out in the file, uncommented."""
    lines = path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == f"# - type: {trigger_type}")
    prefix = lines[start][: lines[start].index("#")] + "# "
    block = []
    for line in lines[start:]:
        if not line.startswith(prefix):
            break
        block.append(line[len(prefix) :])
    return yaml.safe_load("\n".join(block))[0]


def test_optional_prometheus_trigger_queries_rose_gauges() -> None:
    trigger = commented_trigger(PLAIN, "prometheus")
    metadata = trigger["metadata"]
    assert all(isinstance(v, str) for v in metadata.values())
    assert {"serverAddress", "query", "threshold"} <= set(metadata)
    metrics = WorkerMetrics(
        name="w", model="m", device="cuda", dtype="bfloat16", queues=["rose"], version="0"
    )
    types = {family.name: family.type for family in metrics.registry.collect()}
    used = set(re.findall(r"\brose_\w+", metadata["query"]))
    assert used == {"rose_num_requests_running", "rose_num_requests_waiting"}
    assert all(types.get(name) == "gauge" for name in used), types


# ---- docs -------------------------------------------------------------------------------------------------------


def test_readme_creates_the_secret_the_manifests_read(container: dict[str, Any]) -> None:
    readme = (K8S / "README.md").read_text()
    command = re.search(r"create secret generic (\S+)((?:\s+\\?\s*--from-literal=\S+)+)", readme)
    assert command, "README.md: no `kubectl create secret generic` command"
    keys = set(re.findall(r"--from-literal=([\w.-]+)=", command.group(2)))
    assert command.group(1) == SECRET_NAME
    assert keys == {key for _, key in secret_refs(container["env"]).values()}
    assert "deploy/k8s/README.md" in (ROOT / "docs" / "deploy.md").read_text()
