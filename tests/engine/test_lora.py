"""LoRA adapters (rose.engine.lora, vLLM's `enable_lora` / `LoRARequest`): one batch mixing adapters and the base
model gives each request the greedy tokens transformers' `generate` gives on the PEFT model with its adapter
(float32); more adapters than `max_loras` take turns in the slots; prefix caching is keyed by adapter; an adapter
that does not fit is refused with the reason."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from engine_helpers import greedy, make_engine
from hub_helpers import put_in_cache, read_folder
from safetensors.torch import load_file, save_file

from rose import LLM
from rose.engine.chat import ChatOptions, render_chat
from rose.engine.engine import Engine
from rose.engine.lora import LoRAError, LoRAManager, LoRARequest
from rose.engine.lora_layers import LoRALinear, masked_mapping, step_runs
from rose.engine.presets import build_preset
from rose.harness.lora_adapters import make_adapter, peft_greedy, tiny_phi3

PRESET = "tiny-llama"
PROMPTS = [list(range(10 + 7 * i, 40 + 9 * i)) for i in range(6)]
TARGETS = {
    "qv": ["q_proj", "v_proj"],
    "mlp": ["gate_proj", "up_proj", "down_proj"],
    "all": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}


# different ranks, alphas and scalings (alpha / rank, alpha / sqrt(rank) with rsLoRA) in one batch
SCALINGS = {"qv": {"alpha": 7, "use_rslora": True}, "mlp": {"alpha": 3}, "all": {}}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, LoRARequest]:
    root = tmp_path_factory.mktemp("adapters")
    out = {}
    for i, (name, targets) in enumerate(TARGETS.items()):
        make_adapter(root / name, targets, rank=4 + 4 * i, seed=i, **SCALINGS[name])
        out[name] = LoRARequest(name, i + 1, str(root / name))
    return out


def reference(request: LoRARequest | None, prompt: list[int], n: int) -> list[int]:
    return peft_greedy(None if request is None else request.lora_path, prompt, n, PRESET)


def run(eng, jobs) -> dict[str, list[int]]:
    for rid, prompt, lora in jobs:
        eng.add_request(rid, prompt, greedy(8), lora_request=lora)
    done = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.output.token_ids
    return done


@pytest.mark.parametrize("kernel", ["runs", "masked"])  # CPU's form and CUDA's (rose.engine.lora.LoRALinear)
def test_a_mixed_batch_is_exact_per_adapter_and_swaps_beyond_max_loras(adapters, kernel):
    loras = [None, adapters["qv"], adapters["mlp"], adapters["all"], None, adapters["qv"]]
    jobs = [(f"r{i}", p, lora) for i, (p, lora) in enumerate(zip(PROMPTS, loras, strict=True))]
    eng = make_engine(PRESET, max_model_len=128, enable_lora=True, max_loras=2, max_lora_rank=16)
    assert eng.lora.kernel == "runs"  # on CPU
    eng.lora.kernel = kernel
    done = run(eng, jobs)
    for rid, prompt, lora in jobs:
        assert done[rid] == reference(lora, prompt, 8), rid
    assert len({tuple(t) for t in done.values()}) > 3  # the adapters changed the outputs
    stats = eng.get_stats()  # three adapters took turns in two slots
    loads = {name: stats[f"lora_loads/{name}"] for name in ("qv", "mlp", "all")}
    evictions = {name: stats[f"lora_evictions/{name}"] for name in ("qv", "mlp", "all")}
    assert min(loads.values()) >= 1 and sum(evictions.values()) >= 1
    assert sum(loads.values()) == stats["lora_loads"] == eng.lora.num_loads
    for name in loads:  # an adapter is loaded again only after it was evicted
        assert loads[name] - evictions[name] in (0, 1)


def test_prefix_caching_is_keyed_by_adapter(adapters):
    eng = make_engine(
        PRESET, max_model_len=128, block_size=8, enable_lora=True, max_loras=2, enable_prefix_caching=True
    )
    prompt = PROMPTS[5]
    first = run(eng, [("base", prompt, None)])["base"]
    hits = eng.get_stats()["prefix_cache_hit_tokens"]
    with_lora = run(eng, [("qv", prompt, adapters["qv"])])["qv"]
    assert eng.get_stats()["prefix_cache_hit_tokens"] == hits  # the base model's blocks are not the adapter's
    again = run(eng, [("qv2", prompt, adapters["qv"]), ("base2", prompt, None)])
    assert eng.get_stats()["prefix_cache_hit_tokens"] > hits
    assert again == {"qv2": with_lora, "base2": first}
    assert with_lora == reference(adapters["qv"], prompt, 8)


def test_adapters_that_do_not_fit_are_refused(adapters, tmp_path):
    eng = make_engine(PRESET, max_model_len=64, enable_lora=True, max_lora_rank=8)
    with pytest.raises(LoRAError, match="rank 12 is above max_lora_rank 8"):
        eng.add_request("a", [1, 2, 3], greedy(2), lora_request=adapters["all"])
    with pytest.raises(LoRAError, match="cannot read adapter_config.json"):
        eng.add_request(
            "a", [1, 2, 3], greedy(2), lora_request=LoRARequest("gone", 9, str(tmp_path / "nope"))
        )
    make_adapter(tmp_path / "dora", ["q_proj"], rank=4, seed=0, use_dora=True)
    with pytest.raises(LoRAError, match=r"DoRA \(use_dora\) is not supported"):
        eng.add_request(
            "a", [1, 2, 3], greedy(2), lora_request=LoRARequest("dora", 5, str(tmp_path / "dora"))
        )
    # shapes of another model
    bad = tmp_path / "bad"
    make_adapter(bad, ["q_proj"], rank=4, seed=0)
    config = json.loads((bad / "adapter_config.json").read_text())
    tensors = {
        k: v[:, :-1].contiguous() if "lora_A" in k else v
        for k, v in load_file(str(bad / "adapter_model.safetensors")).items()
    }
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    (bad / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(LoRAError, match="do not fit its 256 -> 256 layer"):
        eng.add_request("a", [1, 2, 3], greedy(2), lora_request=LoRARequest("bad", 6, str(bad)))
    eng.add_request("a", [1, 2, 3], greedy(2), lora_request=adapters["qv"])
    with pytest.raises(LoRAError, match="lora_int_id 1 already names adapter 'qv'"):
        eng.add_request(
            "b", [1, 2, 3], greedy(2), lora_request=LoRARequest("other", 1, adapters["mlp"].lora_path)
        )
    make_adapter(tmp_path / "head", ["q_proj", "lm_head"], rank=4, seed=0)
    with pytest.raises(LoRAError, match=r"adapters of the LM head \(lm_head\) are not supported"):
        eng.add_request(
            "h", [1, 2, 3], greedy(2), lora_request=LoRARequest("head", 7, str(tmp_path / "head"))
        )
    plain = make_engine(PRESET, max_model_len=64)
    with pytest.raises(ValueError, match="needs an engine built with enable_lora=True"):
        plain.add_request("a", [1, 2, 3], greedy(2), lora_request=adapters["qv"])
    assert not plain.has_unfinished()


def test_an_adapter_of_modules_the_base_model_lacks_is_refused_naming_the_module(tmp_path):
    """An adapter of another architecture on tiny-llama: Phi-3's (tiny_phi3), whose o_proj would fit but whose fused
    qkv_proj tiny-llama lacks. Refused when registered (not half applied), naming the module, before any request
    runs; the engine goes on serving."""
    path = make_adapter(tmp_path / "phi3", ["o_proj", "qkv_proj"], rank=4, seed=0, model=tiny_phi3())
    eng = make_engine(PRESET, max_model_len=64, enable_lora=True)
    with pytest.raises(
        LoRAError,
        match=re.escape(
            f"LoRA adapter 'phi3' ({path}): the base model has no linear layer 'model.layers.0.self_attn.qkv_proj'"
        ),
    ):
        eng.add_request("a", [1, 2, 3], greedy(2), lora_request=LoRARequest("phi3", 1, path))
    assert not eng.has_unfinished() and eng.lora.adapters == []
    assert len(run(eng, [("base", [1, 2, 3], None)])["base"]) == 8


def test_a_full_set_of_slots_evicts_the_least_recently_used_idle_adapter(adapters):
    """Two slots, three adapters: qv then mlp run and finish, qv runs again (now the more recent); all takes the
    slot of mlp, the least recently used, and qv stays resident."""
    manager = LoRAManager(build_preset(PRESET)[0], max_loras=2, max_lora_rank=16)
    for request in adapters.values():
        manager.register(request)
    for name in ("qv", "mlp", "qv"):
        manager.acquire(name)
        manager.release(name)
    qv, mlp = manager.slot_of("qv"), manager.slot_of("mlp")
    assert manager.num_loads == 2 and manager.num_evictions == 0  # qv's second run found it resident
    assert manager.acquire("all") == mlp
    assert manager.evictions == {"mlp": 1} and manager.num_evictions == 1
    assert manager.slot_of("qv") == qv
    with pytest.raises(ValueError):
        manager.slot_of("mlp")  # no longer resident


def test_a_swap_never_reads_the_disk(adapters, tmp_path):
    """An adapter is read from disk once, when registered: with its directory gone, swapping it back into a slot
    (three adapters taking turns in one) still gives the same tokens, PEFT's."""
    copies = {}
    for name, request in adapters.items():
        shutil.copytree(request.lora_path, tmp_path / name)
        copies[name] = LoRARequest(name, request.lora_int_id, str(tmp_path / name))
    eng = make_engine(PRESET, max_model_len=128, enable_lora=True, max_loras=1)
    order = ["qv", "mlp", "all"]

    def one_by_one(tag: str) -> list[list[int]]:  # one at a time: each adapter in turn takes the slot
        return [
            run(eng, [(f"{tag}{i}", PROMPTS[i], copies[name])])[f"{tag}{i}"] for i, name in enumerate(order)
        ]

    before = one_by_one("before")
    loads = eng.lora.num_loads
    for name in copies:
        shutil.rmtree(tmp_path / name)
    assert one_by_one("after") == before
    assert eng.lora.num_loads - loads == len(order)  # every run swapped its adapter back in
    assert before == [reference(adapters[name], PROMPTS[i], 8) for i, name in enumerate(order)]


