"""The layers that carry LoRA adapters (rose.engine.lora): which linear layers of a model can take one
(`token_linears`), the wrapper that adds each token's adapter delta (`LoRALinear`), and the step's token -> adapter
mapping they read (`StepMapping`, set by `LoRAManager.begin_step`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

KERNELS = ("runs", "masked")  # LoRALinear's forms


class Run(NamedTuple):
    """Consecutive tokens of one adapter in a step: rows [start, stop), its slot, rank and scaling."""

    slot: int
    start: int
    stop: int
    rank: int
    scaling: float


@dataclass(slots=True)
class PaddedRuns:
    """The runs form as two batched products a layer (Punica's BGMV), whatever the number of runs: each run padded
    to `width` rows. `rows` [runs * width]: the step's token of each padded row (padding repeats its run's last
    row), or None when the runs lie back to back from row `start` with `width` tokens each (a view then). `slots`:
    each run's slot, a slice when they are consecutive and in order (a view of the slots' weights), else a tensor
    [runs]. `rank`: the largest of the runs' adapters' ranks (the rows of each slot taken; past an adapter's rank
    they are zero). The adapters' scaling: `alpha` when every run has the same and none is padded, else `scaling`
    [runs, width, 1], each row's, 0 on padding (LoRALinear._add_padded says where each is applied)."""

    runs: int
    width: int
    start: int
    whole: bool  # back to back from row 0 to the step's last: the runs are every token
    rows: torch.Tensor | None
    slots: torch.Tensor | slice
    rank: int
    alpha: float = 1.0
    scaling: torch.Tensor | None = None
    key: tuple[int, int, int] | None = None  # (first slot, last + 1, rank) when the slots are consecutive


@dataclass(slots=True)
class StepMapping:
    """The running forward's tokens by adapter slot, set by `LoRAManager.begin_step`. `runs`: each run of
    consecutive tokens of one adapter (empty: no adapter runs), `slots` their slots; `padded`: the same runs for
    two batched products a layer (None: a product pair per run). For the masked kernel, the slots present lie in
    [first, last): `drop` [tokens, (last - first) * max_rank] is False on the columns of each token's slot (0 on a
    base-model token's row), `scaling` [tokens, 1] its adapter's scaling."""

    num_tokens: int = 0
    runs: list[Run] = field(default_factory=list)
    slots: frozenset[int] = frozenset()  # the runs' slots
    padded: PaddedRuns | None = None
    first: int = 0
    last: int = 0
    drop: torch.Tensor | None = None
    scaling: torch.Tensor | None = None


