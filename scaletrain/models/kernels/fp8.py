"""FP8 projection matmuls: e4m3 operands forward, e5m2 gradient backward, current per-tensor scaling.

Hopper's FP8 tensor cores are reached through XLA, not through a kernel of ours: every
dot here is a ``lax.dot_general`` whose operands *are* the FP8 arrays, accumulating in
float32 (``preferred_element_type``), and the product is then multiplied by the two
operands' float32 scales and cast to the compute dtype. XLA's GPU backend compiles such
a dot into a GEMM fusion with ``f8e4m3fn`` / ``f8e5m2`` parameters (FP8 tensor cores).

Why not the textbook "dequantise, then dot" (``convert(q) * scale`` on each operand,
then a bf16 dot, which XLA's ``GemmRewriter`` is documented to fold into a cuBLASLt FP8
GEMM): measured by compiling the 1B train step for an H100, XLA's algebraic simplifier
removes the bf16 -> f8 -> bf16 round trip first (``xla_allow_excess_precision``, on by
default), so the GEMMs ended up in bf16 with no FP8 in them at all. Dotting the FP8
arrays themselves leaves nothing to simplify away.

Scaling is *current* (per-tensor ``scale = amax(|x|) / fp8_max`` from the tensor itself,
each call), not delayed with an amax history: the step stays a pure function of the
train state, which is unchanged, and a checkpoint does not depend on the policy. The
price is one reduction per operand, which XLA fuses with the quantisation. A tensor of
zeros gets scale 1 (not a division by zero); non-finite values stay non-finite, so the
trainer's non-finite guard still sees them.

The backward is a ``jax.custom_vjp``: the residuals are the e4m3 operands (one byte an
element instead of two) and their scales, the incoming cotangent is quantised to e5m2
(more range, less precision, as gradients want), and the two gradient dots are again
FP8 dots (e5m2 x e4m3), float32 accumulation, scaled after. Quantisation is treated as
the identity for the gradient (the straight-through estimator the usual FP8 recipes use).

On the CPU the same code runs: XLA's CPU backend upcasts the FP8 operands and computes
the dots in float32, which *is* the emulation (bit-for-bit the definition up to float32
summation order).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from scaletrain.models.kernels.cpu_dots import MATMUL
from scaletrain.parallel.partition import active_platform

Array = jax.Array

#: the forward format (activations, weights): 3 mantissa bits, finite max 448
E4M3 = jnp.float8_e4m3fn
#: the gradient format: 2 mantissa bits, max 57344
E5M2 = jnp.float8_e5m2

#: logical axes of the layers that run in FP8: the q/k/v/o and MLP projections, whose
#: kernels map the residual stream (``embed``) to heads or the MLP width and back. The LM
#: head (``vocab``) and an MoE router (``None``) stay in the compute dtype, as in the usual
#: recipes: the logits' and the routing's precision matter more than their small share
#: of the FLOPs. Attention's score dots never pass through a Dense at all.
PROJECTION_AXES = frozenset({"embed", "heads", "kv_heads", "mlp"})


def fp8_layer(placement: Any, axes: tuple[Any, ...]) -> bool:
    """Whether a Dense with kernel ``axes`` runs in FP8 under ``placement`` (a ``Placement`` or a config:
    ``fp8`` set) and is a projection.

    Read at call time, so ``fp8`` set on a loaded model's config (a recipe's runtime key
    next to ``model.pretrained``) takes effect as ``gradient_checkpointing`` does.
    """
    return bool(getattr(placement, "fp8", False)) and set(axes) <= PROJECTION_AXES


def fp8_max(dtype: Any) -> float:
    """The largest finite value of an FP8 format (448 for e4m3fn, 57344 for e5m2)."""
    return float(jnp.finfo(dtype).max)


def current_scale(x: Array, dtype: Any) -> Array:
    """``amax(|x|) / fp8_max(dtype)`` in float32: ``x / scale`` fills the format's range; 1 for all zeros.

    float32 because both uses are float32: the quantising division and the multiplication
    of the float32-accumulated product.
    """
    scale = jnp.max(jnp.abs(x)).astype(jnp.float32) / fp8_max(dtype)
    return jnp.where(scale > 0, scale, jnp.ones((), jnp.float32))


def quantize(x: Array, dtype: Any, scale: Array) -> Array:
    """``x / scale`` clipped to the format's finite range and rounded to ``dtype`` (FP8).

    The division runs in float32 (exact for bf16 inputs up to one rounding), so the
    only real rounding is the FP8 one. The clip matters: e4m3fn has no infinity, and a
    value past 448 would convert to NaN.
    """
    limit = fp8_max(dtype)
    return jnp.clip(x.astype(jnp.float32) / scale, -limit, limit).astype(dtype)


def quantize_dequantize(x: Array, dtype: Any) -> Array:
    """``x`` rounded through ``dtype`` at its current scale, back in ``x``'s dtype (scaled in float32)."""
    scale = current_scale(x, dtype)
    return (quantize(x, dtype, scale).astype(jnp.float32) * scale).astype(x.dtype)


