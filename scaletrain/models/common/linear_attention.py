"""Gated DeltaNet: the linear-attention token mixer of Qwen3.5 / Qwen3-Next's hybrid layers.

Why a shared layer: every family with linear-attention layers (Qwen3.5 dense and MoE, Qwen3-Next)
runs the same mixer: one projection to queries, keys and values, a short causal depthwise
convolution over them, the gated delta rule (:mod:`scaletrain.models.common.gated_delta_rule`), a
gated RMSNorm of its output and the output projection. Parameter names are transformers'
(``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``, ``conv1d``, ``dt_bias``, ``A_log``,
``norm``, ``out_proj``), so checkpoints map one to one. Heads are sharded over ``tp`` like attention's.

The layer reads the config fields transformers names ``linear_num_key_heads``,
``linear_num_value_heads``, ``linear_key_head_dim``, ``linear_value_head_dim``,
``linear_conv_kernel_dim`` and ``rms_norm_eps``. Its decode cache is a :class:`LinearState`: a
fixed-size convolution window and recurrent state, whatever the sequence length.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from scaletrain.errors import ConfigError
from scaletrain.models.common.gated_delta_rule import (
    causal_conv,
    chunk_gated_delta_rule,
    conv_state_after,
    recurrent_gated_delta_rule,
)
from scaletrain.models.common.inputs import LayerInputs
from scaletrain.models.common.dense import Dense
from scaletrain.models.common.placement import active_placement
from scaletrain.parallel.partition import active_axis_size

Array = jax.Array


class LinearState(NamedTuple):
    """One linear-attention layer's decode cache: the last K-1 convolution inputs [B, K-1, C] and the
    recurrent state [B, Hv, Dk, Dv] (float32), the same size at every position."""

    conv: Array
    recurrent: Array


class GatedRMSNorm(nnx.Module):
    """``weight * rms_norm(x)`` (cast back to x's dtype) times ``silu(gate)`` in float32, as transformers'
    ``RMSNormGated``: the weight starts at one (not Gemma's 1 + w)."""

    def __init__(self, dim: int, eps: float, dtype: Any, param_dtype: Any):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype), logical_axes=("norm",))
        self.eps, self.dtype = eps, dtype

    def __call__(self, x: Array, gate: Array) -> Array:
        x32 = x.astype(jnp.float32)
        normed = (x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)).astype(x.dtype)
        out = self.weight[...].astype(jnp.float32) * normed.astype(jnp.float32)
        return (out * jax.nn.silu(gate.astype(jnp.float32))).astype(self.dtype)


class DepthwiseConv(nnx.Module):
    """The short causal convolution's weight, [channels, 1, kernel] as transformers' ``nn.Conv1d`` keeps it."""

    def __init__(self, channels: int, kernel: int, param_dtype: Any, rngs: nnx.Rngs):
        bound = kernel ** -0.5  # torch's default for a depthwise Conv1d (fan_in = kernel)
        self.weight = nnx.Param(jax.random.uniform(rngs.params(), (channels, 1, kernel), param_dtype, -bound, bound),
                                logical_axes=("heads", "norm", "norm"))

    @property
    def taps(self) -> Array:
        """The weight as [channels, kernel] float32."""
        return self.weight[...][:, 0, :].astype(jnp.float32)


