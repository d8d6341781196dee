"""What a checkpoint's transformers model asks of attention, found by running it once on the
meta device (no weights, no arithmetic) with a recording attention function, and the
reasons it cannot be served.

The probe sees every attention call the model makes for a few packed tokens: which layer
(``module.layer_idx``), the query, key and value head counts and sizes, the softmax scale and
the per-layer arguments (``sliding_window``, ``softcap``, sink logits), and which of
transformers' mask builders the model asked for (a model whose masks add more than causality
and a window, such as chunked or bidirectional attention, is refused: tessellm's backends
compute causal attention with windows, nothing else). A layer that never calls attention
mixes tokens some other way (a state-space, linear-attention or convolution layer), whose
state the KV cache does not hold: refused, as are models whose attention ignores the
interface.
"""

from __future__ import annotations

import re
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tessellm.core.errors import ModelLoadError

from .attention import STEP_KWARG
from .module import failures_as_load_error

KNOWN_KWARGS = frozenset({"dropout", "scaling", "sliding_window", "softcap", "s_aux", "sinks", "position_ids",
                          "use_cache", "output_attentions", "output_router_logits", "output_hidden_states",
                          "return_dict", "cache_position", "position_embeddings", "encoder_hidden_states",
                          "is_causal", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k",
                          "logits_to_keep", "past_key_values", STEP_KWARG})
"""Attention arguments the plugin understands (those past ``scaling`` acted on, the rest
harmless when None, False or as listed in ``_unsupported_argument``)."""

CAUSAL_MASKS = ("create_causal_mask", "create_sliding_window_causal_mask")
"""transformers' mask builders whose masks the backends' causal attention (with a window)
computes; any other builder, or one given extra mask functions, is refused."""

TOKEN_MIXERS = re.compile(r"Mamba|Mixer|SSM|ShortConv|CausalConv|Recurrent|Rglru|Rwkv|RWKV|LinearAttention|"
                          r"DeltaNet|Lightning|Retention|[ms]LSTM|Hyena")
"""Module class names (past the family's own prefix) of token mixers other than attention."""

_probe_lock = threading.Lock()


@dataclass(frozen=True)
class AttentionCall:
    """One attention call of the probe forward."""

    layer: int | None
    heads: int
    kv_heads: int
    qk_dim: int
    key_dim: int
    value_dim: int
    value_heads: int
    scaling: float | None
    sliding_window: int | None
    softcap: float | None
    sink_kwarg: str | None
    unsupported: str | None
    extra_keys: int = 0
    """Keys beyond the call's own tokens (memory or compressed tokens the layer adds)."""


@dataclass
class ProbeStep:
    """Stands in for ``StepAttention`` during the probe: records each call, returns an empty
    output of the right shape."""

    calls: list[AttentionCall] = field(default_factory=list)

    def attend(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               kwargs: dict[str, Any]) -> torch.Tensor:
        sink_kwarg = next((name for name in ("s_aux", "sinks") if isinstance(kwargs.get(name), torch.Tensor)), None)
        softcap = kwargs.get("softcap")
        self.calls.append(AttentionCall(
            layer=getattr(module, "layer_idx", None), heads=query.shape[1], kv_heads=key.shape[1],
            qk_dim=query.shape[-1], key_dim=key.shape[-1], value_dim=value.shape[-1], value_heads=value.shape[1],
            scaling=_number(kwargs.get("scaling")), sliding_window=kwargs.get("sliding_window") or None,
            softcap=float(softcap) if softcap else None, sink_kwarg=sink_kwarg,
            unsupported=_unsupported_argument(kwargs), extra_keys=key.shape[2] - query.shape[2]))
        return query.new_empty(query.shape[0], query.shape[2], query.shape[1], value.shape[-1])


def _number(value: Any) -> float | None:
    return None if value is None else float(value)


def _unsupported_argument(kwargs: dict[str, Any]) -> str | None:
    """The first attention argument that asks for something the backends do not compute."""
    if kwargs.get("is_causal") is False:
        return "is_causal=False (bidirectional attention)"
    for name, value in kwargs.items():
        if name not in KNOWN_KWARGS and value is not None and value is not False:
            shown = f"a tensor of shape {list(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)
            return f"argument {name!r} ({shown})"
    return None


@dataclass
class MaskRequests:
    """The mask builders a forward called, and whether any was given extra mask functions."""

    builders: set[str] = field(default_factory=set)
    extras: set[str] = field(default_factory=set)


