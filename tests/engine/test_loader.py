"""rose.engine.loader: a preset, a config (random weights), a checkpoint directory or a hub id (the local Hugging
Face cache, then the hub), resolved the same way by the LLM API, the worker (`--model`) and `rose bench`. No test
reaches the network: the hub is an in-memory fake (hub_helpers.FakeHub) or a local port nothing listens on."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hub_helpers import (
    COMMIT,
    FakeHub,
    closed_port_url,
    put_in_cache,
    read_folder,
    real_http_client,
    repo_folder,
)
from huggingface_hub import constants as hf_constants

import rose
from rose import LLM, SamplingParams
from rose.engine import loader, presets


def same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture
def qwen_config(tmp_path):
    path = tmp_path / "cfg" / "config.json"
    path.parent.mkdir()
    presets.preset_config("tiny-qwen2").to_json_file(path)
    return path


def test_a_config_builds_random_weights_from_seed_0(qwen_config):
    preset, _ = presets.build_preset("tiny-qwen2")
    for source in (qwen_config, str(qwen_config)):
        assert loader.random_weights_config(source) == qwen_config
        model, tokenizer = loader.build_model(source)
        assert type(model).__name__ == "Qwen2ForCausalLM" and same_weights(model, preset)
        assert len(tokenizer) == len(presets.build_tokenizer())  # the in-memory one: the config has none
    other, _ = loader.build_model(qwen_config, seed=1)
    assert not same_weights(other, preset)
    assert loader.model_config(qwen_config).num_hidden_layers == preset.config.num_hidden_layers


def test_random_weights_are_drawn_in_float32_whatever_the_config_says(qwen_config):
    config = loader.model_config(qwen_config)
    config.dtype = torch.bfloat16  # as real checkpoints' configs say
    config.to_json_file(qwen_config)
    model, _ = loader.build_model(qwen_config)
    assert next(model.parameters()).dtype == torch.float32
    assert same_weights(model, presets.build_preset("tiny-qwen2")[0])


def test_a_directory_without_weights_is_an_error_not_random_weights(qwen_config):
    assert loader.random_weights_config(qwen_config.parent) is None
    with pytest.raises(OSError):
        loader.load(qwen_config.parent, device="cpu")


def test_a_checkpoint_directory_loads_its_weights_and_tokenizer(tmp_path):
    model, tokenizer = presets.build_preset("tiny-llama", seed=3)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    assert loader.random_weights_config(tmp_path) is None  # weights present: not a bare config
    loaded = loader.load(tmp_path, device="cpu", dtype="float32")
    assert same_weights(loaded.model, model)
    assert loaded.tokenizer.encode("hello world") == tokenizer.encode("hello world")


def test_a_config_next_to_a_tokenizer_uses_it(qwen_config):
    presets.build_tokenizer(vocab_size=1024).save_pretrained(qwen_config.parent)
    _, tokenizer = loader.build_model(qwen_config)
    assert len(tokenizer) == 1024


def test_a_given_tokenizer_spares_the_checkpoint_its_own(tmp_path):
    model, tokenizer = presets.build_preset("tiny-llama")
    model.save_pretrained(tmp_path / "weights-only")
    tokenizer.save_pretrained(tmp_path / "tok")
    loaded = loader.load(tmp_path / "weights-only", tokenizer=str(tmp_path / "tok"), device="cpu")
    assert same_weights(loaded.model, model) and len(loaded.tokenizer) == len(tokenizer)


def test_the_llm_api_runs_a_config(qwen_config):
    llm = LLM(str(qwen_config), device="cpu", max_num_seqs=2, max_model_len=64)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 4


def test_an_unknown_path_names_the_problem(tmp_path):
    with pytest.raises(ValueError, match="neither a preset .* a config file nor an existing directory"):
        loader.load(str(tmp_path / "missing" / "model"), device="cpu")


# ---- hub ids: the local Hugging Face cache, then the hub -------------------------------------------------------


@pytest.fixture(autouse=True)
def hub(tmp_path, monkeypatch) -> Iterator[FakeHub]:
    """Every test in this module: a Hugging Face home of its own, offline, and huggingface_hub's HTTP client answered by an
    in-memory hub (no repos unless the test adds some), so nothing here can reach the network."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", "https://hub.invalid")
    with FakeHub().serving() as fake:
        yield fake


