"""Each layer's attention named by ``layer_types``: its window, its RoPE or none (NoPE), and the kinds of
layer the decoder prepares inputs for.

Why in common: Gemma 3 (five local layers to one global), OLMo 3 (sliding windows on three layers of
four), SmolLM3 (no RoPE on every fourth layer), GPT-OSS (alternating sliding and full layers) and
Qwen3.5 (linear-attention layers between full ones) all name their layers with transformers'
``layer_types``. A family's config subclasses :class:`LayerTypedConfig` (the types it builds in
``layer_type_names``, its default pattern in ``default_layer_types``, a type's RoPE in ``type_rope``) and
:func:`layer_kinds` turns any config into the distinct kinds of layer and each layer's kind, so the
decoder prepares masks and RoPE tables once per kind and a scanned stack picks its kind per layer
(:func:`scaletrain.models.common.layer_loop.by_kind`). A type a family does not build is refused in one
line naming ``layer_types`` and the entry, never built as something else.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, ClassVar, NamedTuple

import jax.numpy as jnp
from pydantic import model_validator

from scaletrain.errors import ConfigError
from scaletrain.models.common.inputs import LayerKind
from scaletrain.models.common.config import DecoderConfig
from scaletrain.models.kernels.attention import rope_attention_factor, rope_inv_freq

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
#: the attention types every :class:`LayerTypedConfig` builds (a family may add its own, e.g. linear attention)
ATTENTION_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)

#: a layer's RoPE as ``(rope_theta, rope_scaling)``; None where the layer has no positional rotation (NoPE)
RoPE = tuple[float, dict[str, Any] | None]


class LayerSpec(NamedTuple):
    """What sets a layer's attention apart, hashable: layers with equal specs share one kind's inputs."""

    layer_type: str
    window: int | None
    rope: str | None  # the RoPE as canonical JSON; None: NoPE


def every_nth_full(num_layers: int, n: int) -> list[str]:
    """Sliding layers with every ``n``-th one full (Gemma 3's 6, OLMo 3's 4): transformers' default patterns."""
    return [SLIDING_ATTENTION if (i + 1) % n else FULL_ATTENTION for i in range(num_layers)]


def layer_types_problem(layer_types: Sequence[Any], num_layers: int, known: Sequence[str],
                        family: str) -> str | None:
    """Why ``layer_types`` cannot be built (one line naming the first bad entry), or None."""
    for i, name in enumerate(layer_types):
        if name not in known:
            return (f"layer_types[{i}] {name!r} is not a layer type {family} builds; "
                    f"use one of {', '.join(known)}")
    if len(layer_types) != num_layers:
        return f"layer_types lists {len(layer_types)} layers but num_hidden_layers is {num_layers}; give one per layer"
    return None


def check_hf_layer_types(raw: dict[str, Any], config_class: type[DecoderConfig], where: str) -> None:
    """ConfigError naming ``where`` and the entry when a config.json's ``layer_types`` lists a type the
    family does not build: checked on the raw file, before transformers' own check (which lists every
    type any transformers model has, over several lines)."""
    known = getattr(config_class, "layer_type_names", None)
    types = raw.get("layer_types")
    if known is None or not isinstance(types, list):
        return
    problem = layer_types_problem(types, raw.get("num_hidden_layers", len(types)), known, config_class.model_type)
    if problem:
        raise ConfigError(f"{where}: {problem}")


