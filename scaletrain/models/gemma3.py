"""Gemma 3 (text) causal decoder in Flax NNX, on the Llama family's projections and attention.

What differs from :mod:`scaletrain.models.llama`, each as transformers' ``Gemma3ForCausalLM``
computes it (the parity tests hold us to that):

- RMSNorm scales by ``1 + weight`` (weights start at zero), in float32, cast afterwards;
- a norm before *and after* both attention and the MLP, plus per-head q/k norms;
- a GeGLU MLP (gelu with the tanh approximation);
- embeddings multiplied by ``sqrt(hidden_size)`` cast to the compute dtype first
  (so bf16 uses 55.5 for 3072, as transformers does);
- layers of two kinds (``config.layer_types``): local ones attend within
  ``sliding_window`` with RoPE base ``rope_local_base_freq``, global ones attend to
  everything with ``rope_theta`` and ``rope_scaling``;
- scores scaled by ``query_pre_attn_scalar ** -0.5``;
- logits soft-capped to ``c * tanh(logits / c)`` when ``final_logit_softcapping`` is set
  (the chunked loss applies the same cap through :meth:`Gemma3ForCausalLM.logit_softcap`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from scaletrain.models.attention import KVCache, build_cache_mask, prepare_inputs, rope_inv_freq, rope_tables
from scaletrain.models.config import LlamaConfig
from scaletrain.models.fp8 import glu_product
from scaletrain.models.gemma3_config import FULL, Gemma3TextConfig
from scaletrain.models.llama import MLP, Attention, LlamaForCausalLM, LlamaModel, RMSNorm
from scaletrain.models.stacked_layers import StackedLayers
from scaletrain.models.task import TaskType

Array = jax.Array
Rope = tuple[Array, Array]


class GemmaRMSNorm(RMSNorm):
    """``x / rms(x) * (1 + weight)``, all in float32 and cast at the end; the weight starts at 0."""

    def __init__(self, dim: int, eps: float, dtype: Any, param_dtype: Any):
        super().__init__(dim, eps, dtype, param_dtype)
        self.weight = nnx.Param(jnp.zeros((dim,), param_dtype), logical_axes=("norm",))

    def __call__(self, x: Array) -> Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * (1.0 + self.weight[...].astype(jnp.float32))).astype(self.dtype)


def _gelu_tanh(x: Array) -> Array:
    """gelu with the tanh approximation, Gemma's gate activation."""
    return jax.nn.gelu(x, approximate=True)


class GeGLU(MLP):
    """``down(gelu_tanh(gate(x)) * up(x))``: the SwiGLU projections with Gemma's activation."""

    def __call__(self, x: Array) -> Array:
        return self.down_proj(glu_product(_gelu_tanh, self.gate_proj(x), self.up_proj(x), self.down_proj.fp8))


class Gemma3Attention(Attention):
    """The Llama attention with (1 + w) q/k norms and Gemma's softmax scale."""

    def __init__(self, config: Gemma3TextConfig, dtype: Any, param_dtype: Any, precision: Any, rngs: nnx.Rngs):
        super().__init__(config, dtype, param_dtype, precision, rngs)
        self.scale = float(config.query_pre_attn_scalar) ** -0.5

    def _head_norm(self, config: LlamaConfig, dtype: Any, param_dtype: Any) -> nnx.Module:
        return GemmaRMSNorm(config.head_dim, config.rms_norm_eps, dtype, param_dtype)


class Gemma3DecoderLayer(nnx.Module):
    """``x + post_norm(attn(pre_norm(x)))``, then the same around the MLP."""

    def __init__(self, config: Gemma3TextConfig, dtype: Any, param_dtype: Any, precision: Any, rngs: nnx.Rngs):
        norm = lambda: GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype, param_dtype)  # noqa: E731
        self.input_layernorm = norm()
        self.self_attn = Gemma3Attention(config, dtype, param_dtype, precision, rngs)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = GeGLU(config, dtype, param_dtype, precision, rngs)
        self.post_feedforward_layernorm = norm()

    def _mlp(self, x: Array) -> Array:
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))

    def __call__(self, x: Array, mask: Array | None, rope: Rope) -> Array:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), mask, rope))
        return self._mlp(x)

    def call_with_cache(self, x: Array, mask: Array, rope: Rope, cache: KVCache, start: Array) -> tuple[Array, KVCache]:
        attn, cache = self.self_attn.call_with_cache(self.input_layernorm(x), mask, rope, cache, start)
        return self._mlp(x + self.post_attention_layernorm(attn)), cache


