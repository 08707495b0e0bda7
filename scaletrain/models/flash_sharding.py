"""The segment-aware flash kernel on a mesh: rows over the batch axes, heads over tp, the sequence over sp.

``pallas_call`` has no partitioning rule, so a model layer calls the kernel of
:mod:`scaletrain.models.flash_attention` inside ``shard_map``. Rows and heads split
freely (each device's query heads use its own key/value heads). A sequence split
over ``sp`` is context parallelism: each device keeps its slice of the queries,
gathers every device's keys, values and segment ids along the sequence, and runs the
kernel with its queries' offset in the whole row, so causality and documents are
exactly the unsplit row's and no ``[T, S]`` score is ever built. The gathered keys
and values are the only new memory (``2 T Hkv D`` per row, a quarter of the
queries' size under Llama's 4:1 GQA), and autodiff turns the gather into a
reduce-scatter of their gradients.

Work is not balanced across ``sp``: with causal attention the device holding the
row's end sees the most keys (device ``r`` of ``n`` does ``(2r + 1) / n`` of the
average), where a zigzag layout (each device two chunks from opposite ends) would
even it out at the cost of permuting the whole model's tokens.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from jax import lax
from jax.sharding import PartitionSpec

from scaletrain.errors import ConfigError
from scaletrain.models.flash_attention import segment_flash_attention
from scaletrain.parallel.partition import active_platform, active_sharding_axes

Array = jax.Array

#: tile edge of the kernels (a power of two); a sequence slice shorter than this, or not a whole
#: number of the largest power of two below it, gets the largest power of two >= 16 dividing it
BLOCK = 64


def sequence_block(local_len: int, block: int = BLOCK) -> int:
    """The largest power of two in ``[16, block]`` dividing a device's sequence slice, for context parallelism.

    The kernel cannot pad a slice of a longer row (a padded query would sit on a
    real key's diagonal), so the slice must be whole tiles; ConfigError otherwise.
    """
    size = block
    while size >= 16:
        if local_len % size == 0:
            return size
        size //= 2
    raise ConfigError(f"model.attn_mechanism: 'pallas' over a sequence split across devices needs each device's "
                      f"slice to be a multiple of 16 tokens, got {local_len}: make max_length a multiple of "
                      f"16 x the sp axis size")


def sharded_flash_attention(q: Array, k: Array, v: Array, segment_ids: Array, *, scale: float | None,
                            batch_axis: Any, sequence_axis: Any, head_axis: Any, kv_head_axis: Any) -> Array:
    """:func:`segment_flash_attention` as a model layer calls it: on each device's shard of the active mesh.

    ``q`` [B, T, Hq, D], ``k``/``v`` [B, T, Hkv, D], ``segment_ids`` [B, T] (all ones
    for rows that are one sequence). Heads must divide over the head axes (the
    caller checks). Off a GPU the kernels run in Pallas' interpreter (slow: for tests
    and CPU meshes only).
    """
    interpret = active_platform() != "gpu"
    run = functools.partial(segment_flash_attention, scale=scale, interpret=interpret)
    if jax.sharding.get_abstract_mesh().empty:
        return run(q, k, v, segment_ids)
    b, t, nq, _ = q.shape
    rows = active_sharding_axes(batch_axis, b) or None
    seq = active_sharding_axes(sequence_axis, t) or None
    q_heads = active_sharding_axes(head_axis, nq) or None
    kv_heads = active_sharding_axes(kv_head_axis, k.shape[2]) or None
    qs, kvs = PartitionSpec(rows, seq, q_heads, None), PartitionSpec(rows, seq, kv_heads, None)
    if seq is None:
        local = run
    else:
        local = functools.partial(_context_parallel, run=run, axis=seq)
    return jax.shard_map(local, in_specs=(qs, kvs, kvs, PartitionSpec(rows, seq)), out_specs=qs,
                         check_vma=False)(q, k, v, segment_ids)


def _context_parallel(q: Array, k: Array, v: Array, segment_ids: Array, *, run: Any, axis: Any) -> Array:
    """One device's queries against the whole row's keys, gathered over the sequence axis ``axis``."""
    local_len = q.shape[1]
    block = sequence_block(local_len)
    gather = functools.partial(lax.all_gather, axis_name=axis, axis=1, tiled=True)
    offset = lax.axis_index(axis) * local_len
    return run(q, gather(k), gather(v), segment_ids, kv_segment_ids=gather(segment_ids), q_offset=offset,
               block_q=block, block_k=block)


__all__ = ["BLOCK", "sequence_block", "sharded_flash_attention"]