def test_a_hub_id_is_read_from_the_local_hub_cache(adapters, tmp_path, monkeypatch):
    """An adapter named by hub id loads from the local Hugging Face cache, never the network."""
    cache = tmp_path / "hub"
    put_in_cache(cache, "acme/sql-lora", read_folder(Path(adapters["qv"].lora_path)))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    eng = make_engine(PRESET, max_model_len=128, enable_lora=True)
    hub = LoRARequest("sql", 1, "acme/sql-lora")
    assert run(eng, [("h", PROMPTS[1], hub)])["h"] == reference(adapters["qv"], PROMPTS[1], 8)
    with pytest.raises(
        LoRAError, match=r"\(acme/absent\): not a directory, and not in the local Hugging Face cache at "
    ):
        eng.add_request("x", [1, 2], greedy(2), lora_request=LoRARequest("absent", 2, "acme/absent"))


def test_a_request_waiting_for_a_slot_is_not_starved_by_a_resident_adapters_stream(adapters):
    """One slot, held by adapter qv whose requests keep coming: the mlp request (waiting for the slot) stops LoRA
    requests behind it from starting, so the slot frees up and it runs; base-model requests still pass it."""
    eng = make_engine(PRESET, max_model_len=128, enable_lora=True, max_loras=1, max_num_seqs=4)
    eng.add_request("a0", PROMPTS[0], greedy(8), lora_request=adapters["qv"])
    eng.step()
    eng.add_request("b", PROMPTS[1], greedy(8), lora_request=adapters["mlp"])
    finished, n = [], 1
    for step in range(300):
        if step % 3 == 0:
            eng.add_request(f"a{n}", PROMPTS[n % 6], greedy(8), lora_request=adapters["qv"])
            eng.add_request(f"base{n}", PROMPTS[n % 6], greedy(8))
            n += 1
        finished += [o.request_id for o in eng.step() if o.finished]
        if "b" in finished:
            break
    assert "b" in finished, "the request for the adapter without a slot never ran"
    assert any(r.startswith("base") for r in finished[: finished.index("b")])  # base requests passed it


