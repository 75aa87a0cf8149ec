"""Plugs rose's KV store into an unmodified transformers model that rose.engine.model_probe has checked and read.

`attach` binds each probed attention call to its layer of the store and switches the model to rose's attention
function (`rose_paged`, registered with transformers' `AttentionInterface`), then checks the switch reached every
bound layer. At each step the ModelRunner sets the step's metadata on its `ForwardContext`, which every bound layer
reads: it reaches the layers without forward kwargs, so models whose decoder layers do not pass `**kwargs` on are
served too. The two modules are everything rose knows about transformers' attention internals.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface, PreTrainedModel

from rose.engine.attention import Eager, attend_layer
from rose.engine.kv_cache import AttentionMetadata, KVCache
from rose.engine.model_probe import AttentionLayers, UnsupportedModelError

ATTN_IMPLEMENTATION = "rose_paged"


@dataclass
class ForwardContext:
    """The step being run: set by the ModelRunner around each forward (`begin` / `end`), read by every bound layer."""

    meta: AttentionMetadata | None = None
    # module id -> its calls so far in this forward (modules that attend twice)
    calls: dict[int, int] = field(default_factory=dict)

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
    eager: Callable | None  # the model's own `eager_attention_forward`
    eager_always: bool  # the model came with eager attention: every layer runs it (bf16 rounds as generate's)

    def next_layer(self, module: torch.nn.Module) -> int:
        """The store layer of this call of `module` (its nth call in the running forward)."""
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
    always = layers.reference_implementation == "eager"
    for module in layers.modules:
        binding = _Binding(tuple(indices[id(module)]), cache, context, _eager_function(module), always)
        module._rose_binding = binding
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    for module in layers.modules:  # the switch reached every layer the probe bound (their configs say so)
        config = getattr(module, "config", None)
        if config is not None and config._attn_implementation != ATTN_IMPLEMENTATION:
            raise UnsupportedModelError(
                f"{layers.model_type}: a layer kept transformers' {config._attn_implementation!r} attention after "
                "the switch to rose's"
            )


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention hook: write this step's K/V into the store, attend each token over its own
    sequence's blocks.

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
    sinks = kwargs.get("s_aux") if spec.sinks else None  # the spec, read by the probe, decides
    eager = None
    if binding.eager is not None and (binding.eager_always or not spec.plain):
        eager = _model_eager(binding.eager, module, meta, scale, kwargs)
    out = attend_layer(binding.cache, layer, meta, query, key, value, scale, sinks, eager)
    return out[None].contiguous(), None  # models may .view() it


def _eager_function(module: torch.nn.Module) -> Callable | None:
    """The `eager_attention_forward` the module's own forward falls back to (the one its code names), if it takes
    transformers' usual arguments."""
    forward_globals = getattr(inspect.unwrap(type(module).forward), "__globals__", {})
    function = forward_globals.get("eager_attention_forward")
    if function is None:
        return None
    params = inspect.signature(function).parameters
    wanted = ["module", "query", "key", "value", "attention_mask"]
    if list(params)[:5] != wanted or not {"scaling", "dropout"} <= set(params):
        return None
    return function


def _model_eager(
    function: Callable, module: torch.nn.Module, meta: AttentionMetadata, scale: float, kwargs: dict
) -> Eager:
    """The model's eager attention over rose's views, with an additive mask as transformers builds it (once per
    step, AttentionMetadata.additive_mask): the same operations in the same precision as `generate`'s (in bf16 the
    families differ, e.g. in the softmax's dtype)."""

    def eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        mask = meta.additive_mask(visible, q.dtype)
        out, _ = function(module, q, k, v, mask, scaling=scale, dropout=0.0, **kwargs)
        return out

    return eager


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
