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
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from scaletrain.models.attention import (
    KVCache,
    build_attention_mask,
    build_cache_mask,
    rope_inv_freq,
    rope_tables,
)
from scaletrain.models.config import LlamaConfig
from scaletrain.models.gemma3_config import FULL, Gemma3TextConfig
from scaletrain.models.llama import (
    _REMAT_POLICIES,
    MLP,
    Attention,
    Dense,
    LlamaForCausalLM,
    RMSNorm,
    _constrain,
    _init,
)
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


class GeGLU(MLP):
    """``down(gelu_tanh(gate(x)) * up(x))``: the SwiGLU projections with Gemma's activation."""

    def __call__(self, x: Array) -> Array:
        return self.down_proj(jax.nn.gelu(self.gate_proj(x), approximate=True) * self.up_proj(x))


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


class Gemma3TextModel(nnx.Module):
    """Embeddings, decoder layers and the final norm (HF's ``model.*`` names)."""

    _model_type: ClassVar[str] = "gemma3_text"
    _model_task: ClassVar[TaskType] = TaskType.BASE_MODULE
    config_class: ClassVar[type[LlamaConfig]] = Gemma3TextConfig

    def __init__(self, config: Gemma3TextConfig, dtype: Any, param_dtype: Any, precision: Any, rngs: nnx.Rngs):
        self.embed_tokens = nnx.Param(
            _init(config)(rngs.params(), (config.vocab_size, config.hidden_size), param_dtype),
            logical_axes=("vocab", "embed"),
        )
        self.layers = nnx.List(
            [Gemma3DecoderLayer(config, dtype, param_dtype, precision, rngs) for _ in range(config.num_hidden_layers)]
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype, param_dtype)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3 text decoder with its (usually tied) head; the Llama model's interface throughout."""

    _model_type: ClassVar[str] = "gemma3_text"
    _model_task: ClassVar[TaskType] = TaskType.CAUSAL_LM
    config_class: ClassVar[type[LlamaConfig]] = Gemma3TextConfig

    def __init__(
        self,
        config: Gemma3TextConfig,
        dtype: Any = jnp.float32,
        param_dtype: Any = jnp.float32,
        precision: Any = None,
        *,
        rngs: nnx.Rngs,
    ):
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.param_dtype = jnp.dtype(param_dtype)
        self.precision = precision
        self.model = Gemma3TextModel(config, self.dtype, self.param_dtype, precision, rngs)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Dense(config.hidden_size, config.vocab_size, ("embed", "vocab"), use_bias=False, config=config,
                       dtype=self.dtype, param_dtype=self.param_dtype, precision=precision, rngs=rngs)
        )

    # -- pieces shared by the training and the cached forward ------------------------
    def _embed(self, input_ids: Array) -> Array:
        x = jnp.take(self.model.embed_tokens[...], input_ids, axis=0).astype(self.dtype)
        # transformers multiplies by the scale cast to the compute dtype (55.5, not 55.4256, in bf16)
        return x * jnp.asarray(math.sqrt(self.config.hidden_size), jnp.float32).astype(self.dtype)

    def _ropes(self, positions: Array) -> dict[bool, Rope]:
        """RoPE tables by ``is_global``: local layers use ``rope_local_base_freq`` and no scaling."""
        cfg = self.config
        local = cfg.model_copy(update={"rope_theta": cfg.rope_local_base_freq, "rope_scaling": None})
        return {True: rope_tables(positions, rope_inv_freq(cfg)), False: rope_tables(positions, rope_inv_freq(local))}

    def _is_global(self, layer: int) -> bool:
        return self.config.layer_types[layer] == FULL

    # -- forward --------------------------------------------------------------
    def hidden_states(
        self,
        input_ids: Array,
        positions: Array | None = None,
        segment_ids: Array | None = None,
        attention_mask: Array | None = None,
    ) -> Array:
        """Final-norm hidden states [B, T, hidden]; each layer gets its kind's mask and RoPE."""
        cfg = self.config
        pa = cfg.partition_axis
        act_spec = (pa.batch_axis, pa.sequence_axis, None)
        causal_only = segment_ids is None and attention_mask is None
        if segment_ids is None:
            segment_ids = (
                attention_mask.astype(jnp.int32) if attention_mask is not None else jnp.ones_like(input_ids)
            )
        if positions is None:
            positions = jnp.maximum(jnp.cumsum(segment_ids != 0, axis=1) - 1, 0).astype(jnp.int32)
        masks = {
            True: None if causal_only else build_attention_mask(segment_ids, positions, None),
            False: build_attention_mask(segment_ids, positions, cfg.sliding_window),
        }
        ropes = self._ropes(positions)
        x = _constrain(self._embed(input_ids), act_spec)
        policy = cfg.gradient_checkpointing
        for i, layer in enumerate(self.model.layers):
            mask, rope = masks[self._is_global(i)], ropes[self._is_global(i)]
            if policy == "none":
                x = layer(x, mask, rope)
            else:
                x = nnx.remat(lambda lyr, *a: lyr(*a), policy=_REMAT_POLICIES[policy])(layer, x, mask, rope)
            x = _constrain(x, act_spec)
        return self.model.norm(x)

    def logit_softcap(self) -> float | None:
        return self.config.final_logit_softcapping

    # -- incremental decoding ---------------------------------------------------
    def forward_with_cache(
        self,
        input_ids: Array,
        positions: Array,
        cache: list[KVCache],
        start: Array,
        kv_valid: Array,
    ) -> tuple[Array, list[KVCache]]:
        """As :meth:`LlamaForCausalLM.forward_with_cache`, with each layer's own window and RoPE."""
        t = input_ids.shape[1]
        masks = {True: build_cache_mask(start, t, kv_valid, None),
                 False: build_cache_mask(start, t, kv_valid, self.config.sliding_window)}
        ropes = self._ropes(positions)
        x = self._embed(input_ids)
        new_cache = []
        for i, (layer, layer_cache) in enumerate(zip(self.model.layers, cache, strict=True)):
            g = self._is_global(i)
            x, layer_cache = layer.call_with_cache(x, masks[g], ropes[g], layer_cache, start)
            new_cache.append(layer_cache)
        return self.model.norm(x), new_cache