def test_a_load_that_raises_leaves_no_block_taken_and_no_half_loaded_slot(adapters, monkeypatch):
    """A slot's load that fails (e.g. out of memory on a GPU) fails that step; the request waits holding nothing, the
    slot is free and empty, and once loads work again every request's tokens are still PEFT's."""
    eng = make_engine(PRESET, max_model_len=128, enable_lora=True, max_loras=1)
    run(eng, [("warm", PROMPTS[0], adapters["all"])])  # every layer wrapped, slot 0 holds "all", idle
    free = eng.kv_cache_manager.num_free
    real, calls = LoRALinear.set_slot, []

    def failing(self, slot, weights):
        calls.append(slot)
        if len(calls) == 5:
            raise RuntimeError("simulated out of memory")
        return real(self, slot, weights)

    monkeypatch.setattr(LoRALinear, "set_slot", failing)
    eng.add_request("c", PROMPTS[2], greedy(8), lora_request=adapters["mlp"])
    with pytest.raises(RuntimeError, match="simulated out of memory"):
        eng.step()
    assert eng.kv_cache_manager.num_free == free and eng.num_waiting == 1
    monkeypatch.setattr(LoRALinear, "set_slot", real)
    finals = run(eng, [("d", PROMPTS[3], adapters["all"])])
    assert finals["d"] == reference(adapters["all"], PROMPTS[3], 8)
    assert finals["c"] == reference(adapters["mlp"], PROMPTS[2], 8)
    assert eng.kv_blocks_used == 0


