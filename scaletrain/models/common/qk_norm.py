"""Queries and keys normed over all heads at once (OLMo 2 and 3), not head by head (Qwen3, Gemma 3).

Why its own class: OLMo's ``q_norm`` / ``k_norm`` are RMSNorms over the whole projection (``heads * head_dim``
values, one weight each) applied before the heads are split and rotated, so the statistics mix the heads;
the shared :class:`~scaletrain.models.common.layers.Attention` norms each head alone (``qk_norm``). With the
heads split over ``tp`` the mean over the projection is a reduction across devices, which the compiler
inserts from the shardings.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from scaletrain.models.common.layers import Attention
from scaletrain.models.common.config import DecoderConfig
from scaletrain.models.common.dense import RMSNorm
from scaletrain.models.kernels.attention import apply_rope

Array = jax.Array


class AllHeadsQKNormAttention(Attention):
    """The shared attention with ``q_norm`` [heads * head_dim] and ``k_norm`` [kv_heads * head_dim]."""

    def __init__(self, config: DecoderConfig, dtype: Any, param_dtype: Any, precision: Any, rngs: nnx.Rngs):
        super().__init__(config, dtype, param_dtype, precision, rngs)
        d = config.head_dim
        # nnx.data: the base class set these to None (static) first
        self.q_norm = nnx.data(RMSNorm(config.num_attention_heads * d, config.rms_norm_eps, dtype, param_dtype))
        self.k_norm = nnx.data(RMSNorm(config.num_key_value_heads * d, config.rms_norm_eps, dtype, param_dtype))

    def _head_norm(self, config: DecoderConfig, dtype: Any, param_dtype: Any) -> nnx.Module | None:
        return None  # the norms are over all heads, made in __init__

    def _qkv(self, x: Array, rope: tuple[Array, Array]) -> tuple[Array, Array, Array]:
        """Queries and keys normed over the whole projection, then split into heads and rotated."""
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x)).reshape(b, t, self.num_heads, self.head_dim)
        k = self.k_norm(self.k_proj(x)).reshape(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        return apply_rope(q, rope), apply_rope(k, rope), v
