"""Reads, before any request, what each attention layer of a transformers model computes, and refuses what rose
cannot serve exactly (the first half of rose's binding to transformers; rose.engine.model_binding is the second).

`probe(model)`:
1. refuses encoder-decoder models, state-space / recurrent / linear-attention / sparse-indexed layers (they hold
   state, not K/V; transformers' own cache layer types say which), models whose attention bypasses transformers'
   `AttentionInterface`, a config mode whose results depend on how a sequence is split into forwards
   (`_UNSERVED_MODES`: dory's `recurrent_kv_cache_mode="last_loop"`), and a forward that cannot take
   `position_ids` at all (rose flattens a step's sequences into one row, each with its own positions);
2. runs one forward of a few tokens with rose's probe attention, registered both as an attention function and as
   a mask function: each attention call reports the tensors and arguments it hands to `AttentionInterface`, and
   the mask transformers builds for it (its mask function is evaluated, so a sliding window, chunked attention or
   plain causal attention is read exactly as `generate` applies it, per layer). A call that hands over something
   rose does not implement (a position bias, a bidirectional or data-dependent mask, K/V of another length than
   its queries, unknown arguments), a sub-model that kept another attention implementation, or a forward that fails
   refuses the model with the reason. A module that attends twice per forward (diffllama) gets two store layers;
3. runs the same forward with the positions shifted by one: the keys the attention layers receive must change.
   Whether `position_ids` reach the layers is judged by what they do, not by the forward's signature: a wrapper
   whose `forward(*args, **kwargs)` passes them on (a user's subclass, PEFT) is served; a forward that takes them
   and drops them (its inner model then counts positions itself) is refused. Where the shift changes nothing, a
   third forward of one token repeated tells the two apart: without any positional encoding (NoPE in every layer)
   every position of it computes the same keys in every layer, and such a model is served;
4. records the lengths below which rose is exact where transformers computes from more than each token's position
   (rose.engine.model_limits).
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections import Counter
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface

from rose.engine import model_limits
from rose.engine.attention import spec_eager
from rose.engine.layer_spec import LayerSpec, first_visible
from rose.engine.position_check import positions_matter, positions_reach_layers

logger = logging.getLogger(__name__)

PROBE_IMPLEMENTATION = "rose_probe"
PROBE_TOKENS = 8
POSITION_SHIFT = (
    1  # of the second probe forward's positions (still consecutive: not packed sequences to transformers)
)
# attention kwargs that carry nothing rose must apply (the mask, window and scale are read elsewhere)
_IGNORED_KWARGS = {
    "dropout",
    "scaling",
    "sliding_window",
    "softcap",
    "s_aux",
    "position_ids",
    "output_attentions",
    "use_cache",
}
# layer types (transformers' cache layer kinds) whose state is not a per-token K/V rose can store
_STATEFUL_LAYERS = {
    "conv": "convolution layers keep a rolling state",
    "linear_attention": "linear-attention / state-space layers keep a recurrent state",
    "hybrid": "hybrid layers keep a recurrent state beside their K/V",
    "hybrid_sliding": "hybrid layers keep a recurrent state beside their K/V",
    "indexed_attention": "sparse indexed attention picks the tokens each query attends to",
    "heavily_compressed_attention": "compressed attention stores transformed K/V",
    "compressed_sparse_attention": "compressed sparse attention stores transformed K/V",
}
# config field -> (a value rose cannot serve exactly, the value it serves, why)
_UNSERVED_MODES = {
    "recurrent_kv_cache_mode": (
        "last_loop",
        "per_loop",
        "its earlier recurrent loops attend over the K/V the last loop cached in earlier forwards beside their own "
        "for the current one, so its output depends on how a sequence is split into forwards (generate's: the "
        "prompt, then one token at a time), which rose's chunked, prefix-cached and batched steps do not reproduce",
    ),
}


class UnsupportedModelError(ValueError):
    """A model rose cannot serve exactly; the message names the model type and the reason."""


@dataclass
class AttentionLayers:
    """A probed model's attention calls in the order of one forward (= their index in the KV store), each with its
    module (a module that attends twice per forward, as diffllama's, has two entries) and its spec.

    `context_limit` / `step_limit`: the longest context and the most tokens per forward rose serves exactly, where
    transformers computes from more than each token's position (rose.engine.model_limits); None when unbounded.
    `reference_implementation`: the attention implementation the model came with, the one `generate` runs."""

    model_type: str
    modules: list[torch.nn.Module] = field(default_factory=list)
    specs: list[LayerSpec] = field(default_factory=list)
    context_limit: int | None = None
    limit_reason: str = ""
    step_limit: int | None = None
    step_reason: str = ""
    reference_implementation: str = "sdpa"

    def exact_context(self, context: int, requested: int | None) -> int:
        """The model's `context`, capped at `context_limit`; a longer `requested` max_model_len is refused."""
        limit = self.context_limit
        if limit is None or limit >= context:
            return context
        if requested is not None and requested > limit:
            raise UnsupportedModelError(
                f"{self.model_type}: exact only for contexts up to {limit} tokens ({self.limit_reason}); "
                f"max_model_len {requested} is longer"
            )
        logger.warning("%s: max_model_len capped at %d: %s", self.model_type, limit, self.limit_reason)
        return limit

    def exact_step_tokens(self, requested: int | None, default: int) -> int:
        """The step's token budget: `requested`, else `default`, capped at `step_limit` (a larger `requested` is
        refused)."""
        budget = requested or default
        if self.step_limit is None or budget <= self.step_limit:
            return budget
        if requested is not None:
            raise UnsupportedModelError(
                f"{self.model_type}: exact only for steps of up to {self.step_limit} tokens ({self.step_reason}); "
                f"max_num_batched_tokens {requested} is more"
            )
        return self.step_limit


def model_type(model: PreTrainedModel) -> str:
    """The name refusals give: the config's model_type (the text config's, for a composite model's text decoder)."""
    return getattr(model.config, "model_type", "") or type(model).__name__


def probe(model: PreTrainedModel) -> AttentionLayers:
    """The attention calls of `model` in forward order, with what each computes; raises UnsupportedModelError."""
    name = model_type(model)
    _check_architecture(model, name)
    recorder, shifted, repeated = _Recorder(name), _Recorder(name), _Recorder(name)
    stuck, attention_ran, failure = _probe_forward(model, recorder, shifted, repeated)
    # transformers only warns when a sub-model cannot switch: its layers would run without rose's store
    if stuck:
        raise UnsupportedModelError(
            f"{name}: its sub-model {stuck[0][0]} keeps transformers' {stuck[0][1]!r} attention, so rose cannot "
            "attach its KV cache to every layer"
        )
    if recorder.problems:
        raise UnsupportedModelError(f"{name}: {recorder.problems[0]}") from failure
    if failure is not None:
        raise UnsupportedModelError(
            f"{name}: its forward fails under rose's attention ({type(failure).__name__}: {failure}): it does "
            "something with its attention that rose does not implement"
        ) from failure
    recorded = {id(m) for m in recorder.layers.modules}
    if skipped := [m for m in attention_ran if id(m) not in recorded]:
        raise UnsupportedModelError(
            f"{name}: attention layer {skipped[0].layer_idx} ({type(skipped[0]).__name__}) ran without going "
            "through transformers' AttentionInterface, so rose cannot attach its KV cache to it"
        )
    if not recorder.layers.specs:
        raise UnsupportedModelError(
            f"{name}: no layer of it attends through transformers' AttentionInterface (recurrent or state-space "
            "layers keep a state instead), so rose has no KV cache to attach"
        )
    if not positions_reach_layers(recorder.keys, shifted.keys) and positions_matter(repeated.keys):
        raise UnsupportedModelError(
            f"{name}: its forward does not pass position_ids on (the positions it is given do not change what its "
            "attention layers receive), so rose cannot give each batched sequence its own positions"
        )
    layers = recorder.layers
    context, step = model_limits.exact_lengths(layers.modules, layers.specs, model)
    if context is not None:
        layers.context_limit, layers.limit_reason = context
    if step is not None:
        layers.step_limit, layers.step_reason = step
    if logger.isEnabledFor(logging.INFO):
        kinds = Counter(spec.describe() for spec in layers.specs)
        logger.info("%s attention: %s", name, "; ".join(f"{n} x {kind}" for kind, n in kinds.items()))
    return layers


def _probe_forward(
    model: PreTrainedModel, recorder: _Recorder, shifted: _Recorder, repeated: _Recorder
) -> tuple[list[tuple[str, str]], list[torch.nn.Module], Exception | None]:
    """One forward of PROBE_TOKENS tokens under the probe attention, into `recorder`: the (class, attention
    implementation) of each (sub-)model it went through that did not switch to the probe, the attention modules
    (`*Attention` classes with a `layer_idx`) that ran, each of which must have called the probe, and the exception
    the forward raised, if any. Then the same forward with positions shifted by POSITION_SHIFT, into `shifted`, and
    one of its first token repeated, into `repeated` (only the keys they hand to attention count). The model's attention implementation is restored."""
    previous = model.config._attn_implementation
    recorder.layers.reference_implementation = previous
    model.set_attn_implementation(PROBE_IMPLEMENTATION)
    ids = (torch.arange(PROBE_TOKENS) * 7 + 3) % model.config.get_text_config().vocab_size
    same = ids[:1].repeat(PROBE_TOKENS)
    device = next(model.parameters()).device
    ran: list[PreTrainedModel] = []
    attention_ran: list[torch.nn.Module] = []
    hooks = []
    for m in model.modules():
        if isinstance(m, PreTrainedModel):
            hooks.append(m.register_forward_pre_hook(lambda m, _: ran.append(m)))
        elif type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx"):
            hooks.append(m.register_forward_pre_hook(lambda m, _: attention_ran.append(m)))
    failure = None
    try:
        with torch.inference_mode():
            for run, tokens, shift in (
                (recorder, ids, 0),
                (shifted, ids, POSITION_SHIFT),
                (repeated, same, 0),
            ):
                _ACTIVE.recorder = run
                model(
                    input_ids=tokens[None].to(device),
                    position_ids=torch.arange(shift, shift + PROBE_TOKENS, device=device)[None],
                    use_cache=False,
                )
                for hook in hooks:  # the first forward says which (sub-)models and attention modules ran
                    hook.remove()
    except Exception as exc:  # reported by the caller, after what the layers themselves told the recorder
        failure = exc
    finally:
        _ACTIVE.recorder = None
        for hook in hooks:
            hook.remove()
    seen = [(type(m).__name__, m.config._attn_implementation) for m in ran]
    model.set_attn_implementation(previous)
    return [(cls, impl) for cls, impl in seen if impl != PROBE_IMPLEMENTATION], attention_ran, failure


def _check_architecture(model: PreTrainedModel, name: str) -> None:
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"{name}: encoder-decoder models are not supported (rose serves decoder-only)"
        )
    stateful = {t: why for t, why in _STATEFUL_LAYERS.items() if t in model_limits.layer_types(config)}
    if stateful or _has_state_space_config(config):
        reason = "; ".join(dict.fromkeys(stateful.values())) or "state-space / recurrent layers keep a state"
        raise UnsupportedModelError(f"{name}: {reason}: they have no KV cache rose can hold")
    if not model._can_set_attn_implementation():
        raise UnsupportedModelError(
            f"{name}: its attention does not use transformers' AttentionInterface, so rose cannot attach its KV cache"
        )
    text = config.get_text_config(decoder=True)
    for field_name, (unserved, served, why) in _UNSERVED_MODES.items():
        if getattr(text, field_name, None) == unserved:
            raise UnsupportedModelError(
                f"{name}: {field_name}={unserved!r} is not served exactly ({why}); rose serves "
                f"{field_name}={served!r} exactly: set it in the model's config"
            )
    # a forward that cannot even be called with position_ids; one that takes them (or **kwargs) is judged by whether
    # they reach its attention layers (rose.engine.position_check)
    params = inspect.signature(model.forward).parameters.values()
    if not any(p.name == "position_ids" or p.kind is p.VAR_KEYWORD for p in params):
        raise UnsupportedModelError(
            f"{name}: its forward takes no position_ids, so rose cannot give each batched sequence its own positions"
        )