def go_online(monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)  # were the suite started with HF_HUB_OFFLINE=1


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A saved tiny-llama (seed 3) and its tokenizer: (directory, model, tokenizer)."""
    folder = tmp_path_factory.mktemp("checkpoint")
    model, tokenizer = presets.build_preset("tiny-llama", seed=3)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, model, tokenizer


def hub_cache(tmp_path) -> Path:
    return tmp_path / "hf" / "hub"


def not_found(name: str, cache: Path) -> str:
    return re.escape(
        f"model {name!r} is not a preset ({', '.join(presets.PRESET_NAMES)}), not an existing path, and not in the "
        f"local Hugging Face cache at {cache}; "
    )


@pytest.mark.parametrize("cache_var", ["HF_HOME", "HF_HUB_CACHE"])
def test_a_cached_hub_id_loads_offline_from_its_snapshot(tmp_path, monkeypatch, hub, checkpoint, cache_var):
    folder, model, tokenizer = checkpoint
    cache = hub_cache(tmp_path) if cache_var == "HF_HOME" else tmp_path / "elsewhere"
    if cache_var == "HF_HUB_CACHE":
        monkeypatch.setenv("HF_HUB_CACHE", str(cache))  # wins over HF_HOME, as in huggingface_hub
    snapshot = put_in_cache(cache, "org/name", read_folder(folder))
    start = time.perf_counter()
    source = loader.resolve_model("org/name")
    assert time.perf_counter() - start < 1.0
    assert source == loader.ModelSource("org/name", "checkpoint", snapshot, repo_id="org/name")
    loaded = loader.load("org/name", device="cpu", dtype="float32")
    assert loaded.name == "org/name" and same_weights(loaded.model, model)
    assert loaded.tokenizer.encode("hello world") == tokenizer.encode("hello world")
    assert loader.model_config("org/name").num_hidden_layers == model.config.num_hidden_layers
    for tok in (loader.model_tokenizer("org/name"), loader.load_tokenizer("org/name")):
        assert tok.encode("bonjour merci") == tokenizer.encode("bonjour merci")
    assert hub.requests == []


def test_the_llm_api_generates_from_a_cached_hub_id(tmp_path, checkpoint):
    put_in_cache(hub_cache(tmp_path), "org/name", read_folder(checkpoint[0]))
    llm = LLM("org/name", device="cpu", max_num_seqs=2, max_model_len=64)
    out = llm.generate(["hello world"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 4 and out[0].text


def test_rose_generate_runs_a_cached_hub_id_and_names_an_unknown_one(tmp_path, checkpoint):
    """The CLI as a user runs it: a fresh process, so huggingface_hub reads this environment at import too."""
    cache = hub_cache(tmp_path)
    put_in_cache(cache, "org/name", read_folder(checkpoint[0]))
    env = {
        **os.environ,
        "HF_HOME": str(tmp_path / "hf"),
        "HF_HUB_OFFLINE": "1",
        "HF_ENDPOINT": "https://hub.invalid",
    }
    env["PYTHONPATH"] = os.pathsep.join([str(Path(rose.__file__).parents[1]), env.get("PYTHONPATH", "")])

    def generate(model: str) -> subprocess.CompletedProcess:
        args = ["generate", "--model", model, "--device", "cpu", "--max-tokens", "4", "--ignore-eos", "hello"]
        return subprocess.run(
            [sys.executable, "-m", "rose", *args], env=env, capture_output=True, text=True, timeout=300
        )

    ok = generate("org/name")
    assert ok.returncode == 0, ok.stderr
    assert "'hello' -> length, 4 tokens" in ok.stdout
    missing = generate("org/missing")
    assert missing.returncode == 2
    assert re.search("rose generate: error: " + not_found("org/missing", cache), missing.stderr), (
        missing.stderr
    )


@pytest.mark.parametrize("name", ["org/missing", "tiny-lama"])
def test_an_unknown_hub_id_fails_at_once_offline_listing_the_presets(tmp_path, hub, name):
    message = not_found(name, hub_cache(tmp_path)) + re.escape("the hub was not tried (HF_HUB_OFFLINE=1)")
    calls = (
        lambda: loader.load(name, device="cpu"),
        lambda: loader.build_model(name),
        lambda: loader.model_config(name),
        lambda: loader.model_tokenizer(name),
        lambda: loader.load_tokenizer(name),
    )
    # a near miss of a preset's name is named
    hint = "; did you mean 'tiny-llama'?" if name == "tiny-lama" else ""
    for call in calls:
        start = time.perf_counter()
        with pytest.raises(loader.ModelNotFoundError, match=message) as raised:
            call()
        assert time.perf_counter() - start < 1.0
        assert str(raised.value).endswith(hint) and ("did you mean" in str(raised.value)) == bool(hint)
    assert hub.requests == []


def test_an_unreachable_hub_fails_fast_with_no_retries(tmp_path, monkeypatch):
    go_online(monkeypatch)
    endpoint = closed_port_url()
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setattr(hf_constants, "ENDPOINT", endpoint)  # huggingface_hub's own side requests: here too
    with real_http_client():
        start = time.perf_counter()
        with pytest.raises(ValueError) as raised:
            loader.load("org/missing", device="cpu")
        elapsed = time.perf_counter() - start
    assert elapsed < 5.0
    assert re.match(not_found("org/missing", hub_cache(tmp_path)), str(raised.value))
    assert f"the hub at {endpoint} could not be reached (ConnectError" in str(raised.value)


def test_a_hub_that_does_not_answer_fails_after_the_etag_timeout(monkeypatch):
    go_online(monkeypatch)
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "1")
    # huggingface_hub's side requests: refused
    monkeypatch.setattr(hf_constants, "ENDPOINT", closed_port_url())
    with socket.create_server(("127.0.0.1", 0)) as silent, real_http_client():  # accepts, never replies
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        monkeypatch.setenv("HF_ENDPOINT", endpoint)
        start = time.perf_counter()
        with pytest.raises(
            loader.ModelNotFoundError, match=re.escape(f"the hub at {endpoint} could not be reached")
        ):
            loader.model_config("org/name")
        assert 0.9 < time.perf_counter() - start < 3.0


def test_online_a_hub_id_is_downloaded_once_then_served_from_the_cache(
    tmp_path, monkeypatch, hub, checkpoint
):
    folder, model, tokenizer = checkpoint
    files = read_folder(folder)
    hub.repos["org/name"] = {
        **files,
        "pytorch_model.bin": b"a copy never fetched",
        "onnx/model.onnx": b"never",
    }
    go_online(monkeypatch)
    loaded = loader.load("org/name", device="cpu", dtype="float32")
    assert same_weights(loaded.model, model)
    assert loaded.tokenizer.encode("hello world") == tokenizer.encode("hello world")
    snapshot = loader.resolve_model("org/name").path
    assert snapshot.parent.parent == repo_folder(hub_cache(tmp_path), "org/name")
    assert set(read_folder(snapshot)) == set(files)  # safetensors only: no pickle copy, no ONNX export
    asked = len(hub.requests)
    loader.load("org/name", device="cpu")  # the cache first: no new request, online or not
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert same_weights(loader.load("org/name", device="cpu", dtype="float32").model, model)
    assert len(hub.requests) == asked


def test_online_the_hubs_reason_is_reported(tmp_path, monkeypatch, hub, checkpoint):
    go_online(monkeypatch)
    with pytest.raises(
        loader.ModelNotFoundError, match=not_found("org/missing", hub_cache(tmp_path))
    ) as raised:
        loader.load("org/missing", device="cpu")
    assert "the hub at https://hub.invalid answered: 404 Client Error. Repository Not Found" in str(
        raised.value
    )
    hub.repos["org/gated"] = read_folder(checkpoint[0])
    hub.gated.add("org/gated")
    with pytest.raises(
        loader.ModelNotFoundError, match="model 'org/gated': downloading it from the hub"
    ) as raised:
        loader.load("org/gated", device="cpu")
    assert "401 Client Error. Cannot access gated repo" in str(raised.value)


def test_a_cached_snapshot_without_weights_serves_what_it_has(tmp_path, monkeypatch, hub, checkpoint):
    folder, model, tokenizer = checkpoint
    files = read_folder(folder)
    cache = hub_cache(tmp_path)
    put_in_cache(cache, "org/name", {k: v for k, v in files.items() if not k.endswith(".safetensors")})
    assert loader.model_config("org/name").num_hidden_layers == model.config.num_hidden_layers
    assert len(loader.model_tokenizer("org/name")) == len(tokenizer)
    message = re.escape(
        f"is in the local Hugging Face cache at {cache} without its weights (snapshot {COMMIT})"
    )
    with pytest.raises(loader.ModelNotFoundError, match=message):
        loader.load("org/name", device="cpu")
    hub.repos["org/name"] = files
    go_online(monkeypatch)
    assert same_weights(loader.load("org/name", device="cpu", dtype="float32").model, model)


def test_a_hub_tokenizer_needs_no_weights(tmp_path, hub, qwen_config, checkpoint):
    tokenizer = checkpoint[2]
    files = read_folder(checkpoint[0])
    put_in_cache(hub_cache(tmp_path), "org/tok", {k: v for k, v in files.items() if "tokenizer" in k})
    model, tok = loader.build_model(qwen_config, tokenizer="org/tok")
    assert type(model).__name__ == "Qwen2ForCausalLM" and tok.encode("hello") == tokenizer.encode("hello")


@pytest.mark.parametrize(
    "name", ["./missing", "../missing/model", "~/rose-missing-model", "a/b/c", "cfg/config.json"]
)
def test_a_missing_path_is_never_looked_up_on_the_hub(monkeypatch, hub, name):
    go_online(monkeypatch)
    assert not loader.is_hub_id(name)
    with pytest.raises(ValueError, match="neither a preset .* a config file nor an existing directory"):
        loader.load(name, device="cpu")
    assert hub.requests == []


def test_hub_ids_are_org_slash_name_or_a_bare_name():
    assert all(loader.is_hub_id(n) for n in ("Qwen/Qwen2.5-0.5B-Instruct", "gpt2", "org/name"))
    assert not any(loader.is_hub_id(n) for n in ("org/na--me", "/abs", "org/name/x", "C:\\models\\x", None))


def test_an_existing_directory_wins_over_a_hub_id(tmp_path, monkeypatch, hub, checkpoint):
    folder, model, _ = checkpoint
    (tmp_path / "org").mkdir()
    shutil.copytree(folder, tmp_path / "org" / "name")
    monkeypatch.chdir(tmp_path)
    assert loader.resolve_model("org/name") == loader.ModelSource("org/name", "checkpoint", Path("org/name"))
    assert same_weights(loader.load("org/name", device="cpu", dtype="float32").model, model)
    assert hub.requests == []
