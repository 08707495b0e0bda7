"""The segment-aware flash kernel on a mesh: rows over the batch axes, heads over tp, the sequence over sp.

``pallas_call`` has no partitioning rule, so a model layer calls the kernel of
:mod:`scaletrain.models.kernels.flash_attention` inside ``shard_map``. Rows and heads split
freely (each device's query heads use its own key/value heads). A sequence split
over ``sp`` is context parallelism: each device keeps its slice of the queries,
gathers every device's keys, values and segment ids along the sequence, and runs the
kernel with its queries' offset in the whole row, so causality and documents are
exactly the unsplit row's and no ``[T, S]`` score is ever built. The gathered keys
and values are the only new memory (``2 T Hkv D`` per row, a quarter of the
queries' size under Llama's 4:1 GQA), and autodiff turns the gather into a
reduce-scatter of their gradients.

Causal attention over contiguous slices is unbalanced: device ``r`` of ``n`` would
attend to ``r + 1`` slices of keys, so the last one sets the pace at ``(2n - 1) / n``
of the average. The model therefore lays a split row out **zigzag**
(:func:`zigzag_order`): the row is cut into ``2n`` chunks and device ``r`` holds
chunks ``r`` and ``2n - 1 - r``, so every device attends to ``2n + 1`` chunks of keys.
The permutation is applied once to the forward's integer inputs and RoPE tables and
undone once on the final hidden states (:func:`zigzag_inputs`); every other layer is
per token and does not care. Rows whose chunks would not be whole 16-token tiles stay
contiguous.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from scaletrain.errors import ConfigError
from scaletrain.models.kernels.attention import ForwardInputs, PackedSegments
from scaletrain.models.common.config import DecoderConfig
from scaletrain.models.kernels.flash_attention import segment_flash_attention
from scaletrain.parallel.partition import active_axis_size, active_platform, active_sharding_axes

Array = jax.Array

#: query and key tile edges of the kernels (powers of two), read at trace time so that
#: ``bench/variant_ab.py "flash_sharding.BLOCK_Q = 128" ...`` can compare them on a GPU (untuned);
#: a sequence slice split over sp that is not whole tiles gets the largest power of two >= 16 dividing it
BLOCK_Q = 64
BLOCK_K = 64


def sequence_block(local_len: int, block: int | None = None) -> int:
    """The largest power of two in ``[16, block]`` dividing a device's sequence slice, for context parallelism.

    The kernel cannot pad a slice of a longer row (a padded query would sit on a
    real key's diagonal), so the slice must be whole tiles; ConfigError otherwise.
    """
    size = block or min(BLOCK_Q, BLOCK_K)
    while size >= 16:
        if local_len % size == 0:
            return size
        size //= 2
    raise ConfigError(f"model.attn_mechanism: 'pallas' over a sequence split across devices needs each device's "
                      f"slice to be a multiple of 16 tokens, got {local_len}: make max_length a multiple of "
                      f"16 x the sp axis size")


def split_devices(sequence_axis: Any, t: int) -> int:
    """How many devices of the active mesh split a row of ``t`` tokens (the sp axes that divide it)."""
    axes = active_sharding_axes(sequence_axis, t)
    return active_axis_size(axes) if axes else 1


def zigzag_chunk(t: int, devices: int) -> int | None:
    """The chunk length of the zigzag layout of a ``t``-token row over ``devices``, or None where it does
    not apply (one device, or chunks that are not whole 16-token tiles)."""
    if devices <= 1 or t % (2 * devices) or (t // (2 * devices)) % 16:
        return None
    return t // (2 * devices)


def zigzag_order(t: int, devices: int) -> np.ndarray:
    """Row index of each position of the zigzag layout: device ``r``'s slice is chunks ``r``, ``2n - 1 - r``."""
    c, n = t // (2 * devices), devices
    chunks = [j for r in range(n) for j in (r, 2 * n - 1 - r)]
    return np.concatenate([np.arange(j * c, (j + 1) * c) for j in chunks])


def training_mechanism(config: DecoderConfig, t: int) -> str:
    """The attention a training forward over rows of ``t`` tokens runs: ``config.attn_mechanism``, except
    that ``auto`` becomes ``pallas`` on a GPU mesh that splits the row over sp.

    There cuDNN's partitioner refuses the split sequence and the einsum path builds every
    head's ``[T / sp, T]`` scores (compiled for 8 H100s at 32k tokens: 247 GB of
    temporaries per device, against 10.4 GB with the kernel; ``bench/aot.py``). Not with
    heads that do not divide over tp, slices that are not whole 16-token tiles
    (:func:`sequence_block`), or attention sinks (GPT-OSS), which the kernel does not add: ``auto``
    never raises for them.
    """
    mechanism, pa = config.attn_mechanism, config.partition_axis
    devices = split_devices(pa.sequence_axis, t)
    if (mechanism not in ("auto", "sdpa") or active_platform() != "gpu" or devices <= 1
            or (t // devices) % 16 or getattr(config, "attention_sinks", False)):
        return mechanism
    if config.num_attention_heads % active_axis_size(pa.head_axis) or (
            config.num_key_value_heads % active_axis_size(pa.kv_head_axis)):
        return mechanism
    return "pallas"


def zigzag_inputs(sequence_axis: Any, input_ids: jax.Array,
                  inputs: ForwardInputs) -> tuple[jax.Array, ForwardInputs, np.ndarray | None]:
    """The forward's inputs in the zigzag layout when the flash kernel (``inputs.mask`` the
    :class:`PackedSegments`) attends over a row split over sp, and the inverse permutation to apply to
    the final hidden states (None: nothing was permuted)."""
    t = input_ids.shape[1]
    devices = split_devices(sequence_axis, t)
    if not isinstance(inputs.mask, PackedSegments) or zigzag_chunk(t, devices) is None:
        return input_ids, inputs, None
    order = zigzag_order(t, devices)
    take = lambda x: jnp.take(x, order, axis=1)  # noqa: E731
    permuted = ForwardInputs(take(inputs.positions), take(inputs.segment_ids),
                             PackedSegments(take(inputs.mask.ids), window=inputs.mask.window, zigzag=True),
                             (take(inputs.rope[0]), take(inputs.rope[1])))
    return take(input_ids), permuted, np.argsort(order)


def sharded_flash_attention(q: Array, k: Array, v: Array, segment_ids: Array, *, scale: float | None,
                            batch_axis: Any, sequence_axis: Any, head_axis: Any, kv_head_axis: Any,
                            window: int | None = None, zigzag: bool = False) -> Array:
    """:func:`segment_flash_attention` as a model layer calls it: on each device's shard of the active mesh.

    ``q`` [B, T, Hq, D], ``k``/``v`` [B, T, Hkv, D], ``segment_ids`` [B, T] (all ones
    for rows that are one sequence). Heads must divide over the head axes (the
    caller checks). ``zigzag``: the rows are in :func:`zigzag_order` for the sp devices
    (:func:`zigzag_inputs` put them there); otherwise in row order. Off a GPU the kernels
    run in Pallas' interpreter (slow: for tests and CPU meshes only).
    """
    interpret = active_platform() != "gpu"
    run = functools.partial(segment_flash_attention, scale=scale, interpret=interpret, window=window)
    whole_rows = functools.partial(run, block_q=BLOCK_Q, block_k=BLOCK_K)
    if jax.sharding.get_abstract_mesh().empty:
        return whole_rows(q, k, v, segment_ids)
    b, t, nq, _ = q.shape
    rows = active_sharding_axes(batch_axis, b) or None
    seq = active_sharding_axes(sequence_axis, t) or None
    q_heads = active_sharding_axes(head_axis, nq) or None
    kv_heads = active_sharding_axes(kv_head_axis, k.shape[2]) or None
    qs, kvs = PartitionSpec(rows, seq, q_heads, None), PartitionSpec(rows, seq, kv_heads, None)
    if seq is None:
        local = whole_rows
    else:
        devices = split_devices(sequence_axis, t)
        if zigzag and zigzag_chunk(t, devices) is None:
            raise ValueError(f"a zigzag layout of {t} tokens over {devices} devices has no whole 16-token chunks")
        local = functools.partial(_context_parallel, run=run, axis=seq, devices=devices, zigzag=zigzag)
    return jax.shard_map(local, in_specs=(qs, kvs, kvs, PartitionSpec(rows, seq)), out_specs=qs,
                         check_vma=False)(q, k, v, segment_ids)


def _context_parallel(q: Array, k: Array, v: Array, segment_ids: Array, *, run: Any, axis: Any, devices: int,
                      zigzag: bool) -> Array:
    """One device's queries against the whole row's keys, gathered over the sequence axis ``axis``.

    Contiguous: the slice is one run of the row at ``r * len``. Zigzag: the slice is two
    chunks (``r`` and ``2n - 1 - r``), each attended at its own offset after the gathered
    keys are put back in row order.
    """
    local_len = q.shape[1]
    gather = functools.partial(lax.all_gather, axis_name=axis, axis=1, tiled=True)
    keys, values, kv_seg = gather(k), gather(v), gather(segment_ids)
    r = lax.axis_index(axis)
    if not zigzag:
        block = sequence_block(local_len)
        return run(q, keys, values, segment_ids, kv_segment_ids=kv_seg, q_offset=r * local_len,
                   block_q=block, block_k=block)
    c = local_len // 2
    # gathered chunk 2d + h is device d's half h; row chunk j is device j's first half (j < n),
    # else device 2n - 1 - j's second half
    n = devices
    gathered_chunk = np.array([2 * j if j < n else 2 * (2 * n - 1 - j) + 1 for j in range(2 * n)])
    in_row_order = lambda x: jnp.take(x.reshape(x.shape[0], 2 * n, c, *x.shape[2:]), gathered_chunk,  # noqa: E731
                                      axis=1).reshape(x.shape)
    keys, values, kv_seg = in_row_order(keys), in_row_order(values), in_row_order(kv_seg)
    block = sequence_block(c)
    halves = [run(q[:, h * c:(h + 1) * c], keys, values, segment_ids[:, h * c:(h + 1) * c], kv_segment_ids=kv_seg,
                  q_offset=(r if h == 0 else 2 * n - 1 - r) * c, block_q=block, block_k=block) for h in (0, 1)]
    return jnp.concatenate(halves, axis=1)


__all__ = ["BLOCK_K", "BLOCK_Q", "sequence_block", "sharded_flash_attention", "split_devices", "training_mechanism", "zigzag_chunk",
           "zigzag_inputs", "zigzag_order"]