class LayerTypedConfig(DecoderConfig):
    """A config whose layers each have a type (``layer_types``) and may go without RoPE (``no_rope_layers``).

    ``layer_types`` None takes the family's :meth:`default_layer_types`; ``sliding_attention`` layers attend
    within ``sliding_window``, ``full_attention`` ones to everything. ``no_rope_layers`` (transformers'
    SmolLM3 and Llama 4 name) has 1 where a layer rotates by RoPE and 0 where it does not; None: all do.
    """

    #: the layer types the family's blocks build; anything else is refused naming the entry
    layer_type_names: ClassVar[tuple[str, ...]] = ATTENTION_TYPES
    #: whether YaRN's attention factor follows each layer type's RoPE (OLMo 3: the full layers' only) rather
    #: than the config's ``rope_scaling`` for every layer (GPT-OSS): then each kind's RoPE tables carry it
    rope_factor_per_layer_type: ClassVar[bool] = False

    layer_types: list[str] | None = None
    no_rope_layers: list[int] | None = None

    @classmethod
    def default_layer_types(cls, config: LayerTypedConfig) -> list[str]:
        """The types of a config that gives none: every layer full here."""
        return [FULL_ATTENTION] * config.num_hidden_layers

    @model_validator(mode="after")
    def _check_layer_types(self) -> LayerTypedConfig:
        if self.layer_types is None:
            object.__setattr__(self, "layer_types", self.default_layer_types(self))
        problem = layer_types_problem(self.layer_types, self.num_hidden_layers, self.layer_type_names,
                                      self.model_type)
        if problem:
            raise ValueError(problem)
        if SLIDING_ATTENTION in self.layer_types and not self.sliding_window:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is not set; set it")
        nope = self.no_rope_layers
        if nope is not None and (len(nope) < self.num_hidden_layers or not set(nope) <= {0, 1}):
            raise ValueError(f"no_rope_layers must give 1 (RoPE) or 0 (none) for each of the "
                             f"{self.num_hidden_layers} layers, got {nope}")
        return self

    def layer_window(self, layer: int) -> int | None:
        """The attention window of ``layer`` (None: it sees every earlier token)."""
        return self.sliding_window if self.layer_types[layer] == SLIDING_ATTENTION else None

    def layer_rope(self, layer: int) -> RoPE | None:
        """``layer``'s RoPE, None for a NoPE layer."""
        if self.no_rope_layers is not None and not self.no_rope_layers[layer]:
            return None
        return self.type_rope(self.layer_types[layer])

    def type_rope(self, layer_type: str) -> RoPE:
        """The RoPE of a layer type: the config's one here (Gemma 3 gives its local layers their own)."""
        return self.rope_theta, self.rope_scaling


def layer_spec(config: DecoderConfig, layer: int) -> LayerSpec:
    """``layer``'s :class:`LayerSpec`; a config without layer types has one full-attention spec for all."""
    if isinstance(config, LayerTypedConfig):
        layer_type, window, rope = config.layer_types[layer], config.layer_window(layer), config.layer_rope(layer)
    else:
        layer_type, window, rope = FULL_ATTENTION, config.attention_window(), (config.rope_theta, config.rope_scaling)
    return LayerSpec(layer_type, window, None if rope is None else json.dumps(rope, sort_keys=True))


def kind_of(config: DecoderConfig, spec: LayerSpec) -> LayerKind:
    """The :class:`LayerKind` of ``spec``: its window and RoPE frequencies.

    A NoPE layer rotates by the angle 0 (all frequencies zero): cos 1 and sin 0 make the rotation
    exactly the identity in float32, so NoPE layers take every path RoPE layers take (the flash
    kernel's zigzag layout, the decode cache, the scanned switch) with no branch of their own.
    """
    if spec.rope is None:
        return LayerKind(spec.window, jnp.zeros((config.head_dim // 2,), jnp.float32))
    theta, scaling = json.loads(spec.rope)
    typed = config.model_copy(update={"rope_theta": theta, "rope_scaling": scaling})
    scale = rope_attention_factor(typed) if getattr(config, "rope_factor_per_layer_type", False) else 1.0
    return LayerKind(spec.window, rope_inv_freq(typed), scale)


def layer_kinds(config: DecoderConfig) -> tuple[tuple[LayerKind, ...], list[int]]:
    """The distinct kinds of layer (in order of first appearance) and each layer's index into them."""
    specs = [layer_spec(config, i) for i in range(config.num_hidden_layers)]
    distinct = list(dict.fromkeys(specs))
    return tuple(kind_of(config, s) for s in distinct), [distinct.index(s) for s in specs]


__all__ = ["ATTENTION_TYPES", "FULL_ATTENTION", "SLIDING_ATTENTION", "LayerSpec", "LayerTypedConfig", "RoPE",
           "check_hf_layer_types", "every_nth_full", "kind_of", "layer_kinds", "layer_spec", "layer_types_problem"]
