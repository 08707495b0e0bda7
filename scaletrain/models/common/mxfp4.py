"""MXFP4 expert weights (GPT-OSS's released checkpoints) read as ordinary arrays, one device slice at a time.

Why: GPT-OSS ships its experts as MXFP4 (OCP microscaling FP4): per expert and output row, the
input dimension in blocks of 32 values, each value a 4-bit float (e2m1: 0, 0.5, 1, 1.5, 2, 3, 4,
6 and their negatives) and each block one shared power-of-two exponent. On disk, for HF's
``gate_up_proj`` [E, in, out] (transformers' layout), the file holds ``gate_up_proj_blocks``
[E, out, in / 32, 16] uint8 (two values a byte, the low nibble first) and ``gate_up_proj_scales``
[E, out, in / 32] uint8 (the exponent biased by 127); ``quantization_config.quant_method`` is
``mxfp4``. We train in bf16/fp32, so the loader dequantises, and each device reads and decodes
only the rows and blocks of its own slice (:func:`load_mxfp4`): no host ever holds a whole
dequantised expert tensor unless one device holds it whole. An export writes the experts as
ordinary tensors in the parameters' dtype, without ``quantization_config``.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import numpy as np

from scaletrain.errors import CheckpointError

#: the 16 values of an e2m1 nibble (sign bit highest), as the OCP MX spec and transformers decode them
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)
#: values sharing one exponent; a block is 16 bytes
BLOCK = 32
#: ``quantization_config.quant_method`` of such folders
QUANT_METHOD = "mxfp4"


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """``[..., G, 16]`` uint8 blocks and ``[..., G]`` uint8 exponents -> ``[..., G * 32]`` float32 values."""
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], BLOCK)
    values = np.ldexp(FP4_VALUES[codes], scales.astype(np.int32)[..., None] - 127)
    return values.reshape(*blocks.shape[:-2], blocks.shape[-2] * BLOCK)


class Mxfp4Source(NamedTuple):
    """Where one of our expert kernels (``[E, in, out]``, or ``[L, E, in, out]`` stacked over layers) is
    in an MXFP4 folder: per layer, its blocks and scales tensors."""

    blocks: tuple[str, ...]
    scales: tuple[str, ...]
    stacked: int  # 1 with a leading layer axis (scan_layers), else 0

    @property
    def tensors(self) -> tuple[str, ...]:
        """Every tensor it reads (what :mod:`scaletrain.models.hf` opens files for and counts as used)."""
        return self.blocks + self.scales


def mxfp4_source(tensors: tuple[str, ...], stacked: int, files: dict[str, str]) -> Mxfp4Source | None:
    """The :class:`Mxfp4Source` of a parameter whose HF ``tensors`` (one per layer when stacked) are absent from
    ``files`` but stored as ``<name>_blocks`` and ``<name>_scales``; None when they are not."""
    if stacked > 1 or any(f"{t}_blocks" not in files or f"{t}_scales" not in files for t in tensors):
        return None
    return Mxfp4Source(tuple(f"{t}_blocks" for t in tensors), tuple(f"{t}_scales" for t in tensors), stacked)


def _check_shapes(source: Mxfp4Source, slices: dict[str, Any], files: dict[str, str],
                  shape: tuple[int, ...]) -> None:
    """CheckpointError naming the file and tensor unless blocks and scales fit ``shape`` [.., E, in, out]."""
    experts, inner, outer = shape[-3:]
    groups = math.ceil(inner / BLOCK)
    for blocks, scales in zip(source.blocks, source.scales):
        want = {blocks: [experts, outer, groups, BLOCK // 2], scales: [experts, outer, groups]}
        for name, expect in want.items():
            got = list(slices[name].get_shape())
            if got != expect or inner % BLOCK:
                raise CheckpointError(
                    f"{files[name]}: tensor {name}: shape {got}, but MXFP4 experts of the config's shape "
                    f"[{experts}, {inner}, {outer}] need {expect} ({BLOCK} values per block along the "
                    f"{inner} inputs, which must divide by {BLOCK}); re-export the checkpoint or fix config.json")


def load_mxfp4(handles: dict[str, Any], source: Mxfp4Source, target: jax.ShapeDtypeStruct,
               files: dict[str, str]) -> jax.Array:
    """Read one expert kernel into ``target``'s sharding, each device decoding only its slice's blocks."""
    slices = {name: handles[name].get_slice(name) for name in source.tensors}
    shape = tuple(target.shape)
    _check_shapes(source, slices, files, shape)
    np_dtype = np.dtype(target.dtype)
    cache: dict[tuple[Any, ...], np.ndarray] = {}

    def one_layer(layer: int, index: tuple[slice, ...]) -> np.ndarray:
        e, i, o = index
        rows = range(*i.indices(shape[-2]))
        first, last = rows.start // BLOCK, -(-rows.stop // BLOCK)
        blocks = slices[source.blocks[layer]][e, o, first:last, :]
        scales = slices[source.scales[layer]][e, o, first:last]
        values = dequantize(blocks, scales)[:, :, rows.start - first * BLOCK:rows.stop - first * BLOCK]
        return values.transpose(0, 2, 1).astype(np_dtype)  # [e, out, in] -> ours [e, in, out]

    def read(index: tuple[slice, ...]) -> np.ndarray:
        index = index or tuple(slice(None) for _ in shape)
        key = tuple((s.start, s.stop, s.step) for s in index)
        if key not in cache:
            if source.stacked:
                layers = range(*index[0].indices(shape[0]))
                part = np.stack([one_layer(layer, index[1:]) for layer in layers])
            else:
                part = one_layer(0, index)
            cache[key] = np.ascontiguousarray(part)
        return cache[key]

    return jax.make_array_from_callback(shape, target.sharding, read)
