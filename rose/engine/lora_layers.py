"""The layers that carry LoRA adapters (rose.engine.lora): which linear layers of a model can take one
(`token_linears`), the wrapper that adds each token's adapter delta (`LoRALinear`), and the step's token -> adapter
mapping they read (`StepMapping`, set by `LoRAManager.begin_step`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn

KERNELS = ("runs", "masked")  # LoRALinear's forms


class Run(NamedTuple):
    """Consecutive tokens of one adapter in a step: rows [start, stop), its slot, rank and scaling."""

    slot: int
    start: int
    stop: int
    rank: int
    scaling: float


@dataclass(slots=True)
class StepMapping:
    """The running forward's tokens by adapter slot, set by `LoRAManager.begin_step`. `runs`: each run of
    consecutive tokens of one adapter (empty: no adapter runs). For the masked kernel, the slots present lie in
    [first, last): `drop` [tokens, (last - first) * max_rank] is False on the columns of each token's slot (0 on a
    base-model token's row), `scaling` [tokens, 1] its adapter's scaling."""

    num_tokens: int = 0
    runs: list[Run] = field(default_factory=list)
    first: int = 0
    last: int = 0
    drop: torch.Tensor | None = None
    scaling: torch.Tensor | None = None


class LoRALinear(nn.Module):
    """A linear layer with a slot of A / B weights per resident adapter (zero where an adapter does not target it,
    and past an adapter's rank), B kept transposed ([rank, out] a slot).

    Each token gets PEFT's `lora_B(lora_A(x)) * scaling` for its adapter, added to the base layer's output, in one
    of two forms (`LoRAManager.kernel`), the S-LoRA / Punica batch in plain torch:
    - "runs" (CPU): the model runner puts each adapter's decode rows together, so each adapter's tokens are a few
      runs of consecutive rows; per run, x against the adapter's A (its own rank), then added against its B times
      its scaling (Punica's segmented SGMV). The arithmetic is each token's own adapter's only.
    - "masked" (CUDA: a fixed number of kernels a layer whatever the adapters): x against the A of every slot
      present ([tokens, slots * rank]), masked to the token's own slot (the other products become exact zeros),
      against their B, times the token's scaling: two matmuls a layer, slots * rank columns for every token.
    benchmarks/README.md has what each costs.
    """

    def __init__(self, base: nn.Linear, max_loras: int, max_rank: int, step: StepMapping) -> None:
        super().__init__()
        self.base = base
        self.step = step
        w = base.weight
        self.lora_a = torch.zeros(max_loras * max_rank, base.in_features, dtype=w.dtype, device=w.device)
        self.lora_b = torch.zeros(max_loras * max_rank, base.out_features, dtype=w.dtype, device=w.device)
        self.max_rank = max_rank
        self.loaded = [False] * max_loras  # whether each slot's adapter targets this layer

    def set_slot(self, slot: int, weights: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        if weights is None and not self.loaded[slot]:
            return  # zero already
        first = slot * self.max_rank
        self.lora_a[first : first + self.max_rank].zero_()
        self.lora_b[first : first + self.max_rank].zero_()
        # set before the copy: rows a failed copy wrote are zeroed next time
        self.loaded[slot] = weights is not None
        if weights is not None:
            a, b = weights
            r = a.shape[0]
            self.lora_a[first : first + r].copy_(a)
            self.lora_b[first : first + r].copy_(b.T)

    @property
    def nbytes(self) -> int:
        return self.lora_a.nbytes + self.lora_b.nbytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        step = self.step
        # the runs of the step's adapters that target this layer
        runs = [run for run in step.runs if self.loaded[run.slot]]
        if not runs:
            return y
        flat_x, flat_y = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        if flat_x.shape[0] != step.num_tokens:
            raise RuntimeError(f"LoRA layer saw {flat_x.shape[0]} tokens in a step of {step.num_tokens}")
        if step.drop is None:
            for slot, start, stop, rank, scaling in runs:
                first = slot * self.max_rank
                shrunk = flat_x[start:stop] @ self.lora_a[first : first + rank].T
                flat_y[start:stop].addmm_(shrunk, self.lora_b[first : first + rank], alpha=scaling)
            return y
        rows = slice(step.first * self.max_rank, step.last * self.max_rank)
        # filled, not multiplied: another slot's product that overflowed (inf * 0) must not become NaN
        delta = ((flat_x @ self.lora_a[rows].T).masked_fill_(step.drop, 0) @ self.lora_b[rows]).mul_(
            step.scaling
        )
        return y + delta.view(y.shape)


def step_runs(
    slots: list[int | None], lengths: list[int], ranks: list[int], scalings: list[float]
) -> list[Run]:
    """The runs of a step whose sequence i has `lengths[i]` consecutive tokens with adapter slot `slots[i]` (None:
    the base model); `ranks` / `scalings`: the adapters' by slot. Consecutive sequences of one adapter make one run."""
    runs: list[Run] = []
    start = 0
    for slot, n in zip(slots, lengths, strict=True):
        if slot is not None:
            if runs and runs[-1].slot == slot and runs[-1].stop == start:
                runs[-1] = runs[-1]._replace(stop=start + n)
            else:
                runs.append(Run(slot, start, start + n, ranks[slot], scalings[slot]))
        start += n
    return runs


def masked_mapping(
    slots: list[int | None], lengths: list[int], max_rank: int, scalings: list[float], device: torch.device
) -> tuple[int, int, torch.Tensor, torch.Tensor]:
    """The masked kernel's (first, last, drop, scaling) for such a step (StepMapping), built on `device` from each
    token's slot, without a loop over sequences."""
    present = [s for s in slots if s is not None]
    first, last = min(present), max(present) + 1
    per_seq = torch.tensor([-1 if s is None else s for s in slots]).to(device, non_blocking=True)
    repeats = torch.tensor(lengths).to(device, non_blocking=True)
    token_slot = torch.repeat_interleave(per_seq, repeats, output_size=sum(lengths))
    column_slot = torch.arange(first * max_rank, last * max_rank, device=device) // max_rank
    # past a layer's rank its A and B are zero; a base-model token (-1) drops every column
    drop = token_slot[:, None] != column_slot[None, :]
    # float32, as PEFT's Python float (bf16 would round it); index -1: the base model's 0
    table = torch.tensor([*scalings, 0.0]).to(device, non_blocking=True)
    return first, last, drop, table[token_slot][:, None]


TRACE_TOKENS = 16  # of the forward that tells which linear layers run on every token


def token_linears(model: nn.Module) -> tuple[list[str], dict[str, str]]:
    """The linear layers of `model` (but its LM head) that run on all of a forward's tokens in every call (one
    forward of TRACE_TOKENS tokens, as transformers runs it), and why each other cannot take an adapter."""
    head = model.get_output_embeddings()
    rows: dict[str, list[int]] = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and module is not head:
            calls = rows.setdefault(name, [])
            hooks.append(
                module.register_forward_pre_hook(
                    lambda _, args, calls=calls: calls.append(
                        args[0].numel() // args[0].shape[-1] if args else -1
                    )
                )
            )
    # spread over the vocabulary: the first ids (special, byte tokens) could all route to the same experts
    vocab = model.config.get_text_config().vocab_size
    stride = 7919 if math.gcd(7919, vocab) == 1 else 1
    ids = (torch.arange(TRACE_TOKENS) * stride + 3) % vocab
    device = next(model.parameters()).device
    try:
        with torch.inference_mode():
            model(input_ids=ids[None].to(device), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    served, unservable = [], {}
    for name, calls in rows.items():
        if not calls:
            unservable[name] = "does not run in the model's forward"
        elif any(n != TRACE_TOKENS for n in calls):
            unservable[name] = (
                "runs on a subset of the tokens (e.g. a mixture-of-experts expert), which rose's LoRA does not serve"
            )
        else:
            served.append(name)
    return served, unservable
