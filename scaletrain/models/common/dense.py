"""The decoder's two elementary modules: a linear projection and RMSNorm.

Every family (Llama, Gemma 3's projections, the MoE router and LoRA's adapted layers)
builds on these, so they sit apart from any one block. Parameters are float32 by default
(``param_dtype``) and cast to the compute ``dtype`` at use; each carries ``logical_axes``
for :mod:`scaletrain.parallel.partition`. The config is read only to initialise; how the
matmul runs (FP8 or not) is the active placement's (:mod:`scaletrain.models.common.placement`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from scaletrain.models.common.config import DecoderConfig
from scaletrain.models.kernels.cpu_dots import matmul
from scaletrain.models.kernels.fp8 import fp8_layer, fp8_matmul
from scaletrain.models.common.placement import active_placement

Array = jax.Array


def _init(config: DecoderConfig, scale: float = 1.0) -> Any:
    return nnx.initializers.normal(stddev=config.initializer_range * scale)


class Dense(nnx.Module):
    """``x @ kernel (+ bias)`` with a [in, out] kernel kept in param_dtype and used in dtype."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        axes: tuple[str, str],
        *,
        use_bias: bool,
        config: DecoderConfig,
        dtype: Any,
        param_dtype: Any,
        precision: Any,
        rngs: nnx.Rngs,
        init_scale: float = 1.0,
    ):
        self.kernel = nnx.Param(
            _init(config, init_scale)(rngs.params(), (in_features, out_features), param_dtype),
            logical_axes=axes,
        )
        self.bias = (
            nnx.Param(jnp.zeros((out_features,), param_dtype), logical_axes=(axes[1],)) if use_bias else None
        )
        self.dtype = dtype
        self.precision, self.axes = precision, axes

    @property
    def fp8(self) -> bool:
        """Whether this layer's matmul runs in FP8 under the active placement (read per call: see
        :func:`fp8_layer`)."""
        return fp8_layer(active_placement(), self.axes)

    def __call__(self, x: Array) -> Array:
        dot = fp8_matmul if self.fp8 else matmul
        y = dot(x.astype(self.dtype), self.kernel[...].astype(self.dtype), precision=self.precision)
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y


class RMSNorm(nnx.Module):
    """Root-mean-square norm computed in float32 (as transformers does), scaled in float32."""

    def __init__(self, dim: int, eps: float, dtype: Any, param_dtype: Any):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype), logical_axes=("norm",))
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x: Array) -> Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (self.weight[...].astype(jnp.float32) * x32).astype(self.dtype)
