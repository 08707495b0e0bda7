"""GPT-OSS causal decoder in Flax NNX: the shared decoder with GPT-OSS's attention and MoE block.

What differs from Mixtral (:mod:`scaletrain.models.moe_decoder`), each as transformers'
``GptOssForCausalLM`` computes it (the conformance suite holds us to that):

- attention with a learned sink per head in the softmax's denominator and biases on all
  four projections; layers alternate a sliding window and full attention (``layer_types``),
  both with the same YaRN RoPE;
- the router is a linear with a bias; a token's weights are the softmax over its k largest
  router logits (the top-k of the full softmax, renormalised: :func:`scaletrain.models.moe.route`);
- each expert is ``down((up + 1) * glu(gate)) + b`` with ``glu(g) = g * sigmoid(alpha g)``, the gate
  clamped above at ``limit`` and the up projection to ``[-limit, limit]``; gate and up are one
  ``[E, hidden, 2 * inter]`` kernel with their columns interleaved (gate even, up odd), HF's layout,
  so checkpoints map 1:1.
"""

from __future__ import annotations

from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from scaletrain.models.common.decoder import DecoderModel
from scaletrain.models.common.inputs import LayerInputs
from scaletrain.models.common.layers import Attention
from scaletrain.models.common.config import DecoderConfig
from scaletrain.models.common.dense import Dense, RMSNorm, _init
from scaletrain.models.gpt_oss.config import GptOssConfig
from scaletrain.models.kernels.attention import KVCache
from scaletrain.models.common.moe import RouterStats, dispatch, route, router_stats
from scaletrain.models.common.moe_decoder import ROUTER, MoeForCausalLM, MoeModel
from scaletrain.models.common.placement import active_placement

Array = jax.Array


class GptOssAttention(Attention):
    """The shared attention (q/k/v/o biases from ``attention_bias``) with one sink logit per query head."""

    def _sink_param(self, config: DecoderConfig, param_dtype: Any, rngs: nnx.Rngs) -> nnx.Param:
        return nnx.Param(_init(config)(rngs.params(), (config.num_attention_heads,), param_dtype),
                         logical_axes=("heads",))


def clamped_swiglu(gate_up: Array, alpha: float, limit: float) -> Array:
    """GPT-OSS's gated activation of the interleaved ``[..., 2 * inter]`` gate/up columns: ``(up + 1) *
    gate * sigmoid(alpha * gate)``, gate clamped above at ``limit``, up to ``[-limit, limit]``."""
    gate = jnp.minimum(gate_up[..., 0::2], limit)
    up = jnp.clip(gate_up[..., 1::2], -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))


def _row_experts(group_sizes: Array, rows: int) -> tuple[Array, Array]:
    """Each sorted row's expert (clipped to the last) and whether it is assigned at all (rows past the groups
    are not: :func:`scaletrain.models.moe.dispatch_replicated` leaves other devices' experts' rows there)."""
    ends = jnp.cumsum(group_sizes)
    index = jnp.arange(rows, dtype=ends.dtype)
    expert = jnp.searchsorted(ends, index, side="right")
    return jnp.minimum(expert, group_sizes.shape[0] - 1), index < ends[-1]


def grouped_clamped_swiglu(alpha: float, limit: float) -> Any:
    """The :data:`scaletrain.models.moe.GroupedExperts` of GPT-OSS: biased linears around :func:`clamped_swiglu`."""

    def grouped(rows: Array, group_sizes: Array, kernels: tuple[Array, ...], precision: Any) -> Array:
        gate_up, gate_up_bias, down, down_bias = kernels
        expert, assigned = _row_experts(group_sizes, rows.shape[0])
        h = lax.ragged_dot(rows, gate_up, group_sizes, precision=precision) + gate_up_bias[expert]
        out = lax.ragged_dot(clamped_swiglu(h, alpha, limit), down, group_sizes, precision=precision)
        return jnp.where(assigned[:, None], out + down_bias[expert], 0)

    return grouped


