"""LoRALinear's forms on every layout of a step (rose.engine.lora_layers): the runs padded into two batched
products (back to back from the first row or after base-model rows, padded, over slots out of order), one product
pair per run when padding would cost too much, the masked form; and siblings (q/k/v) sharing one product. Each
token must get its own adapter's `x A^T B^T * scaling` (or nothing, on the base model), as computed here in float64
from the adapter's weights."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from rose.engine.lora import LoRAManager, LoRARequest
from rose.engine.lora_layers import LoRALinear
from rose.engine.presets import build_preset
from rose.harness.lora_adapters import make_adapter

ATTENTION = ["q_proj", "k_proj", "v_proj"]
MLP = ["gate_proj", "up_proj"]  # siblings too
PATHS = {
    **{n: f"model.layers.0.self_attn.{n}" for n in ATTENTION},
    **{n: f"model.layers.0.mlp.{n}" for n in MLP},
}
# slot 0 and 1: the same scaling (a padding-free step of theirs scales through `alpha`); slot 2 its own rank and
# scaling; slot 3 targets q only
ADAPTERS = [
    ("same1", ATTENTION + MLP, 4, 8),
    ("same2", ATTENTION + MLP, 4, 8),
    ("other", ATTENTION + ["up_proj"], 2, 3),
    ("q_only", ["q_proj"], 3, 5),
]
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


@pytest.fixture(scope="module")
def requests(tmp_path_factory) -> list[LoRARequest]:
    model = build_preset("tiny-llama")[0]
    root = tmp_path_factory.mktemp("adapters")
    return [
        LoRARequest(name, i + 1, make_adapter(root / name, targets, rank, seed=i, model=model, alpha=alpha))
        for i, (name, targets, rank, alpha) in enumerate(ADAPTERS)
    ]


def loaded(requests, device: str = "cpu", dtype=torch.float32):
    model = build_preset("tiny-llama")[0].to(device, dtype)
    manager = LoRAManager(model, max_loras=4, max_lora_rank=4, kernel="runs")
    adapters = [manager.register(r) for r in requests]
    assert [manager.acquire(r.lora_name) for r in requests] == [0, 1, 2, 3]
    return model, manager, adapters


@pytest.fixture(scope="module", params=DEVICES)
def lora(request, requests):
    return loaded(requests, request.param)


def expected(layer: LoRALinear, name: str, x, slots, lengths, adapters) -> torch.Tensor:
    x64 = x.reshape(-1, x.shape[-1]).double().cpu()
    y = x64 @ layer.base.weight.double().cpu().T
    token_slots = [s for s, n in zip(slots, lengths, strict=True) for _ in range(n)]
    for row, slot in enumerate(token_slots):
        if slot is not None and PATHS[name] in adapters[slot].weights:
            a, b = (w.double() for w in adapters[slot].weights[PATHS[name]])
            y[row] += (x64[row] @ a.T @ b.T) * adapters[slot].scaling
    return y


def layers_of(model) -> dict[str, LoRALinear]:
    return {name: model.get_submodule(path) for name, path in PATHS.items()}


def run_step(manager, layers, slots, lengths, x_attention, x_mlp) -> dict[str, torch.Tensor]:
    """q/k/v on one input, gate/up on another, as a decoder layer calls them (siblings share one product)."""
    manager.begin_step(slots, lengths)
    try:
        return {name: layer(x_attention if name in ATTENTION else x_mlp) for name, layer in layers.items()}
    finally:
        manager.end_step()


LAYOUTS = {  # (slots by sequence, tokens by sequence, padded into batched products)
    "decode, one run a slot, every row": ([0, 0, 1, 1, 2, 2], [1] * 6, True),
    "decode, same scaling, no padding": ([0, 0, 0, 1, 1, 1], [1] * 6, True),
    "decode after base-model rows": ([None, None, 0, 0, 1, 1, 3, 3], [1] * 8, True),
    "unequal runs, padded": ([0, 1, 1, 1, 2, 2], [1] * 6, True),
    "slots out of order": ([2, 2, 0, 0, 1, 1], [1] * 6, True),
    "prompts of one slot apart": ([0, 1, 0, 1], [3, 3, 3, 3], True),
    "one long prompt among decode rows": ([0, 1, 2, 3], [1, 1, 12, 1], False),
    "a single run": ([None, 2, 2], [1, 4, 4], False),
}


@pytest.mark.parametrize("kernel", ["runs", "masked"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_token_gets_its_own_adapters_delta(lora, layout, kernel):
    model, manager, adapters = lora
    slots, lengths, padded = LAYOUTS[layout]
    layers = layers_of(model)
    device = model.device
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, sum(lengths), layers["q_proj"].base.in_features, generator=gen).to(device)
    x_mlp = torch.randn(1, sum(lengths), layers["up_proj"].base.in_features, generator=gen).to(device)
    manager.kernel = kernel
    try:
        manager.begin_step(slots, lengths)
        if kernel == "runs":
            assert (manager.step.padded is not None) == padded
        manager.end_step()
        outs = run_step(manager, layers, slots, lengths, x, x_mlp)
        manager.begin_step(slots, lengths)
        try:
            again = layers["k_proj"](x.clone())  # a copy of q/k/v's input: its own product
        finally:
            manager.end_step()
    finally:
        manager.kernel = "runs"
    for name, layer in layers.items():
        want = expected(layer, name, x if name in ATTENTION else x_mlp, slots, lengths, adapters)
        got = outs[name].reshape(want.shape).double().cpu()
        assert torch.allclose(got, want, atol=1e-4), (name, layout)
    got = again.reshape(-1, again.shape[-1]).double().cpu()
    assert torch.allclose(got, expected(layers["k_proj"], "k_proj", x, slots, lengths, adapters), atol=1e-4)


@pytest.mark.parametrize("kernel", ["runs", "masked"])
def test_half_precision_rounds_as_peft_does(requests, kernel):
    """In bfloat16 each layer gives what PEFT's `base(x) + lora_B(lora_A(x)) * scaling` gives in bfloat16, rounding
    for rounding (summing the scaled product inside the matmul, as float32 may, differed on 15-38 % of the values)."""
    model, manager, adapters = loaded(requests, dtype=torch.bfloat16)
    manager.kernel = kernel
    layers = layers_of(model)
    for slots in (
        [0, 0, 1, 1],
        [0, 0, 1, 1, 2, 2],
        [0, 1, 1, 1, 2, 2],
        [2, 2, 0, 0, 1, 1],
        [None, 0, 0, 1, 1],
    ):
        x = torch.randn(1, len(slots), 256).bfloat16()
        x_mlp = torch.randn(1, len(slots), layers["up_proj"].base.in_features).bfloat16()
        outs = run_step(manager, layers, slots, [1] * len(slots), x, x_mlp)
        differ = total = 0
        for name, layer in layers.items():
            xs = (x if name in ATTENTION else x_mlp)[0]
            want = F.linear(xs, layer.base.weight)
            for row, slot in enumerate(slots):
                weights = None if slot is None else adapters[slot].weights.get(PATHS[name])
                if weights is not None:
                    a, b = (w.bfloat16() for w in weights)
                    want[row] = (
                        want[row] + F.linear(F.linear(xs[row : row + 1], a), b)[0] * adapters[slot].scaling
                    )
            differ += int((outs[name][0] != want).sum())
            total += want.numel()
        assert differ <= total // 100, (slots, differ, total)


def test_siblings_share_one_product_and_see_a_slot_written_between_steps(tmp_path):
    """q/k/v are found to take the same input; their side-by-side A follows a slot written between two steps."""
    model = build_preset("tiny-llama")[0]
    requests = [
        LoRARequest(f"a{i}", i + 1, make_adapter(tmp_path / f"a{i}", ATTENTION, 4, seed=i, model=model))
        for i in range(3)
    ]
    manager = LoRAManager(model, max_loras=2, max_lora_rank=4, kernel="runs")
    adapters = [manager.register(r) for r in requests]
    attention = model.model.layers[0].self_attn
    q, k, v = (getattr(attention, name) for name in ATTENTION)
    assert q.siblings is not None and q.siblings is k.siblings is v.siblings
    assert [q.sibling_index, k.sibling_index, v.sibling_index] == [0, 1, 2]
    assert model.model.layers[0].mlp.gate_proj.siblings is model.model.layers[0].mlp.up_proj.siblings
    assert model.model.layers[0].mlp.down_proj.siblings is None
    x = torch.randn(1, 4, q.base.in_features)
    slots, lengths = [0, 0, 1, 1], [1] * 4
    for step, names in enumerate((["a0", "a1"], ["a0", "a2"])):  # a2 takes a1's slot between the steps
        for name in names:
            manager.acquire(name)
        manager.begin_step(slots, lengths)
        try:
            outs = [layer(x) for layer in (q, k, v)]
            assert q.siblings.x is x
        finally:
            manager.end_step()
        assert q.siblings.x is None  # the step's input let go
        by_slot = [adapters[0], adapters[1 + step]]
        for name, out in zip(ATTENTION, outs, strict=True):
            layer = getattr(attention, name)
            want = expected(layer, name, x, slots, lengths, by_slot)
            assert torch.allclose(out.reshape(4, -1).double(), want, atol=1e-4), (step, name)
        for name in names:
            manager.release(name)