class _recording_masks:
    """Inside: every call of transformers' mask builders is recorded (by patching the
    argument check they all start with; the probe's implementation makes them return None)."""

    def __init__(self) -> None:
        self.requests = MaskRequests()

    def __enter__(self) -> MaskRequests:
        from transformers import masking_utils

        self.module, self.original = masking_utils, masking_utils._preprocess_mask_arguments
        requests = self.requests

        def recording(*args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1)
            requests.builders.add(caller.f_code.co_name)
            for extra in ("or_mask_function", "and_mask_function", "block_sequence_ids"):
                if caller.f_locals.get(extra) is not None:
                    requests.extras.add(f"{caller.f_code.co_name}({extra}=...)")
            return self.original(*args, **kwargs)

        masking_utils._preprocess_mask_arguments = recording
        return requests

    def __exit__(self, *exc: Any) -> None:
        self.module._preprocess_mask_arguments = self.original


@dataclass(frozen=True)
class Probe:
    """What the probe forward found: one call per layer, in layer order, and the masks asked for."""

    calls: tuple[AttentionCall, ...]
    masks: MaskRequests


FEED_FORWARD = ("mlp", "block_sparse_moe", "feed_forward", "moe", "ffn")
"""Names of a decoder layer's feed-forward block (stubbed where the probe cannot run it)."""


class _PassThrough(nn.Module):
    """Stands in for a feed-forward block during the probe: its input back (a mixture of
    experts whose routing reads values cannot run on the meta device; attention does not
    depend on it)."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return x


def probe_attention(model: nn.Module, num_layers: int, tokens: int = 3) -> Probe:
    """Run ``model`` (built on the meta device with the ``tessellm`` attention implementation)
    over ``tokens`` packed positions with a recording step (again with its feed-forward blocks
    passed through, if it cannot run as it is); a ModelLoadError naming why its attention
    cannot be served by tessellm's backends."""
    try:
        return _probe_once(model, num_layers, tokens)
    except ModelLoadError:
        if not _pass_feed_forward_through(model):
            raise
        return _probe_once(model, num_layers, tokens)


def _probe_once(model: nn.Module, num_layers: int, tokens: int) -> Probe:
    step = ProbeStep()
    ids = torch.zeros(1, tokens, dtype=torch.long, device="meta")
    positions = torch.arange(tokens, device="meta")[None]
    with _probe_lock, _recording_masks() as masks, torch.no_grad(), failures_as_load_error(
            "a forward of its transformers model on the meta device failed ({}), so what its layers ask of "
            "attention cannot be read"):
        model(input_ids=ids, position_ids=positions, use_cache=False, **{STEP_KWARG: step})
    return Probe(_one_call_per_layer(step.calls, num_layers), masks)


def _pass_feed_forward_through(model: nn.Module) -> bool:
    """Replace the feed-forward block of every layer that has one by ``_PassThrough``;
    whether any was."""
    replaced = False
    for module in list(model.modules()):
        for name in FEED_FORWARD:
            child = module._modules.get(name)
            if child is not None and not isinstance(child, _PassThrough) and any(
                    hasattr(m, "layer_idx") for m in module.modules()):
                module._modules[name] = _PassThrough()
                replaced = True
    return replaced


def _one_call_per_layer(calls: list[AttentionCall], num_layers: int) -> tuple[AttentionCall, ...]:
    if not calls:
        raise ModelLoadError("none of its layers calls transformers' attention interface (its layers mix tokens "
                             "some other way, or its attention ignores the interface)")
    if any(c.layer is None for c in calls):
        raise ModelLoadError("its attention modules have no layer_idx, so a call cannot be matched to its layer's "
                             "cache")
    counts: dict[int, int] = {}
    for call in calls:
        counts[call.layer] = counts.get(call.layer, 0) + 1
    twice = sorted(layer for layer, n in counts.items() if n > 1)
    if twice:
        raise ModelLoadError(f"layers {_listed(twice)} call attention more than once per forward (two attentions "
                             f"or a loop over a layer share one layer index), which one KV cache layer cannot hold")
    missing = sorted(set(range(num_layers)) - set(counts))
    if missing:
        raise ModelLoadError(f"layers {_listed(missing)} of {num_layers} never call attention: they mix tokens "
                             f"another way (a state-space, linear-attention or convolution layer), whose state the "
                             f"KV cache does not hold")
    extra = sorted(set(counts) - set(range(num_layers)))
    if extra:
        raise ModelLoadError(f"attention calls name layers {_listed(extra)}, past its {num_layers} layers")
    return tuple(sorted(calls, key=lambda c: c.layer))


