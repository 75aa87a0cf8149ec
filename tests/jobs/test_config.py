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
        "--name",
        "--drain-timeout",
        "--log-level",
    ):
        assert flag in text
    assert "ROSE_REDIS_URL" in text


def test_redact_url():
    assert redact_url("redis://u:secret@h:1/0") == "redis://u:***@h:1/0"
    assert redact_url("redis://h:1/0") == "redis://h:1/0"
