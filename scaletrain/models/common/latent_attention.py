"""Multi-head latent attention (MLA): DeepSeek-V2/V3's attention, Kimi K2's.

What it is: the keys and values of every head are expanded from one compressed latent per
token (``kv_a_proj_with_mqa`` -> RMSNorm -> ``kv_b_proj``), the queries optionally from a
low-rank one too (``q_lora_rank``: ``q_a_proj`` -> RMSNorm -> ``q_b_proj``; else ``q_proj``).
Position enters through a separate part of each head: ``qk_rope_head_dim`` dims of the
query per head and one rotated key part shared by all heads (the "decoupled" RoPE), after
``qk_nope_head_dim`` dims without position. Values are ``v_head_dim`` wide, so the heads'
query/key and value widths differ. The softmax scale is ``(nope + rope) ** -0.5``, times
YaRN's ``mscale ** 2`` when the config's RoPE is YaRN with ``mscale_all_dim`` (DeepSeek-V3's
published config); YaRN's attention factor (``mscale / mscale_all_dim``) scales the rotated parts.
``rope_interleave`` (DeepSeek's checkpoints) rotates interleaved pairs
``(x0, x1), (x2, x3) ...``: computed here as the half-split rotation of the de-interleaved
dims, which is what transformers does too (the dot products are the same either way).

The layer is :class:`~scaletrain.models.common.layers.Attention` with its own projections:
the cache update, the decode path and the training kernels' choice are that class's. The
decode cache holds the expanded per-head keys and values (``[B, S, heads, nope + rope]`` and
``[B, S, heads, v_head_dim]``), not the compressed latent (see docs/hf.md for what that costs).
Heads are split over ``tp`` like every attention's; the latent projections are replicated.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from scaletrain.errors import ConfigError
from scaletrain.models.common.dense import Dense, RMSNorm
from scaletrain.models.common.layers import Attention, paged_attention
from scaletrain.models.kernels.attention import (
    KVCache,
    PackedSegments,
    apply_rope,
    causal_blocks,
    dot_product_attention,
    rope_attention_factor,
)
from scaletrain.models.common.inputs import LayerInputs
from scaletrain.models.kernels.paged_attention import PagedKVCache, write_token
from scaletrain.parallel.partition import active_axis_size, active_platform

Array = jax.Array
#: the latent norms' epsilon: transformers builds them with its RMSNorm default, not ``rms_norm_eps``
LATENT_NORM_EPS = 1e-6


def yarn_mscale(scale: float, mscale: float) -> float:
    """DeepSeek's YaRN attention multiplier ``0.1 * mscale * ln(scale) + 1`` (1 for ``scale <= 1``)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(config: Any) -> float:
    """``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``, times ``yarn_mscale(factor, mscale_all_dim) ** 2``
    when the RoPE scaling is not the default one and sets ``mscale_all_dim``."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type", "default") != "default" and scaling.get("mscale_all_dim"):
        m = yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"]))
        scale = scale * m * m
    return scale


def deinterleave(x: Array) -> Array:
    """``(x0, x1, x2, x3, ...)`` -> ``(x0, x2, ..., x1, x3, ...)``: interleaved RoPE pairs as half-split."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