class GptOssExperts(nnx.Module):
    """E experts as HF holds them: ``gate_up_proj`` [E, hidden, 2 * inter] (interleaved), ``down_proj``
    [E, inter, hidden], each with a bias [E, out]."""

    def __init__(self, config: GptOssConfig, dtype: Any, param_dtype: Any, rngs: nnx.Rngs):
        e, h, i = config.num_local_experts, config.hidden_size, config.intermediate_size
        init = _init(config)
        self.gate_up_proj = nnx.Param(init(rngs.params(), (e, h, 2 * i), param_dtype),
                                      logical_axes=("expert", "embed", "mlp"))
        self.gate_up_proj_bias = nnx.Param(jnp.zeros((e, 2 * i), param_dtype), logical_axes=("expert", "mlp"))
        self.down_proj = nnx.Param(init(rngs.params(), (e, i, h), param_dtype),
                                   logical_axes=("expert", "mlp", "embed"))
        self.down_proj_bias = nnx.Param(jnp.zeros((e, h), param_dtype), logical_axes=("expert", "embed"))
        self.dtype = dtype

    def kernels(self) -> tuple[Array, ...]:
        """``(gate_up, gate_up_bias, down, down_bias)`` in the compute dtype."""
        return tuple(p[...].astype(self.dtype) for p in
                     (self.gate_up_proj, self.gate_up_proj_bias, self.down_proj, self.down_proj_bias))


class GptOssMLP(nnx.Module):
    """The router (``router``: a linear with a bias) and :class:`GptOssExperts`, HF's ``mlp.*`` names."""

    def __init__(self, config: GptOssConfig, dtype: Any, param_dtype: Any, precision: Any, rngs: nnx.Rngs):
        self.router = Dense(config.hidden_size, config.num_local_experts, ("embed", None), use_bias=True,
                            config=config, dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)
        self.experts = GptOssExperts(config, dtype, param_dtype, rngs)
        self.top_k = config.num_experts_per_tok
        self.grouped = grouped_clamped_swiglu(config.swiglu_alpha, config.swiglu_limit)
        self.precision = precision

    def __call__(self, x: Array, valid: Array) -> tuple[Array, RouterStats]:
        logits = self.router(x)
        weights, experts, probs = route(logits, self.top_k, True)
        out = dispatch(x, experts, weights, self.experts.kernels(), self.precision,
                       active_placement().partition_axis, self.grouped)
        return out.astype(x.dtype), router_stats(logits, probs, experts, valid)


class GptOssDecoderLayer(nnx.Module):
    """Pre-norm residual block: sink attention, then the biased mixture of experts."""

    def __init__(self, config: GptOssConfig, dtype: Any, param_dtype: Any, precision: Any, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, param_dtype)
        self.self_attn = GptOssAttention(config, dtype, param_dtype, precision, rngs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, param_dtype)
        self.mlp = GptOssMLP(config, dtype, param_dtype, precision, rngs)

    @classmethod
    def aux_shapes(cls, config: Any) -> dict[str, RouterStats]:
        """One layer's router statistics (as every mixture of experts)."""
        per_expert = jax.ShapeDtypeStruct((config.num_local_experts,), jnp.float32)
        scalar = jax.ShapeDtypeStruct((), jnp.float32)
        return {ROUTER: RouterStats(counts=per_expert, prob_sums=per_expert, z_sums=scalar, rows=scalar)}

    def __call__(self, x: Array, inputs: LayerInputs,
                 cache: KVCache | None = None) -> tuple[Array, dict[str, RouterStats], KVCache | None]:
        attn, cache = self.self_attn(self.input_layernorm(x), inputs, cache)
        x = x + attn
        out, stats = self.mlp(self.post_attention_layernorm(x), inputs.valid)
        return x + out, {ROUTER: stats}, cache


class GptOssModel(MoeModel):
    """Embeddings, GPT-OSS decoder layers and the final norm (HF's ``model.*`` names)."""

    config_class: ClassVar[type[DecoderConfig]] = GptOssConfig
    layer_class: ClassVar[type[nnx.Module]] = GptOssDecoderLayer


class GptOssForCausalLM(MoeForCausalLM):
    """GPT-OSS with its (untied) head; its layers' kinds (sliding window or full, one RoPE) come from
    ``layer_types`` (:mod:`scaletrain.models.common.layer_types`)."""

    config_class: ClassVar[type[DecoderConfig]] = GptOssConfig
    base_model_class: ClassVar[type[DecoderModel]] = GptOssModel
