"""Gemma 3 (text) causal decoder in Flax NNX: the shared decoder with Gemma's block and hooks.

What differs from Llama (:mod:`scaletrain.models.llama`), each as transformers' ``Gemma3ForCausalLM``
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
  (the chunked loss applies the same cap through ``logit_softcap``).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from scaletrain.models.kernels.attention import KVCache
from scaletrain.models.common.decoder import CausalLM, DecoderModel
from scaletrain.models.common.inputs import LayerInputs
from scaletrain.models.common.layers import MLP, Attention
from scaletrain.models.common.config import DecoderConfig
from scaletrain.models.common.dense import RMSNorm
from scaletrain.models.gemma3.config import Gemma3TextConfig
from scaletrain.models.task import BASE_MODULE

Array = jax.Array


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

    activation = staticmethod(_gelu_tanh)


class Gemma3Attention(Attention):
    """The shared attention with (1 + w) q/k norms and Gemma's softmax scale."""

    def __init__(self, config: Gemma3TextConfig, dtype: Any, param_dtype: Any, precision: Any, rngs: nnx.Rngs):
        super().__init__(config, dtype, param_dtype, precision, rngs)
        self.scale = float(config.query_pre_attn_scalar) ** -0.5

    def _head_norm(self, config: DecoderConfig, dtype: Any, param_dtype: Any) -> nnx.Module:
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

    @classmethod
    def aux_shapes(cls, config: DecoderConfig) -> dict[str, Any]:
        """One layer's auxiliary outputs: none."""
        return {}

    def __call__(self, x: Array, inputs: LayerInputs,
                 cache: KVCache | None = None) -> tuple[Array, dict[str, Any], KVCache | None]:
        attn, cache = self.self_attn(self.input_layernorm(x), inputs, cache)
        x = x + self.post_attention_layernorm(attn)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x))), {}, cache


class Gemma3TextModel(DecoderModel):
    """Embeddings, Gemma 3 decoder layers and the final (1 + w) norm (HF's ``model.*`` names)."""

    _model_task: ClassVar[str] = BASE_MODULE
    config_class: ClassVar[type[DecoderConfig]] = Gemma3TextConfig
    layer_class: ClassVar[type[nnx.Module]] = Gemma3DecoderLayer
    norm_class: ClassVar[type[nnx.Module]] = GemmaRMSNorm


class Gemma3ForCausalLM(CausalLM):
    """Gemma 3 text decoder with its (usually tied) head."""

    config_class: ClassVar[type[DecoderConfig]] = Gemma3TextConfig
    base_model_class: ClassVar[type[DecoderModel]] = Gemma3TextModel

    def embedding_scale(self) -> float:
        return math.sqrt(self.config.hidden_size)

    def logit_softcap(self) -> float | None:
        return self.config.final_logit_softcapping