class Gemma3TextModel(LlamaModel):
    """Embeddings, Gemma 3 decoder layers and the final (1 + w) norm (HF's ``model.*`` names)."""

    _model_type: ClassVar[str | None] = "gemma3_text"
    _model_task: ClassVar[TaskType] = TaskType.BASE_MODULE
    config_class: ClassVar[type[LlamaConfig]] = Gemma3TextConfig
    layer_class: ClassVar[type[nnx.Module]] = Gemma3DecoderLayer
    norm_class: ClassVar[type[nnx.Module]] = GemmaRMSNorm


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3 text decoder with its (usually tied) head; the Llama model's interface throughout."""

    _model_type: ClassVar[str] = "gemma3_text"
    _model_task: ClassVar[TaskType] = TaskType.CAUSAL_LM
    config_class: ClassVar[type[LlamaConfig]] = Gemma3TextConfig
    base_model_class: ClassVar[type[LlamaModel]] = Gemma3TextModel

    # -- pieces shared by the training and the cached forward ------------------------
    def _embed(self, input_ids: Array) -> Array:
        x = super()._embed(input_ids)
        # transformers multiplies by the scale cast to the compute dtype (55.5, not 55.4256, in bf16)
        return x * jnp.asarray(math.sqrt(self.config.hidden_size), jnp.float32).astype(self.dtype)

    def _kinds(self) -> dict[bool, tuple[int | None, Array]]:
        """``(window, RoPE inv_freq)`` by ``is_global``: local layers attend within ``sliding_window``
        with ``rope_local_base_freq`` and no scaling; global ones see everything with ``rope_theta``."""
        cfg = self.config
        local = cfg.model_copy(update={"rope_theta": cfg.rope_local_base_freq, "rope_scaling": None})
        return {True: (None, rope_inv_freq(cfg)), False: (cfg.sliding_window, rope_inv_freq(local))}

    def _is_global(self, layer: int) -> bool:
        return self.config.layer_types[layer] == FULL

    def _by_kind(self, layer: nnx.Module, is_global: Array, branch: Callable[[nnx.Module, bool], Any]) -> Any:
        """``branch(layer, is_global)`` for a stacked layer, whose kind is data: a ``lax.cond`` of both
        kinds (a plain call when every layer is one kind).

        Why a cond and not one body with the mask as data: each branch keeps its kind's own
        attention (the flash kernel's static window, cuDNN's mask-free causal path for global
        layers), so a stacked layer computes exactly what its unrolled self does. JAX shares the
        branches' saved residuals where their shapes agree (``_merge_branch_residuals``), and the
        two kinds save the same shapes, so the backward holds one set per layer, not two. The
        layer enters the cond as an operand (its state), so remat inside a branch updates a module
        of the branch's own trace.
        """
        kinds = set(self.config.layer_types)
        if len(kinds) == 1:
            return branch(layer, FULL in kinds)
        graphdef, state = nnx.split(layer)
        return lax.cond(is_global, lambda st: branch(nnx.merge(graphdef, st), True),
                        lambda st: branch(nnx.merge(graphdef, st), False), state)

    def _layer_kinds(self) -> Array:
        """``is_global`` of every layer, [L] bool: what a scan over a stack reads per layer."""
        return jnp.asarray([self._is_global(i) for i in range(self.config.num_hidden_layers)])

    # -- forward --------------------------------------------------------------
    def hidden_states(
        self,
        input_ids: Array,
        positions: Array | None = None,
        segment_ids: Array | None = None,
        attention_mask: Array | None = None,
    ) -> Array:
        """Final-norm hidden states [B, T, hidden]; each layer gets its kind's mask and RoPE."""
        # pallas: each kind's PackedSegments carry its window (rows stay in order: no zigzag over sp here)
        inputs = {is_global: prepare_inputs(input_ids, positions, segment_ids, attention_mask, window, inv_freq,
                                            self.config.attn_mechanism)
                  for is_global, (window, inv_freq) in self._kinds().items()}
        x = self._shard_activations(self._embed(input_ids))
        layers = self.model.layers
        if isinstance(layers, StackedLayers):
            # the cond inside the remat: the layer's slice of the stack and h are the saved inputs, as for
            # any stacked layer, and a branch saves only what the policy keeps of its kind's attention
            def by_kind(layer: nnx.Module, h: Array, g: Array) -> Array:
                return self._by_kind(layer, g, lambda m, kind: m(h, inputs[kind].mask, inputs[kind].rope))

            step = lambda layer, h, g: (self._shard_activations(  # noqa: E731
                self._run_layer(layer, h, g, call=by_kind)), None)
            x, _ = layers.scan(step, x, self._layer_kinds())
        else:
            for i, layer in enumerate(layers):
                kind = inputs[self._is_global(i)]
                x = self._shard_activations(self._run_layer(layer, x, kind.mask, kind.rope))
        return self.model.norm(x)

    def logit_softcap(self) -> float | None:
        return self.config.final_logit_softcapping

    # -- incremental decoding ---------------------------------------------------
    def forward_with_cache(
        self,
        input_ids: Array,
        positions: Array,
        cache: list[KVCache] | KVCache,
        start: Array,
        kv_valid: Array,
    ) -> tuple[Array, list[KVCache] | KVCache]:
        """As :meth:`LlamaForCausalLM.forward_with_cache`, with each layer's own window and RoPE."""
        kinds = {is_global: (build_cache_mask(start, input_ids.shape[1], kv_valid, window), rope_tables(positions, f))
                 for is_global, (window, f) in self._kinds().items()}
        x = self._embed(input_ids)
        layers = self.model.layers
        if isinstance(layers, StackedLayers):  # one [L, ...] cache, scanned with the layers and their kinds
            def step(layer: nnx.Module, h: Array, cache_and_kind: tuple[KVCache, Array]) -> tuple[Array, KVCache]:
                layer_cache, g = cache_and_kind
                return self._by_kind(layer, g, lambda m, kind: m.call_with_cache(h, *kinds[kind], layer_cache, start))

            x, cache = layers.scan(step, x, (cache, self._layer_kinds()))
            return self.model.norm(x), cache
        new_cache = []
        for i, (layer, layer_cache) in enumerate(zip(layers, cache, strict=True)):
            mask, rope = kinds[self._is_global(i)]
            x, layer_cache = layer.call_with_cache(x, mask, rope, layer_cache, start)
            new_cache.append(layer_cache)
        return self.model.norm(x), new_cache