def _has_state_space_config(config) -> bool:
    text = config.get_text_config(decoder=True)
    return any(
        hasattr(text, f) for f in ("state_size", "ssm_state_size", "mamba_d_state", "attention_hidden_size")
    )


# ----------------------------------------------------------------------------------------------------- the probe


@dataclass(frozen=True, slots=True)
class _Mask:
    """What the probe's mask function returns: the visibility transformers' mask gives a layer, or why it is not
    one rose implements."""

    window: int | None = None
    chunk: int | None = None
    unknown: str | None = None


def _probe_mask(*, mask_function, local_size: int | None = None, device=None, **_) -> _Mask:
    """Mask interface of the probe: evaluate transformers' mask function and name the pattern it draws."""
    size = int(local_size or 0)
    top = max(3 * size + 3, 4 * PROBE_TOKENS)
    rows = sorted(
        {
            p
            for p in (0, 1, 2, 7, size - 1, size, size + 1, 2 * size, 2 * size + 1, 3 * size + 2)
            if 0 <= p < top
        }
    )
    # on the model's device: overlays index tensors transformers made there (chunked attention's left padding)
    q = torch.tensor(rows, device=device)[:, None]
    kv = torch.arange(top, device=device)[None, :]
    zero = torch.zeros((), dtype=torch.long, device=device)
    try:
        got = torch.as_tensor(mask_function(zero, zero, q, kv)).expand(len(rows), top)
    except IndexError:  # an overlay indexed by the probe's own tokens (multimodal block ids)
        return _Mask(
            unknown="its attention mask depends on per-token data (multimodal blocks) rose does not read"
        )
    for window, chunk in ((None, None), (size, None), (None, size)) if size else ((None, None),):
        want = (kv <= q) & (kv >= first_visible(q, window, chunk))
        if torch.equal(got, want):
            return _Mask(window, chunk)
    return _Mask(unknown="its attention mask is neither causal, a sliding window nor chunked attention")