class GatedDeltaNet(nnx.Module):
    """Gated DeltaNet with transformers' parameter names; ``__call__(x, inputs, cache)`` like attention's."""

    def __init__(self, config: Any, dtype: Any, param_dtype: Any, precision: Any, rngs: nnx.Rngs):
        h = config.hidden_size
        self.num_k_heads, self.num_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_dim, self.value_dim = self.num_k_heads * self.head_k_dim, self.num_v_heads * self.head_v_dim
        self.kernel_size = config.linear_conv_kernel_dim
        kw = dict(config=config, dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)
        self._projections(h, kw)
        self.conv1d = DepthwiseConv(self.conv_dim, self.kernel_size, param_dtype, rngs)
        self.dt_bias = nnx.Param(jnp.ones((self.num_v_heads,), param_dtype), logical_axes=("heads",))
        decay = jax.random.uniform(rngs.params(), (self.num_v_heads,), jnp.float32, 0.01, 16.0)
        self.A_log = nnx.Param(jnp.log(decay).astype(param_dtype), logical_axes=("heads",))
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps, dtype, param_dtype)
        self.out_proj = Dense(self.value_dim, h, ("heads", "embed"), use_bias=False, **kw)
        self.dtype = dtype

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: queries, keys and values side by side."""
        return 2 * self.key_dim + self.value_dim

    def _projections(self, h: int, kw: dict[str, Any]) -> None:
        """Qwen3.5's four input projections (Qwen3-Next fuses them in two: its subclass overrides this)."""
        self.in_proj_qkv = Dense(h, self.conv_dim, ("embed", "heads"), use_bias=False, **kw)
        self.in_proj_z = Dense(h, self.value_dim, ("embed", "heads"), use_bias=False, **kw)
        self.in_proj_b = Dense(h, self.num_v_heads, ("embed", "heads"), use_bias=False, **kw)
        self.in_proj_a = Dense(h, self.num_v_heads, ("embed", "heads"), use_bias=False, **kw)

    def project(self, x: Array) -> tuple[Array, Array, Array, Array]:
        """``(qkv [B, T, conv_dim], z [B, T, Hv, Dv], b [B, T, Hv], a [B, T, Hv])`` from ``x`` [B, T, hidden]."""
        b, t, _ = x.shape
        z = self.in_proj_z(x).reshape(b, t, self.num_v_heads, self.head_v_dim)
        return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)

    def empty_state(self, batch: int, dtype: Any) -> LinearState:
        """A zero :class:`LinearState` for ``batch`` rows (convolution inputs in ``dtype``)."""
        return LinearState(jnp.zeros((batch, self.kernel_size - 1, self.conv_dim), dtype),
                           jnp.zeros((batch, self.num_v_heads, self.head_k_dim, self.head_v_dim), jnp.float32))

    def __call__(self, x: Array, inputs: LayerInputs,
                 cache: LinearState | None = None) -> tuple[Array, LinearState | None]:
        """The mixer's output [B, T, hidden] and the updated state (None without a cache).

        ``inputs.segment_ids`` [B, T] restart the convolution and the recurrence where they change
        (packed documents, left padding); with a cache, T > 1 is a prefill continuing the cached state
        by the chunked rule and T = 1 a decode step by the recurrent one.
        """
        if active_axis_size(active_placement().partition_axis.sequence_axis) > 1:
            raise ConfigError("sharding_axis_dims (a recipe's mesh.axis_dims): linear-attention layers (Gated "
                              "DeltaNet) need whole sequences; set the sp axis to 1")
        b, t, _ = x.shape
        doc = inputs.segment_ids
        qkv, z, beta_in, a = self.project(x)
        taps = self.conv1d.taps
        conv_in = None if cache is None else cache.conv
        mixed = causal_conv(qkv, taps, doc, conv_in)
        q, k, v = jnp.split(mixed, [self.key_dim, 2 * self.key_dim], axis=-1)
        q = q.reshape(b, t, self.num_k_heads, self.head_k_dim)
        k = k.reshape(b, t, self.num_k_heads, self.head_k_dim)
        v = v.reshape(b, t, self.num_v_heads, self.head_v_dim)
        beta = jax.nn.sigmoid(beta_in.astype(jnp.float32))
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(
            a.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32))
        if cache is not None and t == 1:
            out, state = recurrent_gated_delta_rule(q, k, v, g, beta, cache.recurrent)
        else:
            out, state = chunk_gated_delta_rule(q, k, v, g, beta, doc, None if cache is None else cache.recurrent)
        if cache is not None:
            cache = LinearState(conv_state_after(qkv, doc, cache.conv, self.kernel_size).astype(cache.conv.dtype),
                                state)
        out = self.norm(out, z).reshape(b, t, self.value_dim)
        return self.out_proj(out), cache