def test_a_model_wrapped_by_another_engines_adapters_is_refused(adapters):
    model, tok = build_preset(PRESET)
    first = Engine(model, tok, device="cpu", dtype="float32", max_model_len=64, enable_lora=True)
    first.add_request("a", PROMPTS[0][:8], greedy(2), lora_request=adapters["qv"])
    while first.has_unfinished():
        first.step()
    with pytest.raises(ValueError, match="already carry another engine's LoRA adapters"):
        Engine(model, tok, device="cpu", dtype="float32", max_model_len=64, enable_lora=True)


def test_llm_chat_takes_lora_request_as_generate_does(adapters):
    """vLLM's `LLM.chat(..., lora_request=...)`: one adapter for every conversation or one per conversation; each
    reply is `generate`'s on the rendered prompt with that adapter (and PEFT's), not the base model's."""
    llm = LLM(PRESET, device="cpu", dtype="float32", max_model_len=128, enable_lora=True, max_loras=2)
    conversations = [
        [{"role": "user", "content": "Hello"}],
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "merci"}],
    ]
    qv, mlp = adapters["qv"], adapters["mlp"]

    def tokens(outs) -> list[list[int]]:
        return [out.outputs[0].token_ids for out in outs]

    try:
        rendered = [render_chat(llm.get_tokenizer(), c, ChatOptions()) for c in conversations]
        prompts = [{"prompt": r.prompt, "prompt_token_ids": r.prompt_token_ids} for r in rendered]
        base = tokens(llm.chat(conversations, greedy(6)))
        assert base == tokens(llm.generate(prompts, greedy(6)))

        one = llm.chat(conversations, greedy(6), lora_request=qv)  # one adapter for every conversation
        assert [out.prompt for out in one] == [r.prompt for r in rendered]
        assert tokens(one) == tokens(llm.generate(prompts, greedy(6), lora_request=qv))
        assert tokens(one)[0] == reference(qv, rendered[0].prompt_token_ids, 6)
        assert all(a != b for a, b in zip(tokens(one), base, strict=True))  # the adapter changed each reply

        each = tokens(llm.chat(conversations, [greedy(6), greedy(4)], lora_request=[mlp, None]))  # one each
        assert each == [tokens(llm.generate(prompts[0], greedy(6), lora_request=mlp))[0], base[1][:4]]
        assert each[0] not in (base[0], tokens(one)[0])

        # stream() takes an adapter too
        assert "".join(llm.stream(prompts[0], greedy(6), lora_request=qv)) == one[0].text

        with pytest.raises(
            ValueError, match="got 1 lora_request for 2 conversations: pass one, or one per conversation"
        ):
            llm.chat(conversations, greedy(6), lora_request=[qv])
        with pytest.raises(ValueError, match="got 3 lora_request for 2 prompts"):
            llm.generate(prompts, greedy(6), lora_request=[qv, None, mlp])
        assert not llm.engine.has_unfinished()
    finally:
        llm.engine.close()


