"""The attention and gated-MLP layers every family's block is made of (Gemma 3 adjusts them by hooks).

Attention takes an optional key/value cache, so a block is written once: the training
forward calls it without a cache, decoding with one (the new keys and values are written
into the fixed-size cache first, so one compiled step serves every position). The
projections carry Hugging Face's names (``q_proj`` ... ``down_proj``): checkpoints map 1:1.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from scaletrain.errors import ConfigError
from scaletrain.models.kernels.attention import (
    KVCache,
    PackedSegments,
    apply_rope,
    rope_attention_factor,
    causal_blocks,
    dot_product_attention,
    fused_attention,
    use_fused_attention,
)
from scaletrain.models.common.inputs import LayerInputs
from scaletrain.models.common.config import DecoderConfig
from scaletrain.models.common.dense import Dense, RMSNorm
from scaletrain.models.kernels.flash_attention import ATTENTION_OUTPUT
from scaletrain.models.kernels.paged_attention import PagedKVCache, gather_pages, write_token
from scaletrain.models.kernels.paged_kernel import paged_decode_attention, use_paged_kernel
from scaletrain.models.kernels.flash_sharding import sharded_flash_attention
from scaletrain.models.kernels.fp8 import glu_product
from scaletrain.models.common.placement import active_placement
from scaletrain.parallel.partition import active_axis_size, active_platform

Array = jax.Array


def paged_attention(q: Array, cache: PagedKVCache, inputs: LayerInputs, softmax_dtype: Any, precision: Any,
                    scale: float | None, sinks: Array | None = None, value_dim: int | None = None) -> Array:
    """One query per slot [slots, 1, heads, D] over its pages (after its own token was written): the Pallas
    kernel that walks the page table on GPU (:mod:`~scaletrain.models.kernels.paged_kernel`), else the
    pages gathered by XLA and the einsum attention. ``value_dim``: a keys-only pool's value width."""
    d = q.shape[-1]
    scale = 1.0 / d**0.5 if scale is None else scale
    if use_paged_kernel():
        return paged_decode_attention(q, cache, inputs.pages, inputs.mask, scale=scale, sinks=sinks,
                                      value_dim=value_dim)
    keys, values = gather_pages(cache, inputs.pages.table)
    if values is None:
        values = keys[..., :value_dim]
    return dot_product_attention(q, keys, values, inputs.mask, softmax_dtype, precision, scale=scale,
                                 pin_keys=active_platform() == "cpu", sinks=sinks)