class LoRALinear(nn.Module):
    """A linear layer with a slot of A / B weights per resident adapter (zero where an adapter does not target it,
    and past an adapter's rank), B kept transposed ([rank, out] a slot).

    Each token gets PEFT's `lora_B(lora_A(x)) * scaling` for its adapter, added to the base layer's output, in one
    of two forms (`LoRAManager.kernel`), the S-LoRA / Punica batch in plain torch:
    - "runs" (the default): the model runner puts each adapter's decode rows, and its prefill chunks, together, so
      each adapter's tokens are a few runs of consecutive rows; x against each token's own adapter's A, then
      against its B, times its scaling: the arithmetic is each token's own adapter's only. When the runs padded to
      the longest are not much longer than they are (`PaddedRuns`: decode, prompts of like lengths) all runs go in
      two batched products (Punica's BGMV), else one product pair per run (its segmented SGMV), so that a batch of
      many adapters costs a few kernels a layer, not two per adapter; siblings (`Siblings`) share the first.
    - "masked" (a fixed number of kernels a layer whatever the adapters and their layout): x against the A of
      every slot present ([tokens, slots * rank]), masked to the token's own slot (the other products become exact
      zeros), against their B, times the token's scaling: two matmuls a layer, slots * rank columns a token.
    benchmarks/README.md has what each costs.
    """

    def __init__(self, base: nn.Linear, max_loras: int, max_rank: int, step: StepMapping) -> None:
        super().__init__()
        self.base = base
        self._plain = type(base) is nn.Linear
        # the scaling and the sum inside the product (_add_padded)
        self._fused = base.weight.dtype == torch.float32
        self.step = step
        w = base.weight
        self.lora_a = torch.zeros(max_loras * max_rank, base.in_features, dtype=w.dtype, device=w.device)
        self.lora_b = torch.zeros(max_loras * max_rank, base.out_features, dtype=w.dtype, device=w.device)
        # by slot: [slot, rank, in] and [slot, rank, out] views
        self.lora_a3 = self.lora_a.view(max_loras, max_rank, -1)
        self.lora_b3 = self.lora_b.view(max_loras, max_rank, -1)
        self._views_key: tuple[int, int, int] | None = None  # _run_weights' last views
        self._views: tuple[torch.Tensor, torch.Tensor] = (self.lora_a3, self.lora_b3)
        self.max_rank = max_rank
        self.loaded: set[int] = set()  # the slots whose adapter targets this layer
        self.siblings: Siblings | None = None  # the layers taking the same input, when there are
        self.sibling_index = 0

    def set_slot(self, slot: int, weights: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        if weights is None and slot not in self.loaded:
            return  # zero already
        if self.siblings is not None:
            self.siblings.stale()
        first = slot * self.max_rank
        self.lora_a[first : first + self.max_rank].zero_()
        self.lora_b[first : first + self.max_rank].zero_()
        # set before the copy: rows a failed copy wrote are zeroed next time
        self.loaded.discard(slot)
        if weights is not None:
            self.loaded.add(slot)
            a, b = weights
            r = a.shape[0]
            self.lora_a[first : first + r].copy_(a)
            self.lora_b[first : first + r].copy_(b.T)

    @property
    def nbytes(self) -> int:
        return self.lora_a.nbytes + self.lora_b.nbytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base
        # a plain nn.Linear without its module call (a subclass, e.g. a quantized one, through its own forward)
        y = F.linear(x, base.weight, base.bias) if self._plain else base(x)
        step = self.step
        if self.loaded.isdisjoint(step.slots):
            return y  # no adapter of the step targets this layer
        if x.numel() != step.num_tokens * x.shape[-1]:
            raise RuntimeError(
                f"LoRA layer saw {x.numel() // x.shape[-1]} tokens in a step of {step.num_tokens}"
            )
        if step.padded is not None:
            self._add_padded(x, y, step.padded)
            return y
        flat_x, flat_y = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        if step.drop is None:
            for slot, start, stop, rank, scaling in step.runs:
                if slot in self.loaded:
                    first = slot * self.max_rank
                    shrunk = flat_x[start:stop] @ self.lora_a[first : first + rank].T
                    b = self.lora_b[first : first + rank]
                    if self._fused:
                        flat_y[start:stop].addmm_(shrunk, b, alpha=scaling)
                    else:  # rounded as PEFT rounds
                        flat_y[start:stop].add_((shrunk @ b).mul_(scaling))
            return y
        rows = slice(step.first * self.max_rank, step.last * self.max_rank)
        # filled, not multiplied: another slot's product that overflowed (inf * 0) must not become NaN
        delta = ((flat_x @ self.lora_a[rows].T).masked_fill_(step.drop, 0) @ self.lora_b[rows]).mul_(
            step.scaling
        )
        return y + delta.view(y.shape)

    def _add_padded(self, x: torch.Tensor, y: torch.Tensor, p: PaddedRuns) -> None:
        """Adds every run's delta to `y` in two batched products (PaddedRuns); a run whose adapter does not target
        this layer has zero A and B rows here, so it adds exact zeros. In float32 the scaling and the sum go in the
        product (one rounding where PEFT has three: far below a tie); in half precision as PEFT rounds them: the
        product, times the scaling, then added."""
        a_t, b = self._run_weights(p)
        shrunk = self._shrunk(x, p, a_t)
        flat_y = y.view(-1, y.shape[-1])
        if self._fused and p.rows is None:  # in place: back to back, no padding
            _grouped(y, p).baddbmm_(shrunk, b, alpha=p.alpha)
            return
        delta = torch.bmm(shrunk, b)
        if not self._fused:  # padding rows (copies of a real row) times 0
            delta.mul_(p.alpha if p.scaling is None else p.scaling)
        delta = delta.view(-1, y.shape[-1])
        alpha = p.alpha if self._fused else 1.0
        if p.rows is None:
            flat_y[p.start : p.start + delta.shape[0]].add_(delta, alpha=alpha)
        else:
            flat_y.index_add_(0, p.rows, delta, alpha=alpha)

    def _shrunk(self, x: torch.Tensor, p: PaddedRuns, a_t: torch.Tensor) -> torch.Tensor:
        """x A for the padded runs (`a_t`: this layer's A of their slots), [runs, width, rank] (in float32 times the
        rows' scaling where PaddedRuns has them): this layer's columns of its siblings' product when one of them
        computed it for this very input, else computed (for all the siblings when the runs' slots are
        consecutive)."""
        siblings = self.siblings
        if siblings is not None and siblings.x is x:
            return siblings.parts[self.sibling_index]
        if p.rows is None:
            xs = _grouped(x, p)
        else:
            xs = x.reshape(-1, x.shape[-1]).index_select(0, p.rows).view(p.runs, p.width, -1)
        shared = siblings is not None and isinstance(p.slots, slice)
        shrunk = torch.bmm(xs, siblings.a_t(p) if shared else a_t)
        if p.scaling is not None and self._fused:
            shrunk.mul_(p.scaling)  # padding rows (copies of a real row) times 0
        if not shared:
            return shrunk
        siblings.x, siblings.parts = x, shrunk.split(p.rank, dim=-1)
        return siblings.parts[self.sibling_index]

    def _run_weights(self, p: PaddedRuns) -> tuple[torch.Tensor, torch.Tensor]:
        """A transposed [runs, in, rank] and B [runs, rank, out] of the runs' slots: views of the slots' buffers
        (kept while the steps' slots stay the same: decode) when the slots are consecutive, else gathered."""
        if p.key is None:
            return self.lora_a3[p.slots, : p.rank].transpose(1, 2), self.lora_b3[p.slots, : p.rank]
        if self._views_key != p.key:
            a_t = self.lora_a3[p.slots, : p.rank].transpose(1, 2)
            self._views, self._views_key = (a_t, self.lora_b3[p.slots, : p.rank]), p.key
        return self._views


class Siblings:
    """Wrapped layers that take the same input tensor in a forward (a layer's q/k/v projections, an MLP's gate/up;
    `token_linears` finds them). In a step whose padded runs hold consecutive slots, the first of them to run
    computes x A for all of them in one product ([runs, width, members * rank]) and each takes its columns: one
    product where there were as many as members. Only a saving: a member called with another tensor computes its
    own. The members' A side by side are kept while the steps' slots and ranks stay (decode) and no slot is
    written; `clear` (each step's end) lets the step's input and product go."""

    def __init__(self, members: list[LoRALinear]) -> None:
        self.members = members
        for i, member in enumerate(members):
            member.siblings, member.sibling_index = self, i
        slots, rank, width = members[0].lora_a3.shape
        # the members' A side by side, allocated with the slots (before the KV store takes the free memory)
        self._a = members[0].lora_a.new_zeros(slots, len(members) * rank, width)
        self._key: tuple[int, int, int] | None = None
        self.x: torch.Tensor | None = None  # the input of the step's shared product
        self.parts: tuple[torch.Tensor, ...] = ()  # its columns, by member

    @property
    def nbytes(self) -> int:
        return self._a.nbytes

    def stale(self) -> None:
        self._key = None

    def clear(self) -> None:
        self.x, self.parts = None, ()

    def a_t(self, p: PaddedRuns) -> torch.Tensor:
        """The members' A of the runs' (consecutive) slots, side by side and transposed: [slots, in, members *
        rank]; copied in when the step's slots or rank change or a slot was written."""
        width = len(self.members) * p.rank
        if self._key != p.key:
            for i, member in enumerate(self.members):
                self._a[p.slots, i * p.rank : (i + 1) * p.rank].copy_(member.lora_a3[p.slots, : p.rank])
            self._key = p.key
        return self._a[p.slots, :width].transpose(1, 2)


def _grouped(t: torch.Tensor, p: PaddedRuns) -> torch.Tensor:
    """The rows of back-to-back runs of `t` ([..., tokens, features]) as [runs, width, features]: a view of `t`
    when it is contiguous (the output added to in place always is: a linear layer's), else a copy."""
    if p.whole:
        return t.reshape(p.runs, p.width, -1)
    return t.reshape(-1, t.shape[-1])[p.start : p.start + p.runs * p.width].view(p.runs, p.width, -1)


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


PADDING_LIMIT = 2  # padded rows at most this many times the runs' tokens, else a product pair per run


def padded_runs(runs: list[Run], num_tokens: int, device: torch.device) -> PaddedRuns | None:
    """`runs` as PaddedRuns on `device`, or None when padding them to the longest would more than PADDING_LIMIT
    times their tokens (one long prompt among decode rows: a product per run costs less)."""
    if len(runs) < 2:
        return None
    lengths = [r.stop - r.start for r in runs]
    width = max(lengths)
    if len(runs) * width > PADDING_LIMIT * sum(lengths):
        return None
    unpadded = all(n == width for n in lengths)
    back_to_back = unpadded and all(runs[i].stop == runs[i + 1].start for i in range(len(runs) - 1))
    first = runs[0].slot
    if all(r.slot == first + i for i, r in enumerate(runs)):
        slots: torch.Tensor | slice = slice(first, first + len(runs))
    else:
        slots = torch.tensor([r.slot for r in runs], dtype=torch.long).to(device, non_blocking=True)
    whole = back_to_back and runs[0].start == 0 and runs[-1].stop == num_tokens
    rank = max(r.rank for r in runs)
    padded = PaddedRuns(len(runs), width, runs[0].start, whole, None, slots, rank)
    if isinstance(slots, slice):
        padded.key = (slots.start, slots.stop, rank)
    if not back_to_back:
        index = [r.start + min(j, r.stop - r.start - 1) for r in runs for j in range(width)]
        padded.rows = torch.tensor(index, dtype=torch.long).to(device, non_blocking=True)
    if unpadded and len({r.scaling for r in runs}) == 1:
        padded.alpha = runs[0].scaling
    else:  # float32, as PEFT's Python float
        scaling = [
            [r.scaling if j < n else 0.0] for r, n in zip(runs, lengths, strict=True) for j in range(width)
        ]
        padded.scaling = torch.tensor(scaling, dtype=torch.float32).to(device, non_blocking=True)
        padded.scaling = padded.scaling.view(len(runs), width, 1)
    return padded


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


def token_linears(model: nn.Module) -> tuple[list[str], dict[str, str], list[list[str]]]:
    """The linear layers of `model` (but its LM head) that run on all of a forward's tokens in every call (one
    forward of TRACE_TOKENS tokens, as transformers runs it), why each other cannot take an adapter, and the groups
    of those layers that took the very same input tensor (siblings: q/k/v, gate/up)."""
    head = model.get_output_embeddings()
    seen: dict[str, list[torch.Tensor | None]] = {}  # each call's input (kept: their ids stay unique)
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and module is not head:
            calls = seen.setdefault(name, [])
            hooks.append(
                module.register_forward_pre_hook(
                    lambda _, args, calls=calls: calls.append(args[0] if args else None)
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
    by_input: dict[int, list[str]] = {}
    for name, calls in seen.items():
        if not calls:
            unservable[name] = "does not run in the model's forward"
        elif any(x is None or x.numel() // x.shape[-1] != TRACE_TOKENS for x in calls):
            unservable[name] = (
                "runs on a subset of the tokens (e.g. a mixture-of-experts expert), which rose's LoRA does not serve"
            )
        else:
            served.append(name)
            if len(calls) == 1:
                by_input.setdefault(id(calls[0]), []).append(name)
    return served, unservable, [names for names in by_input.values() if len(names) > 1]
