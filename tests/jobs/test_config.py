import json
import subprocess
import sys

import pytest
from pydantic import ValidationError

from rose.config import WorkerSettings, redact_url
from rose.worker.cli import build_parser, load_settings


def test_env_vars(monkeypatch):
    monkeypatch.setenv("ROSE_REDIS_URL", "rediss://user:pw@host:6380/2")
    monkeypatch.setenv("ROSE_QUEUES", "high, low")
    monkeypatch.setenv("ROSE_MAX_NUM_SEQS", "8")
    monkeypatch.setenv("ROSE_LOG_LEVEL", "debug")
    s = WorkerSettings()
    assert s.redis_url == "rediss://user:pw@host:6380/2"
    assert s.queues == ["high", "low"]
    assert s.max_num_seqs == 8
    assert s.log_level == "DEBUG"


def test_flags_override_env(monkeypatch):
    monkeypatch.setenv("ROSE_QUEUES", "a")
    monkeypatch.setenv("ROSE_DRAIN_TIMEOUT", "5")
    s, args = load_settings(["--queue", "x", "--queue", "y", "--max-model-len", "256", "--name", "w1"])
    assert s.queues == ["x", "y"]
    assert s.max_model_len == 256
    assert s.name == "w1"
    assert s.drain_timeout == 5
    assert args.burst is False


def test_defaults():
    s = WorkerSettings()
    assert s.queues == ["rose"]
    assert s.heartbeat_timeout == 60
    assert s.max_requeues == 3
    assert s.max_num_seqs == 256  # a batch cap: the engine's free KV blocks decide how many jobs run
    assert s.max_kv_cache_bytes is None and s.block_size is None  # the engine's defaults


def test_kv_store_size_and_block_size(monkeypatch):
    monkeypatch.setenv("ROSE_MAX_KV_CACHE_BYTES", "1GB")
    assert WorkerSettings().max_kv_cache_bytes == 10**9
    s, _ = load_settings(["--max-kv-cache-bytes", "8MiB", "--block-size", "32"])
    assert s.max_kv_cache_bytes == 8 * 2**20 and s.block_size == 32
    with pytest.raises(ValidationError):
        WorkerSettings(max_kv_cache_bytes="lots")
    with pytest.raises(ValidationError):
        WorkerSettings(block_size=0)


def test_lora_flags_and_env(monkeypatch):
    # --lora-modules: space-separated and repeated, as vLLM's
    lora = ["--enable-lora", "--lora-modules", "sql=/a/sql", "chat=/a/c=1", "--lora-modules", "x=~/x"]
    s, _ = load_settings([*lora, "--max-loras", "2", "--max-lora-rank", "8", "--queue", "q"])
    assert s.enable_lora and s.lora_modules == {"sql": "/a/sql", "chat": "/a/c=1", "x": "~/x"}
    assert list(s.lora_modules) == ["sql", "chat", "x"] and s.queues == ["q"]  # the order: ids 1, 2, 3
    config = s.engine_config()
    assert (config.enable_lora, config.max_loras, config.max_lora_rank) == (True, 2, 8)
    import os

    from rose.worker.adapters import lora_requests

    assert [(r.lora_name, r.lora_int_id, r.lora_path) for r in lora_requests(s).values()] == [
        ("sql", 1, "/a/sql"),
        ("chat", 2, "/a/c=1"),
        ("x", 3, os.path.expanduser("~/x")),
    ]
    defaults = WorkerSettings()
    assert not defaults.enable_lora and defaults.lora_modules == {}
    assert (defaults.max_loras, defaults.max_lora_rank) == (1, 16)  # vLLM's defaults
    monkeypatch.setenv("ROSE_ENABLE_LORA", "1")
    monkeypatch.setenv("ROSE_LORA_MODULES", "a=/p/a, b=/p/b c=/p/c")
    monkeypatch.setenv("ROSE_MAX_LORAS", "3")
    s = WorkerSettings()
    assert s.lora_modules == {"a": "/p/a", "b": "/p/b", "c": "/p/c"} and s.max_loras == 3