# the recorder of the probe running in this thread (engines may be built in several threads at once)
_ACTIVE = threading.local()


class _Recorder:
    """Collects, during the probe forward, each attention layer's spec in call order."""

    def __init__(self, model_type: str) -> None:
        self.layers = AttentionLayers(model_type)
        self.problems: list[str] = []
        self.keys: list[torch.Tensor] = []  # each call's keys, in call order

    def record(self, module, query, key, value, attention_mask, kwargs) -> LayerSpec | None:
        where = f"attention layer {getattr(module, 'layer_idx', len(self.layers.specs))}"
        problem = _spec_problem(query, key, value, attention_mask, kwargs)
        if problem:
            self.problems.append(f"{where}: {problem}")
            return None
        window = chunk = None
        if isinstance(attention_mask, _Mask):
            window, chunk = attention_mask.window, attention_mask.chunk
        sinks = kwargs.get("s_aux")
        spec = LayerSpec(
            num_heads=query.shape[1],
            num_kv_heads=key.shape[1],
            head_dim=query.shape[3],
            v_head_dim=value.shape[3],
            window=window,
            chunk=chunk,
            softcap=float(kwargs["softcap"]) if kwargs.get("softcap") else None,
            sinks=sinks is not None,
        )
        self.layers.modules.append(module)
        self.layers.specs.append(spec)
        return spec


