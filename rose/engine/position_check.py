"""Whether a model's positions reach its attention layers, from the keys the model probe (rose.engine.model_probe)
recorded: rose gives each batched sequence its own `position_ids`, so a forward must pass them on, unless nothing in
the model depends on positions at all (no positional encoding in any layer).
"""

from __future__ import annotations

import torch


def positions_reach_layers(keys: list[torch.Tensor], shifted: list[torch.Tensor]) -> bool:
    """Whether shifting the probe's positions changed the keys some attention call received (rotary or learned
    positions; a forward that drops position_ids leaves every key bitwise the same)."""
    if len(keys) != len(shifted):  # the positions changed what the forward does
        return True
    return any(a.shape != b.shape or not torch.equal(a, b) for a, b in zip(keys, shifted, strict=True))


def positions_matter(repeated: list[torch.Tensor]) -> bool:
    """Whether the keys of a forward of one token repeated differ between positions in some attention call: rotary
    or learned positions, whoever computes them. Without any, every position of such a forward computes the same
    (the same token, attending over copies of the same values), up to rounding: 1e-4 of the keys' norm in float32,
    2e-2 in half precision (measured: exactly 0 for NoPE models, 0.4 and more with positions)."""
    for keys in repeated:
        keys = keys.float()
        first = keys[:, :, :1].expand_as(keys)
        tolerance = 1e-4 if repeated[0].dtype == torch.float32 else 2e-2
        if (keys - first).norm() > tolerance * max(keys.norm().item(), 1e-6):
            return True
    return not repeated