def _listed(layers: list[int]) -> str:
    return ", ".join(map(str, layers[:8])) + (", ..." if len(layers) > 8 else "")


def refusal(probe: Probe, layer_types: list[str] | None = None) -> str | None:
    """Why the calls or masks the probe saw cannot be served exactly (None: they can), given
    the config's ``layer_types`` (which layers slide, where it says)."""
    for call in probe.calls:
        if call.unsupported:
            return f"layer {call.layer}'s attention passes {call.unsupported}, which tessellm's attention does not compute"
        if call.extra_keys:
            return (f"layer {call.layer} attends to {call.extra_keys:+d} keys besides its tokens' own (memory or "
                    f"compressed tokens of its own), which the KV cache does not hold")
    masks = probe.masks
    if masks.extras:
        return (f"it builds attention masks with extra mask functions ({', '.join(sorted(masks.extras))}), beyond "
                f"causal attention with a window")
    other = sorted(masks.builders - set(CAUSAL_MASKS))
    if other:
        return (f"it asks for masks of kind {', '.join(other)} (not causal attention with a window), which "
                f"tessellm's backends do not compute")
    for call, kind in zip(probe.calls, layer_types or []):
        if kind == "sliding_attention" and not call.sliding_window:
            return (f"layer {call.layer} is a sliding-window layer (layer_types) whose window reaches attention only "
                    f"through its mask, not as the argument sliding_window")
    first = probe.calls[0]
    shapes = {(c.heads, c.kv_heads, c.qk_dim, c.value_dim) for c in probe.calls}
    if len(shapes) > 1:
        return (f"its layers differ in attention shape (query heads, KV heads, q/k and value head sizes: "
                f"{sorted(shapes)}), while the KV cache has one shape for every layer")
    for call in probe.calls:
        if call.key_dim != call.qk_dim or call.value_heads != call.kv_heads:
            return (f"layer {call.layer}'s keys ({call.kv_heads} heads of {call.key_dim}) do not pair with its "
                    f"queries ({call.qk_dim} values a head) and values ({call.value_heads} heads)")
    if first.heads % first.kv_heads:
        return f"its {first.heads} query heads do not group evenly over {first.kv_heads} KV heads"
    return None


def structural_refusal(model: nn.Module) -> str | None:
    """Why ``model``'s make-up, before any forward, rules it out (None: it does not): token
    mixers besides attention, attention outside the interface, RoPE that follows the
    sequence length."""
    family = re.sub(r"(For[A-Z]\w*|LMHeadModel|WithLMHeadModel)$", "", type(model).__name__)
    try:
        decoder = model.get_decoder()
    except Exception:  # a model without a recognisable decoder: scan the whole of it
        decoder = model
    mixers = other_token_mixers(decoder, family)
    if mixers:
        return f"its layers mix tokens without attention ({', '.join(mixers)}), whose state the KV cache does not hold"
    if not type(model).is_backend_compatible():
        return (f"{type(model).__name__} does not route attention through transformers' AttentionInterface "
                f"(_supports_attention_backend is False)")
    if "dynamic" in rope_types_of(model):
        return ("rope_type 'dynamic': its frequencies follow the longest sequence of a forward, so a packed batch's "
                "would change every sequence's (they depend on sequence length)")
    return None


def rope_types_of(model: nn.Module) -> set[str]:
    """The rotary embedding types of ``model``'s rotary modules (per layer type, where a
    module keeps one per type)."""
    types: set[str] = set()
    for module in model.modules():
        value = getattr(module, "rope_type", None)
        if isinstance(value, str):
            types.add(value)
        elif isinstance(value, dict):
            types.update(v for v in value.values() if isinstance(v, str))
    return types


def other_token_mixers(model: nn.Module, family: str = "") -> list[str]:
    """Class names of modules in ``model`` that mix tokens without attention (convolutions
    over the sequence, state-space and recurrent layers), read past the ``family`` prefix its
    classes share ("RecurrentGemma"); transformers' ``Conv1D``, a linear layer, is not one."""
    found: list[str] = []
    for module in model.modules():
        name = type(module).__name__
        own = name[len(family):] if family and name.startswith(family) else name
        if (isinstance(module, nn.Conv1d) or TOKEN_MIXERS.search(own)) and name not in found:
            found.append(name)
    return found