def _spec_problem(query, key, value, attention_mask, kwargs) -> str | None:
    if isinstance(attention_mask, _Mask) and attention_mask.unknown:
        return attention_mask.unknown
    if attention_mask is not None and not isinstance(attention_mask, _Mask):
        return "it builds its own attention mask tensor instead of transformers' mask functions"
    if kwargs.get("is_causal") is False:
        return "its attention is not causal"
    if kwargs.get("position_bias") is not None:
        return "it adds a position bias (ALiBi-style) to the attention scores, which rose does not implement"
    # None / False: a feature switched off (e.g. output_router_logits=False)
    extra = sorted(
        k
        for k, v in kwargs.items()
        if v is not None and v is not False and k not in _IGNORED_KWARGS | {"is_causal"}
    )
    if extra:
        return f"its attention takes arguments rose does not implement: {', '.join(extra)}"
    if query.shape[0] != 1 or query.shape[2] != PROBE_TOKENS:
        return f"its queries have shape {tuple(query.shape)}, not one row of the {PROBE_TOKENS} probe tokens"
    if key.shape[2] != PROBE_TOKENS or value.shape[2] != PROBE_TOKENS or key.shape[1] != value.shape[1]:
        return f"its K/V {tuple(key.shape)} / {tuple(value.shape)} are not one entry per token of its queries"
    if query.shape[1] % key.shape[1] or query.shape[3] != key.shape[3]:
        return f"{query.shape[1]} query heads of dim {query.shape[3]} cannot attend over {key.shape[1]} KV heads of dim {key.shape[3]}"
    return None


def _probe_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """Attention function of the probe: record the layer, then attend as transformers' eager attention would."""
    recorder = getattr(_ACTIVE, "recorder", None)
    if recorder is not None:
        recorder.keys.append(key.detach().clone())
    spec = (
        recorder.record(module, query, key, value, attention_mask, kwargs) if recorder is not None else None
    )
    if spec is None:  # the forward goes on with zeros; the recorded problem refuses the model afterwards
        return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[3]), None
    pos = torch.arange(query.shape[2], device=query.device)
    visible = (pos[None, :] <= pos[:, None]) & (pos[None, :] >= first_visible(pos[:, None], *spec.visibility))
    scale = scaling if scaling is not None else spec.head_dim**-0.5
    out = spec_eager(spec, scale, kwargs.get("s_aux"))(query, key, value, visible[None, None])
    return out.contiguous(), None


AttentionInterface.register(PROBE_IMPLEMENTATION, _probe_attention)
AttentionMaskInterface.register(PROBE_IMPLEMENTATION, _probe_mask)
