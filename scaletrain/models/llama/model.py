"""Llama's block and classes: the shared decoder with the pre-norm block Mistral, Qwen2 and Qwen3 reuse.

Pre-norm blocks of grouped-query attention with RoPE and a SwiGLU MLP, RMSNorm,
optional q/k/v(/o) biases, optional per-head q/k norms (Qwen3), optional tied
embeddings. The forward, the KV cache and the head are
:class:`scaletrain.models.common.decoder.CausalLM`'s.
"""

from __future__ import annotations

from typing import Any, ClassVar

import jax
from flax import nnx

from scaletrain.models.kernels.attention import KVCache
from scaletrain.models.common.decoder import CausalLM, DecoderModel
from scaletrain.models.common.inputs import LayerInputs
from scaletrain.models.common.layers import MLP, Attention
from scaletrain.models.llama.config import LlamaConfig
from scaletrain.models.common.dense import RMSNorm
from scaletrain.models.task import BASE_MODULE

Array = jax.Array
__all__ = ["MLP", "Attention", "DecoderLayer", "LlamaForCausalLM", "LlamaModel", "RMSNorm"]


class DecoderLayer(nnx.Module):
    """Pre-norm residual block: attention then MLP."""

    def __init__(self, config: LlamaConfig, dtype: Any, param_dtype: Any, precision: Any, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, param_dtype)
        self.self_attn = Attention(config, dtype, param_dtype, precision, rngs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, param_dtype)
        self.mlp = MLP(config, dtype, param_dtype, precision, rngs)

    @classmethod
    def aux_shapes(cls, config: LlamaConfig) -> dict[str, Any]:
        """One layer's auxiliary outputs: none."""
        return {}

    def __call__(self, x: Array, inputs: LayerInputs,
                 cache: KVCache | None = None) -> tuple[Array, dict[str, Any], KVCache | None]:
        attn, cache = self.self_attn(self.input_layernorm(x), inputs, cache)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), {}, cache


class LlamaModel(DecoderModel):
    """Embeddings, decoder layers and the final norm (HF's ``model.*``)."""

    # EasyDeL's names: a base module (no head), which the trainer does not train by itself
    _model_task: ClassVar[str] = BASE_MODULE
    config_class: ClassVar[type[LlamaConfig]] = LlamaConfig
    layer_class: ClassVar[type[nnx.Module]] = DecoderLayer


class LlamaForCausalLM(CausalLM):
    """Decoder with a language-model head; ``__call__`` returns logits in ``dtype``."""

    config_class: ClassVar[type[LlamaConfig]] = LlamaConfig
    base_model_class: ClassVar[type[DecoderModel]] = LlamaModel