def test_adapter_slots_are_allocated_at_construction_in_every_token_linear_layer():
    """Every linear layer but the LM head is wrapped when the engine is built, its slots allocated (before the KV
    store sizes itself from the device's free memory), none loaded yet."""
    eng = make_engine(PRESET, max_model_len=64, enable_lora=True, max_loras=3, max_lora_rank=8)
    config = eng.model.config
    widths = {
        name: (m.base.in_features, m.base.out_features)
        for name, m in eng.model.named_modules()
        if isinstance(m, LoRALinear)
    }
    assert len(widths) == 7 * config.num_hidden_layers  # q k v o gate up down
    assert eng.lora.num_layers == len(widths)
    slots = sum(3 * 8 * (i + o) * 4 for i, o in widths.values())  # float32
    # and the side-by-side A of q/k/v and of gate/up (rose.engine.lora_layers.Siblings)
    attention, mlp = widths["model.layers.0.self_attn.q_proj"][0], widths["model.layers.0.mlp.gate_proj"][0]
    siblings = config.num_hidden_layers * 3 * 8 * (3 * attention + 2 * mlp) * 4
    assert eng.lora.nbytes == slots + siblings
    assert eng.get_stats()["lora_loads"] == 0


def test_an_engine_that_fails_to_build_gives_the_model_its_layers_back(adapters):
    """The slots are allocated before the KV store is sized: a store that cannot be built, or options the scheduler
    refuses, leave the caller's model as it was, and another engine can take it."""
    model, tok = build_preset(PRESET)
    common = dict(device="cpu", dtype="float32", max_model_len=64, enable_lora=True)
    for bad in ({"max_kv_cache_bytes": 1}, {"max_num_seqs": 8, "max_num_batched_tokens": 4}):
        with pytest.raises(ValueError, match="max_kv_cache_bytes|max_num_batched_tokens"):
            Engine(model, tok, **common, **bad)
        assert not any(isinstance(m, LoRALinear) for m in model.modules()), bad
    eng = Engine(model, tok, **common)
    assert run(eng, [("a", PROMPTS[0][:8], adapters["qv"])])["a"] == reference(
        adapters["qv"], PROMPTS[0][:8], 8
    )


