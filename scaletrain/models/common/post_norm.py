"""Post-norm decoder blocks (OLMo 2 and 3): the residual adds the *normed* output of attention and of the MLP.

Why a block of its own: a pre-norm block (Llama's) norms what goes into each sublayer; OLMo 2 moved the norms
after the sublayers (``x + norm(attn(x))``, ``x + norm(mlp(x))``) and norms queries and keys over the whole
projection (:class:`~scaletrain.models.common.qk_norm.AllHeadsQKNormAttention`), which kept its training
stable. A family reuses the block by naming its attention and MLP classes.
"""

from __future__ import annotations

from typing import Any, ClassVar

import jax
from flax import nnx

from scaletrain.models.common.inputs import LayerInputs
from scaletrain.models.common.layers import MLP
from scaletrain.models.common.qk_norm import AllHeadsQKNormAttention
from scaletrain.models.common.config import DecoderConfig
from scaletrain.models.common.dense import RMSNorm
from scaletrain.models.kernels.attention import KVCache

Array = jax.Array


class PostNormDecoderLayer(nnx.Module):
    """``x + post_attention_layernorm(attn(x))``, then ``x + post_feedforward_layernorm(mlp(x))`` (HF's names)."""

    attention_class: ClassVar[type[nnx.Module]] = AllHeadsQKNormAttention
    mlp_class: ClassVar[type[nnx.Module]] = MLP

    def __init__(self, config: DecoderConfig, dtype: Any, param_dtype: Any, precision: Any, rngs: nnx.Rngs):
        self.self_attn = self.attention_class(config, dtype, param_dtype, precision, rngs)
        self.mlp = self.mlp_class(config, dtype, param_dtype, precision, rngs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, param_dtype)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, param_dtype)

    @classmethod
    def aux_shapes(cls, config: DecoderConfig) -> dict[str, Any]:
        """One layer's auxiliary outputs: none."""
        return {}

    def __call__(self, x: Array, inputs: LayerInputs,
                 cache: KVCache | None = None) -> tuple[Array, dict[str, Any], KVCache | None]:
        attn, cache = self.self_attn(x, inputs, cache)
        x = x + self.post_attention_layernorm(attn)
        return x + self.post_feedforward_layernorm(self.mlp(x)), {}, cache
