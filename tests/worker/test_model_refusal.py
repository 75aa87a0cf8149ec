"""rose-worker refuses, before taking any job, a model that rose cannot serve exactly: exit 2, the reason, no
traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest
from transformers import AutoConfig


@pytest.mark.timeout(180)
def test_the_worker_exits_with_the_reason_and_no_traceback(redis_server, tmp_path):
    # a falcon architecture with random weights (`--model` takes a config.json): its attention bypasses
    # transformers' AttentionInterface
    config = AutoConfig.for_model(
        "falcon", hidden_size=32, num_attention_heads=4, num_hidden_layers=1, vocab_size=64
    )
    path = tmp_path / "falcon" / "config.json"
    path.parent.mkdir()
    config.to_json_file(path)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rose.worker.cli",
            "--redis-url",
            redis_server.url,
            "--model",
            str(path),
            "--device",
            "cpu",
            "--name",
            "refusal-test",
        ],
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode == 2, proc.stderr
    assert "falcon: its attention does not use transformers' AttentionInterface" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