def test_lora_modules_take_vllms_json_form_too(monkeypatch):
    # vLLM's --lora-modules items: NAME=PATH or a JSON object; base_model_name is accepted and ignored
    sql = {"name": "sql", "path": "/a/sql", "base_model_name": "tiny-llama"}
    items = [json.dumps(sql), "chat=/a/c", '{"name": "x", "path": "/a/x,y=1"}']
    array = '["j=/a/j", {"name": "k", "path": "/a/k", "base_model_name": null}]'  # vLLM's "JSON list format"
    s, _ = load_settings(["--enable-lora", "--lora-modules", *items, "--lora-modules", array])
    assert list(s.lora_modules.items()) == [
        ("sql", "/a/sql"),
        ("chat", "/a/c"),
        ("x", "/a/x,y=1"),
        ("j", "/a/j"),
        ("k", "/a/k"),
    ]
    assert WorkerSettings(enable_lora=True, lora_modules=[sql, "b=/b"]).lora_modules == {
        "sql": "/a/sql",
        "b": "/b",
    }
    # the environment: JSON objects among the space- or comma-separated items (their own commas kept), or an array
    monkeypatch.setenv("ROSE_ENABLE_LORA", "1")
    monkeypatch.setenv(
        "ROSE_LORA_MODULES", 'a=/p/a, {"name": "b", "path": "/p/b c,d"},c=/p/c {"name": "e", "path": "/e"}'
    )
    assert list(WorkerSettings().lora_modules.items()) == [
        ("a", "/p/a"),
        ("b", "/p/b c,d"),
        ("c", "/p/c"),
        ("e", "/e"),
    ]
    monkeypatch.setenv("ROSE_LORA_MODULES", ' [{"name": "b", "path": "/p/b"}, "a=/p/a"]')
    assert list(WorkerSettings().lora_modules.items()) == [("b", "/p/b"), ("a", "/p/a")]
    for bad, message in [
        ('a=/p {"name": "b", "path": }', "not JSON"),
        ('[{"name": "b"', "not a JSON array"),
        ('["a=/p", {"name": "b"}]', "'path' must be a non-empty string"),
    ]:
        monkeypatch.setenv("ROSE_LORA_MODULES", bad)
        with pytest.raises(ValidationError, match=message):
            WorkerSettings()


def test_a_bad_lora_module_stops_the_worker_naming_it():
    item = '{"name": "sql", "paht": "/a/sql"}'
    proc = subprocess.run(
        [sys.executable, "-m", "rose.worker.cli", "--enable-lora", "--lora-modules", "ok=/a/ok", item],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("rose-worker: invalid settings: lora_modules: ")
    assert f"got {item!r}: unknown field 'paht' (vLLM's fields: name, path, base_model_name)" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"enable_lora": True, "lora_modules": ["sql"]}, "want NAME=PATH"),
        ({"enable_lora": True, "lora_modules": ["=/p"]}, "want NAME=PATH"),
        ({"enable_lora": True, "lora_modules": ["a=/p", "a=/q"]}, "adapter name 'a' is given twice"),
        (
            {"enable_lora": True, "lora_modules": ['{"name": "a", "path": "/p"}', "a=/q"]},
            "'a' is given twice",
        ),
        ({"enable_lora": True, "lora_modules": ['{"name": "sql"}']}, "'path' must be a non-empty string"),
        ({"enable_lora": True, "lora_modules": [{"name": " ", "path": "/p"}]}, "'name' must be a non-empty"),
        ({"enable_lora": True, "lora_modules": ['{"name": "a", "path": "/p", "r": 8}']}, "unknown field 'r'"),
        (
            {"enable_lora": True, "lora_modules": ['{"name": "a", path: "/p"}']},
            "want NAME=PATH or a JSON .*not JSON",
        ),
        (
            {"enable_lora": True, "lora_modules": [{"name": "a", "path": "/p", "base_model_name": 1}]},
            "'base_model_name' must be a string",
        ),
        ({"lora_modules": ["a=/p"]}, "lora_modules needs enable_lora: start rose-worker with --enable-lora"),
        ({"enable_lora": True, "max_loras": 0}, "max_loras"),
        ({"enable_lora": True, "max_lora_rank": 0}, "max_lora_rank"),
    ],
)
def test_invalid_lora_settings(kwargs, message):
    with pytest.raises(ValidationError, match=message):
        WorkerSettings(**kwargs)