class Attention(nnx.Module):
    """Grouped-query attention with RoPE, optional q/k/v(/o) biases and per-head q/k norms."""

    def __init__(self, config: DecoderConfig, dtype: Any, param_dtype: Any, precision: Any, rngs: nnx.Rngs):
        h, d = config.hidden_size, config.head_dim
        nq, nkv = config.num_attention_heads, config.num_key_value_heads
        qkv_bias = config.attention_bias or config.qkv_bias
        kw = dict(config=config, dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)
        self.q_proj = Dense(h, nq * d, ("embed", "heads"), use_bias=qkv_bias, **kw)
        self.k_proj = Dense(h, nkv * d, ("embed", "kv_heads"), use_bias=qkv_bias, **kw)
        self.v_proj = Dense(h, nkv * d, ("embed", "kv_heads"), use_bias=qkv_bias, **kw)
        self.o_proj = Dense(nq * d, h, ("heads", "embed"), use_bias=config.attention_bias, **kw)
        self.q_norm = self._head_norm(config, dtype, param_dtype)
        self.k_norm = self._head_norm(config, dtype, param_dtype)
        # softmax scale; None is 1/sqrt(head_dim) (Gemma 3 sets query_pre_attn_scalar ** -0.5); YaRN's attention
        # factor scales the rotated queries and keys, so the scores by its square (unless it differs by layer
        # type: then each kind's RoPE tables carry it, models/common/inputs.py's LayerKind)
        factor = 1.0 if getattr(config, "rope_factor_per_layer_type", False) else rope_attention_factor(config)
        self.scale: float | None = None if factor == 1.0 else factor**2 / d**0.5
        # one learned logit per query head in every softmax's denominator (GPT-OSS); None: none
        self.sinks = self._sink_param(config, param_dtype, rngs)
        self.num_heads, self.num_kv_heads, self.head_dim = nq, nkv, d
        self.dtype = dtype
        self.precision = precision

    # the placement is the active one (the forward's), read when the layer runs: never a copy of its own
    @property
    def softmax_dtype(self) -> Any:
        """The dtype of the attention scores and softmax (``attn_softmax_dtype``; float32 by default)."""
        return jnp.dtype(active_placement().attn_softmax_dtype or "float32")

    @property
    def mechanism(self) -> str:
        """The attention kernel asked for (``attn_mechanism``)."""
        return active_placement().attn_mechanism

    @property
    def sequence_axis(self) -> Any:
        """The mesh axes the sequence is split over (sp: context parallelism)."""
        return active_placement().partition_axis.sequence_axis

    @property
    def batch_axis(self) -> Any:
        """The mesh axes the batch is split over."""
        return active_placement().partition_axis.batch_axis

    @property
    def head_axes(self) -> tuple[Any, Any]:
        """The mesh axes of the query heads and of the key/value heads."""
        pa = active_placement().partition_axis
        return pa.head_axis, pa.kv_head_axis

    def __call__(self, x: Array, inputs: LayerInputs, cache: KVCache | None = None) -> tuple[Array, KVCache | None]:
        """Self-attention over ``x`` and the updated cache (None without one).

        Without a cache ``inputs.mask`` is the [B, 1, T, S] mask, the segment ids
        (:class:`PackedSegments`: the flash kernel), a :class:`CausalWindow` or None (plain
        causal). With one, ``x`` sits at cache slots ``[inputs.start, inputs.start + T)``
        and ``inputs.mask`` [B, 1, T, S] hides the slots that are empty, padding, in the
        future or outside the window. With a :class:`PagedKVCache` (the continuous-batching engine)
        ``x`` is one token per slot, written at ``inputs.pages``' position and attending over the
        slot's pages.
        """
        b, t, _ = x.shape
        q, k, v, gate = self._qkv_gate(x, inputs.rope)
        if isinstance(cache, PagedKVCache):  # one decode step per slot over its pages (inputs.pages)
            cache = write_token(cache, k[:, 0], v[:, 0], inputs.pages)
            out = paged_attention(q, cache, inputs, self.softmax_dtype, self.precision, self.scale,
                                  self._sink_logits())
        elif cache is not None:
            keys = lax.dynamic_update_slice_in_dim(cache.keys, k.astype(cache.keys.dtype), inputs.start, axis=1)
            values = lax.dynamic_update_slice_in_dim(cache.values, v.astype(cache.values.dtype), inputs.start, axis=1)
            cache = KVCache(keys, values)
            if inputs.mask.shape[-1] == t:  # a prefill: the cache held nothing before these tokens
                out = self._attend(q, k, v, inputs.mask)
            else:
                out = dot_product_attention(q, keys, values, inputs.mask, self.softmax_dtype, self.precision,
                                            scale=self.scale, pin_keys=active_platform() == "cpu",
                                            sinks=self._sink_logits())
        else:
            out = checkpoint_name(self._attend(q, k, v, inputs.mask), ATTENTION_OUTPUT)
        out = out.reshape(b, t, -1)  # values may be narrower than keys (multi-head latent attention)
        if gate is not None:  # gated attention (Qwen3.5, Qwen3-Next): an output gate per head dimension
            out = (out * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(out.dtype)
        return self.o_proj(out), cache

    def _attend(self, q: Array, k: Array, v: Array, mask: Any) -> Array:
        """The training attention: the flash kernel, cuDNN, or the einsum path (see ``training_mechanism``)."""
        sequence_split = active_axis_size(self.sequence_axis) > 1
        sinks = self._sink_logits()
        if isinstance(mask, PackedSegments):  # the flash kernel (see flash_sharding.training_mechanism)
            if sinks is not None:
                raise ConfigError("model.attn_mechanism: 'pallas' does not compute attention sinks (gpt_oss); "
                                  "use 'auto'")
            if problem := self._head_split_problem():
                raise ConfigError(f"model.attn_mechanism: 'pallas' {problem}; use 'auto'")
            return sharded_flash_attention(q, k, v, mask.ids, scale=self.scale, batch_axis=self.batch_axis,
                                           sequence_axis=self.sequence_axis, head_axis=self.head_axes[0],
                                           kv_head_axis=self.head_axes[1], window=mask.window, zigzag=mask.zigzag)
        if sinks is not None and self.mechanism == "cudnn":
            raise ConfigError("model.attn_mechanism: 'cudnn' does not compute attention sinks (gpt_oss); use 'auto'")
        if sinks is None and use_fused_attention(self.mechanism, q.dtype, self.head_dim,
                                                 self._cudnn_sharding_problem(sequence_split)):
            return fused_attention(q, k, v, mask, scale=self.scale)
        # query blocks slice the sequence: not where it is split over devices (sp)
        t = q.shape[1]
        blocks = 1 if sequence_split else causal_blocks(t, t)
        return dot_product_attention(q, k, v, mask, self.softmax_dtype, self.precision, blocks=blocks,
                                     scale=self.scale, sinks=sinks)

    def _sink_logits(self) -> Array | None:
        """The attention sinks [heads] in float32, or None for a layer without."""
        return None if self.sinks is None else self.sinks[...].astype(jnp.float32)

    def _sink_param(self, config: DecoderConfig, param_dtype: Any, rngs: nnx.Rngs) -> nnx.Param | None:
        """The attention sinks [heads] of a family that has them (GPT-OSS), else None."""
        return None

    def _head_norm(self, config: DecoderConfig, dtype: Any, param_dtype: Any) -> nnx.Module | None:
        """Qwen3's norm over head_dim for q or k, applied before RoPE (None unless ``qk_norm``)."""
        return RMSNorm(config.head_dim, config.rms_norm_eps, dtype, param_dtype) if config.qk_norm else None

    def _qkv_gate(self, x: Array, rope: tuple[Array, Array]) -> tuple[Array, Array, Array, Array | None]:
        """:meth:`_qkv` and the output gate [B, T, heads * D] (None: no gate; gated attention sets one)."""
        return (*self._qkv(x, rope), None)

    def _qkv(self, x: Array, rope: tuple[Array, Array]) -> tuple[Array, Array, Array]:
        """Queries, keys (normed per head when ``qk_norm``, then rotated) and values [B, T, heads, D]."""
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, rope), apply_rope(k, rope), v

    def _cudnn_sharding_problem(self, sequence_split: bool) -> str | None:
        """Why JAX's cuDNN attention cannot take this layer's inputs as the active mesh shards
        them (its partitioner needs whole sequences and evenly split heads), or None."""
        if sequence_split:
            return "cannot attend over a sequence split across devices (mesh axis sp > 1)"
        return self._head_split_problem()

    def _head_split_problem(self) -> str | None:
        """Why the heads do not split evenly over the active mesh's head axes (tp), or None."""
        q_split, kv_split = (active_axis_size(a) for a in self.head_axes)
        if self.num_heads % q_split or self.num_kv_heads % kv_split:
            return (f"needs the {self.num_heads} query and {self.num_kv_heads} key/value heads to split evenly "
                    f"over the {q_split} / {kv_split} devices of the head axes (tp)")
        return None


class MLP(nnx.Module):
    """Gated feed-forward ``down(act(gate(x)) * up(x))``: SwiGLU; a family sets ``activation`` (Gemma: GeGLU)."""

    activation: Callable[[Array], Array] = staticmethod(jax.nn.silu)

    def __init__(self, config: DecoderConfig, dtype: Any, param_dtype: Any, precision: Any, rngs: nnx.Rngs,
                 intermediate_size: int | None = None):
        # ``intermediate_size``: a width other than the config's (a mixture of experts' shared experts)
        h, i = config.hidden_size, intermediate_size or config.intermediate_size
        kw = dict(config=config, dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)
        self.gate_proj = Dense(h, i, ("embed", "mlp"), use_bias=config.mlp_bias, **kw)
        self.up_proj = Dense(h, i, ("embed", "mlp"), use_bias=config.mlp_bias, **kw)
        self.down_proj = Dense(i, h, ("mlp", "embed"), use_bias=config.mlp_bias, **kw)

    def __call__(self, x: Array) -> Array:
        return self.down_proj(glu_product(self.activation, self.gate_proj(x), self.up_proj(x), self.down_proj.fp8))