class LatentAttention(Attention):
    """Multi-head latent attention with transformers' DeepSeek-V3 parameter names (module docstring)."""

    def __init__(self, config: Any, dtype: Any, param_dtype: Any, precision: Any, rngs: nnx.Rngs):
        h, n = config.hidden_size, config.num_attention_heads
        self.nope, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        qk = self.nope + self.rope_dim
        bias = config.attention_bias
        kw = dict(config=config, dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)
        rank = config.q_lora_rank
        self.q_proj = Dense(h, n * qk, ("embed", "heads"), use_bias=False, **kw) if rank is None else None
        self.q_a_proj = Dense(h, rank, ("embed", None), use_bias=bias, **kw) if rank else None
        self.q_a_layernorm = RMSNorm(rank, LATENT_NORM_EPS, dtype, param_dtype) if rank else None
        self.q_b_proj = Dense(rank, n * qk, (None, "heads"), use_bias=False, **kw) if rank else None
        self.kv_a_proj_with_mqa = Dense(h, config.kv_lora_rank + self.rope_dim, ("embed", None), use_bias=bias, **kw)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, LATENT_NORM_EPS, dtype, param_dtype)
        self.kv_b_proj = Dense(config.kv_lora_rank, n * (self.nope + self.v_dim), (None, "heads"), use_bias=False,
                               **kw)
        self.o_proj = Dense(n * self.v_dim, h, ("heads", "embed"), use_bias=bias, **kw)
        self.q_norm = self.k_norm = None
        self.sinks = None  # no attention sinks (GPT-OSS's)
        self.scale: float | None = softmax_scale(config)
        self.interleave = bool(config.rope_interleave)
        # YaRN's attention factor scales the rotated parts only (transformers scales cos and sin), not the scores
        self.rope_factor = rope_attention_factor(config)
        # every head has its own keys and values once expanded: the cache and the kernels see plain MHA
        self.num_heads = self.num_kv_heads = n
        self.head_dim = qk
        self.dtype = dtype
        self.precision = precision

    def _rotate(self, x: Array, rope: tuple[Array, Array]) -> Array:
        rotated = apply_rope(deinterleave(x) if self.interleave else x, rope)
        return rotated if self.rope_factor == 1.0 else rotated * jnp.asarray(self.rope_factor, rotated.dtype)

    def _project(self, x: Array, rope: tuple[Array, Array]) -> tuple[Array, Array, Array]:
        """Queries [B, T, heads, nope + rope] (the last ``rope`` dims rotated), the normed latent [B, T, rank]
        and the rotated shared key [B, T, 1, rope]."""
        b, t, _ = x.shape
        q_flat = self.q_proj(x) if self.q_proj is not None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q_flat.reshape(b, t, self.num_heads, self.nope + self.rope_dim)
        latent, k_rot = jnp.split(self.kv_a_proj_with_mqa(x), [self.kv_a_layernorm.weight.shape[0]], axis=-1)
        q = jnp.concatenate([q[..., :self.nope], self._rotate(q[..., self.nope:], rope)], axis=-1)
        return q, self.kv_a_layernorm(latent), self._rotate(k_rot[:, :, None, :], rope)

    def _expand(self, latent: Array, k_rot: Array) -> tuple[Array, Array]:
        """Per-head keys [B, S, heads, nope + rope] and values [B, S, heads, v] of normed latents [B, S, rank]
        and rotated shared keys [B, S, 1, rope]."""
        b, s, _ = latent.shape
        n = self.num_heads
        kv = self.kv_b_proj(latent).reshape(b, s, n, self.nope + self.v_dim)
        k_nope, v = kv[..., :self.nope], kv[..., self.nope:]
        k_rot = jnp.broadcast_to(k_rot, (b, s, n, self.rope_dim)).astype(k_nope.dtype)
        return jnp.concatenate([k_nope, k_rot], axis=-1), v

    def _qkv(self, x: Array, rope: tuple[Array, Array]) -> tuple[Array, Array, Array]:
        """Queries and keys [B, T, heads, nope + rope] (position in their last ``rope`` dims), values
        [B, T, heads, v_head_dim]."""
        q, latent, k_rot = self._project(x, rope)
        return (q, *self._expand(latent, k_rot))

    def __call__(self, x: Array, inputs: LayerInputs, cache: KVCache | PagedKVCache | None = None
                 ) -> tuple[Array, KVCache | PagedKVCache | None]:
        """:class:`Attention`'s call, and over a latent cache (``values`` None; module docstring): write the
        tokens' latent entries, then attend (a prefill over its own expanded keys, a decode step absorbed)."""
        if cache is None or cache.values is not None:
            return super().__call__(x, inputs, cache)
        b, t, _ = x.shape
        q, latent, k_rot = self._project(x, inputs.rope)
        entry = jnp.concatenate([latent[:, :, None, :], k_rot.astype(latent.dtype)], axis=-1)
        if isinstance(cache, PagedKVCache):
            cache = write_token(cache, entry[:, 0], None, inputs.pages)
            out = self.absorbed_attention(q, cache, inputs)
        else:
            keys = lax.dynamic_update_slice_in_dim(cache.keys, entry.astype(cache.keys.dtype), inputs.start, axis=1)
            cache = KVCache(keys, None)
            if inputs.mask.shape[-1] == t:  # a prefill: attend over the new tokens' own expanded keys
                out = self._attend(q, *self._expand(latent, k_rot), inputs.mask)
            else:
                out = self.absorbed_attention(q, keys, inputs)
        return self.o_proj(out.reshape(b, t, -1)), cache

    def value_key_weights(self) -> tuple[Array, Array]:
        """``kv_b_proj``'s key and value halves per head, [rank, heads, nope] and [rank, heads, v], in the compute
        dtype (a LoRA or quantised projection: its effective weight, the projection of the identity)."""
        rank = self.kv_a_layernorm.weight.shape[0]
        if type(self.kv_b_proj) is Dense and not self.kv_b_proj.fp8:
            w = self.kv_b_proj.kernel[...].astype(self.dtype)
        else:
            w = self.kv_b_proj(jnp.eye(rank, dtype=self.dtype))
        w = w.reshape(rank, self.num_heads, self.nope + self.v_dim)
        return w[..., :self.nope], w[..., self.nope:]

    def absorbed_attention(self, q: Array, cache: Array | PagedKVCache, inputs: LayerInputs) -> Array:
        """Attention of queries [B, T, heads, nope + rope] over latent entries (``cache``: [B, S, 1, rank + rope],
        or a keys-only page pool read through ``inputs.pages``): the queries' no-position part goes through
        ``kv_b_proj``'s key half into latent space, every head attends over the shared entries (one key/value
        head: MQA) with the latent as values, and the value half maps the result to [B, T, heads, v]."""
        w_k, w_v = self.value_key_weights()
        rank = w_k.shape[0]
        q_lat = jnp.einsum("btnd,rnd->btnr", q[..., :self.nope].astype(self.dtype), w_k, precision=self.precision)
        q_abs = jnp.concatenate([q_lat, q[..., self.nope:].astype(q_lat.dtype)], axis=-1)
        if isinstance(cache, PagedKVCache):
            out = paged_attention(q_abs, cache, inputs, self.softmax_dtype, self.precision, self.scale,
                                  value_dim=rank)
        else:
            entries = cache.astype(q_abs.dtype)
            out = dot_product_attention(q_abs, entries, entries[..., :rank], inputs.mask, self.softmax_dtype,
                                        self.precision, scale=self.scale, pin_keys=active_platform() == "cpu")
        return jnp.einsum("btnr,rnv->btnv", out.astype(self.dtype), w_v, precision=self.precision)

    def expanded_attention(self, q: Array, entries: Array, mask: Array) -> Array:
        """What :meth:`absorbed_attention` computes, by expanding every cached entry into per-head keys and
        values first (the form it is measured against: ``bench/mla_decode.py``)."""
        rank = self.kv_a_layernorm.weight.shape[0]
        keys, values = self._expand(entries[:, :, 0, :rank], entries[:, :, :, rank:])
        return dot_product_attention(q, keys, values, mask, self.softmax_dtype, self.precision, scale=self.scale,
                                     pin_keys=active_platform() == "cpu")

    def _attend(self, q: Array, k: Array, v: Array, mask: Any) -> Array:
        """The einsum path (float32 softmax, causal blocks): cuDNN's fused kernel and the flash kernel take
        values as wide as the keys only."""
        if isinstance(mask, PackedSegments):
            raise ConfigError("model.attn_mechanism: 'pallas' does not run multi-head latent attention (values "
                              "narrower than keys); use 'auto'")
        t = q.shape[1]
        blocks = 1 if active_axis_size(self.sequence_axis) > 1 else causal_blocks(t, t)
        return dot_product_attention(q, k, v, mask, self.softmax_dtype, self.precision, blocks=blocks,
                                     scale=self.scale)

    @staticmethod
    def cache_shapes(config: Any, batch: int, length: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The expanded decode cache's key and value shapes for one layer."""
        n = config.num_attention_heads
        return ((batch, length, n, config.qk_nope_head_dim + config.qk_rope_head_dim),
                (batch, length, n, config.v_head_dim))

    @staticmethod
    def latent_width(config: Any) -> int:
        """One token's latent cache entry: the normed latent and the rotated shared key."""
        return config.kv_lora_rank + config.qk_rope_head_dim
