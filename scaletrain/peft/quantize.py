"""Block quantisation of frozen weights (QLoRA's base): int8 and NF4 with per-block absmax.

As bitsandbytes and the QLoRA paper define them: a weight is cut into blocks of
``block_size`` consecutive values, each block is divided by its largest magnitude
(``absmax``, kept in float32) and every value is stored as the index of the nearest
level — 255 evenly spaced levels in [-1, 1] for int8, the 16 NormalFloat levels for
NF4 (two codes to a byte). Dequantising is a table lookup times the block's absmax,
cheap enough to run inside the jitted step on every use, so only the codes stay in
memory (NF4: 0.5 byte per weight plus 4 bytes per block).

Our kernels are ``[in, out]``; blocks run along ``in`` (the contiguous axis of
torch's ``[out, in]`` weight that bitsandbytes blocks over), so codes and absmax keep
the kernel's two axes and shard by the kernel's partition rules. Not done: QLoRA's
"double quantisation" of the absmax values themselves (it saves 0.37 bit per weight).
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

QuantKind = Literal["int8", "nf4"]

#: The NormalFloat-4 levels, bitsandbytes' ``NF4`` table (quantiles of N(0, 1) scaled to [-1, 1], with an exact 0).
NF4_LEVELS = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
], dtype=np.float32)


def _blocks(w: jax.Array, block_size: int) -> jax.Array:
    """``[in, out] -> [in / block, block, out]`` (raises if ``block_size`` does not divide ``in``)."""
    n_in, n_out = w.shape
    if n_in % block_size:
        raise ValueError(f"block size {block_size} does not divide the kernel's input size {n_in}")
    return w.reshape(n_in // block_size, block_size, n_out)


@functools.partial(jax.jit, static_argnames=("kind", "block_size"))  # one program per shape, not ~10 eager ops
def quantize(w: jax.Array, kind: QuantKind, block_size: int) -> tuple[jax.Array, jax.Array]:
    """``(codes, absmax)`` of kernel ``w`` [in, out]: int8 codes [in, out] or packed NF4 codes
    [in / 2, out] (uint8, low nibble the even row), and float32 absmax [in / block_size, out]."""
    blocks = _blocks(w.astype(jnp.float32), block_size)
    absmax = jnp.max(jnp.abs(blocks), axis=1)
    scale = jnp.where(absmax == 0, 1.0, absmax)[:, None, :]
    normed = (blocks / scale).reshape(w.shape)
    if kind == "int8":
        return jnp.round(normed * 127.0).astype(jnp.int8), absmax
    levels = jnp.asarray(NF4_LEVELS)
    # nearest level: the levels are sorted, so count the midpoints below the value
    codes = jnp.searchsorted((levels[1:] + levels[:-1]) / 2, normed).astype(jnp.uint8)
    return (codes[0::2] | (codes[1::2] << 4)).astype(jnp.uint8), absmax


def dequantize(codes: jax.Array, absmax: jax.Array, kind: QuantKind, dtype: jnp.dtype) -> jax.Array:
    """The kernel [in, out] in ``dtype`` back from :func:`quantize`'s codes (inside jit: a lookup and a scale)."""
    if kind == "int8":
        normed = codes.astype(jnp.float32) / 127.0
    else:
        low, high = codes & 0x0F, codes >> 4
        index = jnp.stack([low, high], axis=1).reshape(codes.shape[0] * 2, codes.shape[1])
        normed = jnp.take(jnp.asarray(NF4_LEVELS), index.astype(jnp.int32), axis=0)
    n_in, n_out = normed.shape
    blocks = normed.reshape(absmax.shape[0], n_in // absmax.shape[0], n_out) * absmax[:, None, :]
    return blocks.reshape(n_in, n_out).astype(dtype)


def max_abs_error(absmax: jax.Array, kind: QuantKind) -> jax.Array:
    """The quantiser's stated bound per block [in / block, out]: half the widest gap between
    neighbouring levels times the block's absmax (round-to-nearest never errs by more)."""
    if kind == "int8":
        half_gap = 0.5 / 127.0
    else:
        half_gap = float(np.max(np.diff(NF4_LEVELS))) / 2
    return absmax * half_gap
