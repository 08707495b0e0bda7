"""Qwen3.5's hybrid decoder in Flax NNX: the shared decoder with linear-attention and gated-attention layers.

What differs from Llama (:mod:`scaletrain.models.llama`), each as transformers' ``Qwen3_5ForCausalLM``
computes it (the conformance suite holds us to that):

- each layer's token mixer is its ``layer_types`` entry's: Gated DeltaNet
  (:mod:`scaletrain.models.common.linear_attention`, ``linear_attn.*``) or gated attention
  (:mod:`scaletrain.models.common.gated_attention`, ``self_attn.*``) with partial RoPE;
- RMSNorms scale by ``1 + weight`` (Gemma's), the q/k norms included; the linear layers' output norm
  is a gated RMSNorm with a plain weight;
- the decode cache is per layer kind: keys and values for full layers, a fixed-size convolution
  window and recurrent state for linear ones (:meth:`Qwen3_5DecoderLayer.init_cache`).
"""

from __future__ import annotations

from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from scaletrain.models.common.decoder import CausalLM, DecoderModel
from scaletrain.models.common.gated_attention import GatedAttention
from scaletrain.models.common.inputs import LayerInputs
from scaletrain.models.common.layers import MLP
from scaletrain.models.common.linear_attention import GatedDeltaNet, LinearState
from scaletrain.models.common.config import DecoderConfig
from scaletrain.models.gemma3.model import GemmaRMSNorm
from scaletrain.models.kernels.attention import KVCache
from scaletrain.models.qwen3_5.config import LINEAR, Qwen3_5TextConfig

Array = jax.Array


class Qwen3_5Attention(GatedAttention):
    """Gated attention with (1 + w) per-head q/k norms."""

    def _head_norm(self, config: DecoderConfig, dtype: Any, param_dtype: Any) -> nnx.Module:
        return GemmaRMSNorm(config.head_dim, config.rms_norm_eps, dtype, param_dtype)


class Qwen3_5DecoderLayer(nnx.Module):
    """``x + mixer(norm(x))`` then ``x + mlp(norm(x))``; the mixer is ``linear_attn`` or ``self_attn``."""

    attention_class: ClassVar[type[nnx.Module]] = Qwen3_5Attention
    linear_class: ClassVar[type[nnx.Module]] = GatedDeltaNet

    def __init__(self, config: Qwen3_5TextConfig, dtype: Any, param_dtype: Any, precision: Any, rngs: nnx.Rngs,
                 layer_type: str = LINEAR):
        norm = lambda: GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype, param_dtype)  # noqa: E731
        self.linear = layer_type == LINEAR
        self.input_layernorm = norm()
        if self.linear:
            self.linear_attn = self.linear_class(config, dtype, param_dtype, precision, rngs)
        else:
            self.self_attn = self.attention_class(config, dtype, param_dtype, precision, rngs)
        self.post_attention_layernorm = norm()
        self.mlp = self._mlp(config, dtype, param_dtype, precision, rngs)
        self.dtype = dtype

    def _mlp(self, config: Any, dtype: Any, param_dtype: Any, precision: Any, rngs: nnx.Rngs) -> nnx.Module:
        """The feed-forward block: SwiGLU here (the MoE families override this)."""
        return MLP(config, dtype, param_dtype, precision, rngs)

    @classmethod
    def aux_shapes(cls, config: DecoderConfig) -> dict[str, Any]:
        """One layer's auxiliary outputs: none."""
        return {}

    def init_cache(self, config: DecoderConfig, batch: int, max_length: int, dtype: Any) -> KVCache | LinearState:
        """This layer kind's empty decode state: a fixed-size :class:`LinearState`, or ``max_length`` KV slots."""
        if self.linear:
            return self.linear_attn.empty_state(batch, dtype)
        shape = (batch, max_length, config.num_key_value_heads, config.head_dim)
        return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    def _ffn(self, x: Array, inputs: LayerInputs) -> tuple[Array, dict[str, Any]]:
        """The MLP's output and its auxiliary outputs (none for a dense MLP; a mixture of experts' router
        statistics leave out the padding ``inputs.valid`` marks)."""
        return self.mlp(x), {}

    def __call__(self, x: Array, inputs: LayerInputs, cache: Any = None) -> tuple[Array, dict[str, Any], Any]:
        mixer = self.linear_attn if self.linear else self.self_attn
        mixed, cache = mixer(self.input_layernorm(x), inputs, cache)
        x = x + mixed
        out, aux = self._ffn(self.post_attention_layernorm(x), inputs)
        return x + out, aux, cache


class Qwen3_5TextModel(DecoderModel):
    """Embeddings, the hybrid layers (each built as its ``layer_types`` entry says) and the final norm."""

    config_class: ClassVar[type[DecoderConfig]] = Qwen3_5TextConfig
    layer_class: ClassVar[type[nnx.Module]] = Qwen3_5DecoderLayer
    norm_class: ClassVar[type[nnx.Module]] = GemmaRMSNorm

    def build_layer(self, index: int, config: Qwen3_5TextConfig, dtype: Any, param_dtype: Any, precision: Any,
                    rngs: nnx.Rngs) -> nnx.Module:
        return self.layer_class(config, dtype, param_dtype, precision, rngs, config.layer_types[index])


class Qwen3_5ForCausalLM(CausalLM):
    """Qwen3.5 (dense) text decoder with its head: one layer kind for the inputs (every layer reads the
    same RoPE tables and documents; the linear layers ignore the mask), the cache per layer kind."""

    config_class: ClassVar[type[DecoderConfig]] = Qwen3_5TextConfig
    base_model_class: ClassVar[type[DecoderModel]] = Qwen3_5TextModel