def scaled_dot(a: Array, b: Array, dims: Any, scale: Array, out_dtype: Any, precision: Any) -> Array:
    """``dot_general(a, b)`` of FP8 operands accumulated in float32, times ``scale``, in ``out_dtype``.

    The operands reach the dot still in FP8: that is what makes the GPU GEMM an FP8 one.
    """
    out = lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)
    return (out * scale).astype(out_dtype)


def _transposed(x: Array) -> Array:
    """``x.T`` materialised on the CPU (one byte an element), so the weight gradient's dot
    contracts the lhs's last dimension, the only layout XLA CPU's fast dot path takes
    without copying a larger operand (see :mod:`scaletrain.models.kernels.cpu_dots`). Elsewhere the
    dot takes the transpose for free, so the contraction is written over the rows instead."""
    return lax.optimization_barrier(x.T)


def _forward(x: Array, w: Array, precision: Any) -> tuple[Array, tuple[Array, Array, Array, Array]]:
    x_scale, w_scale = current_scale(x, E4M3), current_scale(w, E4M3)
    xq, wq = quantize(x, E4M3, x_scale), quantize(w, E4M3, w_scale)
    y = scaled_dot(xq, wq, (((1,), (0,)), ((), ())), x_scale * w_scale, x.dtype, precision)
    return y, (xq, x_scale, wq, w_scale)


def _fp8_dot(x: Array, w: Array, precision: Any) -> Array:
    return _forward(x, w, precision)[0]


_fp8_dot = jax.custom_vjp(_fp8_dot, nondiff_argnums=(2,))


def _backward(precision: Any, residuals: tuple[Array, Array, Array, Array], g: Array) -> tuple[Array, Array]:
    xq, x_scale, wq, w_scale = residuals
    g_scale = current_scale(g, E5M2)
    gq = quantize(g, E5M2, g_scale)
    # dx [M, K] = g [M, N] . w [K, N]^T (e5m2 x e4m3)
    dx = scaled_dot(gq, wq, (((1,), (1,)), ((), ())), g_scale * w_scale, g.dtype, precision)
    # dw [K, N] = x [M, K]^T . g [M, N] (e4m3 x e5m2)
    if active_platform() == "cpu":
        dw = scaled_dot(_transposed(xq), gq, (((1,), (0,)), ((), ())), x_scale * g_scale, g.dtype, precision)
    else:
        dw = scaled_dot(xq, gq, (((0,), (0,)), ((), ())), x_scale * g_scale, g.dtype, precision)
    return dx, dw


_fp8_dot.defvjp(_forward, _backward)


def fp8_matmul(x: Array, w: Array, precision: Any = None) -> Array:
    """``x [..., K] @ w [K, N] -> [..., N]`` through FP8 (see the module docstring), in ``x``'s dtype.

    ``w`` is cast to ``x``'s dtype first (a Dense passes both in the compute dtype). The
    output is named like :func:`~scaletrain.models.kernels.cpu_dots.matmul`'s, so the ``dots``
    remat policies save it: the custom VJP hides the dot from ``checkpoint_dots``.
    """
    lead, k = x.shape[:-1], x.shape[-1]
    y = _fp8_dot(x.reshape(-1, k), w.astype(x.dtype), precision)
    return checkpoint_name(y.reshape(*lead, w.shape[-1]), MATMUL)


def glu_product(activation: Callable[[Array], Array], gate: Array, up: Array, recompute: bool) -> Array:
    """``activation(gate) * up``, the gated MLP's product; with ``recompute`` its backward
    recomputes ``activation(gate)`` from ``gate`` instead of keeping it from the forward.

    Why (measured compiling the Llama-3.2-1B train step for an H100, ``remat: none``): when
    the product feeds an FP8 projection, it has two forward consumers (the amax reduction
    and the quantisation), and XLA materialises ``silu(gate)`` as a second output of the
    amax fusion; the backward then reads that buffer for ``up``'s cotangent instead of
    recomputing it, so a bf16 ``[tokens, intermediate]`` array (256 MiB a layer at 16,384
    tokens) stayed live from each layer's forward to its backward. In bf16 XLA fuses
    ``silu`` into every consumer and keeps only ``gate``, ``up`` and the product. Under
    :func:`jax.checkpoint` the backward recomputes it behind an optimisation barrier, so
    nothing can share the forward's copy: the saved residuals are ``gate`` and ``up``
    (kept anyway) and the FP8 product. The values are the same; the cost is one more
    elementwise ``activation`` in the backward, fused into the cotangent's kernels.
    """
    def product(g: Array, u: Array) -> Array:
        return activation(g) * u

    return (jax.checkpoint(product) if recompute else product)(gate, up)
