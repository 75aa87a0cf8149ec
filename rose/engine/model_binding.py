"""Plugs rose's KV store into an unmodified transformers model that rose.engine.model_probe has checked and read.

`attach` binds each probed attention call to its layer of the store and switches the model to rose's attention
function (`rose_slots`, registered with transformers' `AttentionInterface`), then checks the switch reached every
bound layer. At each step the ModelRunner sets the step's metadata on its `ForwardContext`, which every bound layer
reads: it reaches the layers without forward kwargs, so models whose decoder layers do not pass `**kwargs` on are
served too. The two modules are everything rose knows about transformers' attention internals.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface, PreTrainedModel

from rose.engine.attention import attend_layer
from rose.engine.kv_cache import AttentionMetadata, KVCache
from rose.engine.model_probe import AttentionLayers, UnsupportedModelError

ATTN_IMPLEMENTATION = "rose_slots"


@dataclass
class ForwardContext:
    """The step being run: set by the ModelRunner around each forward (`begin` / `end`), read by every bound layer."""

    meta: AttentionMetadata | None = None
    calls: dict[int, int] = field(
        default_factory=dict
    )  # module id -> calls so far (modules that attend twice)

    def begin(self, meta: AttentionMetadata) -> None:
        self.meta = meta
        self.calls.clear()

    def end(self) -> None:
        self.meta = None


@dataclass(frozen=True, slots=True)
class _Binding:
    layers: tuple[int, ...]  # the store index of each of the module's calls in a forward
    cache: KVCache
    context: ForwardContext

    def next_layer(self, module: torch.nn.Module) -> int:
        if len(self.layers) == 1:
            return self.layers[0]
        calls = self.context.calls
        n = calls.get(id(module), 0)
        calls[id(module)] = n + 1
        return self.layers[n]


def attach(model: PreTrainedModel, layers: AttentionLayers, cache: KVCache, context: ForwardContext) -> None:
    """Bind every probed layer to its store index and switch the model to rose's attention. The engine owns the
    model from then on: its attention runs only inside the engine."""
    indices: dict[int, list[int]] = {}
    for index, module in enumerate(layers.modules):
        indices.setdefault(id(module), []).append(index)
    for module in layers.modules:
        module._rose_binding = _Binding(tuple(indices[id(module)]), cache, context)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    for module in layers.modules:  # the switch reached every layer the probe bound (their configs say so)
        config = getattr(module, "config", None)
        if config is not None and config._attn_implementation != ATTN_IMPLEMENTATION:
            raise UnsupportedModelError(
                f"{layers.model_type}: a layer kept transformers' {config._attn_implementation!r} attention after "
                "the switch to rose's"
            )


def slot_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention hook: write this step's K/V into the store, attend each token over its own slot.

    query/key/value: [1, heads, num_tokens, head_dim] (the step's tokens flattened into one row).
    Returns [1, num_tokens, heads, v_head_dim] as transformers expects.
    """
    binding: _Binding | None = getattr(module, "_rose_binding", None)
    meta = binding.context.meta if binding is not None else None
    if meta is None:
        raise RuntimeError(
            f"attention implementation {ATTN_IMPLEMENTATION!r} runs only inside rose's Engine (this layer is not "
            "bound to a KV store, or no step is running)"
        )
    layer = binding.next_layer(module)
    spec = binding.cache.specs[layer]
    scale = scaling if scaling is not None else spec.head_dim**-0.5
    out = attend_layer(binding.cache, layer, meta, query, key, value, scale, kwargs.get("s_aux"))
    return out[None].contiguous(), None  # models may .view() it


AttentionInterface.register(ATTN_IMPLEMENTATION, slot_attention_forward)