def test_a_layer_that_runs_on_a_subset_of_the_tokens_is_refused_at_registration(adapters):
    """An MLP run on some tokens only (as mixture-of-experts experts are) cannot take a per-token adapter: an
    adapter targeting it is refused when registered, naming the layer, not in the middle of a step; adapters of the
    other layers are served."""
    model, tok = build_preset(PRESET)
    mlp = model.model.layers[0].mlp
    full = mlp.forward

    def first_half(x):  # the other tokens skip this MLP
        half = x.shape[1] // 2 + 1
        return torch.cat([full(x[:, :half]), torch.zeros_like(x[:, half:])], dim=1)

    mlp.forward = first_half
    eng = Engine(model, tok, device="cpu", dtype="float32", max_model_len=64, enable_lora=True)
    with pytest.raises(
        LoRAError, match=r"model\.layers\.0\.mlp\.(gate|up|down)_proj runs on a subset of the tokens"
    ):
        eng.add_request("m", PROMPTS[0][:8], greedy(2), lora_request=adapters["mlp"])
    assert not eng.has_unfinished()
    assert len(run(eng, [("qv", PROMPTS[0][:8], adapters["qv"])])["qv"]) == 8


def test_the_step_mapping_gives_each_token_its_slots_columns_and_scaling():
    ranks, scalings = [0, 2, 1, 1], [0.0, 0.5, 0.0, 3.0]  # by slot, as loads set them
    layout = ([3, None, 1, 1, 3], [1, 2, 3, 2, 1])
    assert step_runs(*layout, ranks, scalings) == [(3, 0, 1, 1, 3.0), (1, 3, 8, 2, 0.5), (3, 8, 9, 1, 3.0)]
    assert step_runs([None, None], [4, 1], ranks, scalings) == []
    first, last, drop, scaling = masked_mapping(*layout, 2, scalings, torch.device("cpu"))
    assert (first, last) == (1, 4)  # slots 1..3 present: columns of slots 1, 2, 3
    assert (~drop).tolist() == [
        [False, False, False, False, True, True],  # slot 3
        *[[False] * 6] * 2,  # the base model: nothing kept
        *[[True, True, False, False, False, False]] * 5,  # slot 1
        [False, False, False, False, True, True],
    ]
    assert scaling.squeeze(1).tolist() == [3.0, 0.0, 0.0, *[0.5] * 5, 3.0]
    assert scaling.dtype == torch.float32
    eng = make_engine(PRESET, max_model_len=64, enable_lora=True)
    with pytest.raises(ValueError, match="kernel must be one of runs, masked, got 'fast'"):
        eng.lora.kernel = "fast"


def test_a_lora_steps_rows_are_grouped_by_adapter_and_sampled_in_batch_order(adapters):
    """The runner sorts decode rows, and prefill chunks, by adapter slot (a few runs); the logits still come back
    in the batch's order: sequences of alternating adapters, their prompts computed in one step, give PEFT's
    tokens."""
    eng = make_engine(PRESET, max_model_len=128, enable_lora=True, max_loras=2, max_num_seqs=6)
    loras = [adapters["qv"], None, adapters["mlp"], adapters["qv"], None, adapters["mlp"]]
    decode, prefill = [], []
    real = eng.lora.begin_step

    def spy(slots, lengths):
        (decode if set(lengths) == {1} else prefill).append(list(slots))
        return real(slots, lengths)

    eng.lora.begin_step = spy
    done = run(eng, [(f"r{i}", PROMPTS[i], lora) for i, lora in enumerate(loras)])
    decode_steps = [slots for slots in decode if len(slots) == 6]
    assert decode_steps and prefill
    for slots in [*decode_steps, prefill[0]]:
        # base-model rows first (-1), then each slot's rows together
        assert slots == sorted(slots, key=lambda s: -1 if s is None else s), slots
    assert len(prefill[0]) == 6  # every prompt in the first step
    for i, lora in enumerate(loras):
        assert done[f"r{i}"] == reference(lora, PROMPTS[i], 8), i
