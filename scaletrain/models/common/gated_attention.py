"""Gated attention: the shared attention with an output gate, as Qwen3.5's and Qwen3-Next's full-attention
layers compute it.

Why a subclass and not a flag: only the query projection and what it yields differ. ``q_proj``
writes, per head, the query and then the gate (``[heads, 2 * head_dim]``, transformers' layout, so
checkpoints map one to one); the attention output is multiplied by ``sigmoid(gate)`` before
``o_proj`` (:meth:`Attention.__call__` applies the gate :meth:`_qkv_gate` returns). The cache,
masks, kernels and sharding are the shared attention's.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from scaletrain.models.common.layers import Attention
from scaletrain.models.common.dense import Dense
from scaletrain.models.kernels.attention import apply_rope

Array = jax.Array


class GatedAttention(Attention):
    """Grouped-query attention whose output is gated per head dimension by a second half of ``q_proj``."""

    def __init__(self, config: Any, dtype: Any, param_dtype: Any, precision: Any, rngs: nnx.Rngs):
        super().__init__(config, dtype, param_dtype, precision, rngs)
        self.q_proj = Dense(config.hidden_size, 2 * self.num_heads * self.head_dim, ("embed", "heads"),
                            use_bias=config.attention_bias, config=config, dtype=dtype, param_dtype=param_dtype,
                            precision=precision, rngs=rngs)

    def _qkv_gate(self, x: Array, rope: tuple[Array, Array]) -> tuple[Array, Array, Array, Array]:
        """Queries, keys (normed per head, then rotated), values and the gate [B, T, heads * D]."""
        b, t, _ = x.shape
        d = self.head_dim
        both = self.q_proj(x).reshape(b, t, self.num_heads, 2 * d)
        q, gate = both[..., :d], both[..., d:]
        k = self.k_proj(x).reshape(b, t, self.num_kv_heads, d)
        v = self.v_proj(x).reshape(b, t, self.num_kv_heads, d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, rope), apply_rope(k, rope), v, gate.reshape(b, t, self.num_heads * d)