def test_the_worker_builds_its_engine_with_the_store_settings():
    from rose.worker.cli import build_engine

    s = WorkerSettings(
        model="tiny-llama", device="cpu", max_kv_cache_bytes="8MiB", block_size=32, max_model_len=256
    )
    engine = build_engine(s)
    try:
        assert engine.block_size == 32 and engine.max_model_len == 256
        assert engine.cache.nbytes <= 8 * 2**20 and engine.kv_blocks_total == 8 * 2**20 // (32 * 4096)
    finally:
        engine.close()


def test_the_engine_options_are_one_config_shared_by_settings_engine_and_llm():
    from rose import LLM, Engine, EngineConfig
    from rose.engine.config import DEFAULTS

    defaults = WorkerSettings().engine_config()
    assert defaults == DEFAULTS  # one set of defaults: the settings read them from EngineConfig
    s = WorkerSettings(max_num_seqs=3, max_json_whitespace=0, grammar_compile_timeout=0)
    assert s.engine_config().max_num_seqs == 3
    # 0 is "no limit" in the settings (an environment variable cannot say None)
    assert s.engine_config().max_json_whitespace is None and s.engine_config().grammar_compile_timeout is None
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        EngineConfig(max_num_seqs=0)
    with pytest.raises(TypeError, match="max_num_sequences"):
        EngineConfig(max_num_sequences=4)
    config = EngineConfig(device="cpu", max_num_seqs=2, max_model_len=64)
    engine = Engine("tiny-gpt2", config=config, max_model_len=32)  # keyword arguments override the config
    try:
        assert engine.config == EngineConfig(device="cpu", max_num_seqs=2, max_model_len=32)
        assert engine.max_model_len == 32 and engine.max_num_seqs == 2
    finally:
        engine.close()
    assert LLM("tiny-gpt2", device="cpu", max_model_len=48).engine.config.max_model_len == 48


@pytest.mark.parametrize(
    "kwargs",
    [
        {"redis_url": "http://x"},
        {"max_num_seqs": 0},
        {"queues": []},
        {"log_level": "LOUD"},
        {"drain_timeout": -1},
    ],
)
def test_invalid(kwargs):
    with pytest.raises(ValidationError):
        WorkerSettings(**kwargs)


def test_help_mentions_every_flag():
    text = build_parser().format_help()
    for flag in (
        "--redis-url",
        "--queue",
        "--model",
        "--tokenizer",
        "--device",
        "--dtype",
        "--max-num-seqs",
        "--max-model-len",
        "--max-kv-cache-bytes",
        "--block-size",
        "--name",
        "--drain-timeout",
        "--log-level",
        "--enable-lora",
        "--lora-modules",
        "--max-loras",
        "--max-lora-rank",
    ):
        assert flag in text
    assert "ROSE_REDIS_URL" in text


def test_redact_url():
    assert redact_url("redis://u:secret@h:1/0") == "redis://u:***@h:1/0"
    assert redact_url("redis://h:1/0") == "redis://h:1/0"


def test_intake_policy_and_tenant_weights(monkeypatch):
    s, _ = load_settings(
        ["--tenant-weight", "a=2", "b=0.5", "--tenant-weight", "c=1", "--intake-policy", "fcfs"]
    )
    assert s.tenant_weights == {"a": 2.0, "b": 0.5, "c": 1.0} and s.intake_policy == "fcfs"
    assert WorkerSettings().intake_policy == "fair" and WorkerSettings().tenant_weights == {}
    monkeypatch.setenv("ROSE_TENANT_WEIGHTS", "team-a=3, team-b=1")
    assert WorkerSettings().tenant_weights == {"team-a": 3.0, "team-b": 1.0}
    for bad in ("a", "a=0", "a=-1", "=2", "a=x", "a=inf"):
        with pytest.raises(ValueError, match=f"tenant weight '{bad}': want NAME=W"):
            WorkerSettings(tenant_weights=[bad])
