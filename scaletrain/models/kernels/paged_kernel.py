"""A Pallas decode kernel that attends over a slot's pages through the page table, without gathering them.

Why: the XLA path (:func:`~scaletrain.models.kernels.paged_attention.gather_pages`) copies every slot's pages
into a contiguous ``[slots, max_pages * page_size, kv_heads, head_dim]`` array each step and layer, then runs
the einsum attention over it: on a GPU that is a second pass over the whole cache through memory, the
resource a decode step is bound by. Here one program per (slot, key/value head, block of query rows) walks
the slot's row of the page table, reads each page straight from the pool and folds it into an online softmax
(running max, sum, weighted values, as flash attention does), so each cached key and value is read once per
block of query rows and nothing is written but the output.

What it computes is what :func:`~scaletrain.models.kernels.attention.dot_product_attention` computes over the
gathered pages with :func:`~scaletrain.models.kernels.paged_attention.paged_mask`: GQA (a program takes the
``heads / kv_heads`` queries of its key/value head, in blocks of 16 rows on GPU), the mask of the layer (the
slot's own position and the ones before it, within a sliding window when the layer has one: read from the
mask, and the pages wholly before the window skipped), attention sinks (GPT-OSS: the sink starts the running
max and sum), and a keys-only pool (multi-head latent attention: the values are the keys' first
``value_dim`` dims, the absorbed form of :mod:`~scaletrain.models.common.latent_attention`). Pages past a
slot's position are never read, so a partial last page and an idle slot cost nothing.

Where it runs: on GPU, lowered by Pallas' Triton backend (the query group is padded to 16 rows for the
tensor-core dot); on CPU only in Pallas' interpreter (``interpret=True``: the tests, equal to the XLA path);
TPU keeps the XLA gather (a TPU kernel must move pages into VMEM by DMA: not built). :func:`use_paged_kernel`
is the choice the attention layers make.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from scaletrain.models.kernels.paged_attention import PagedKVCache, PageTable
from scaletrain.parallel.partition import active_platform

Array = jax.Array
Ref = Any
#: the masked score (finite, so a fully masked page cannot make NaNs)
MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)
#: the fewest query rows a program holds on GPU: Triton's dot needs 16
GPU_MIN_ROWS = 16


_INTERPRETED = False


@contextlib.contextmanager
def interpreted_paged_kernel() -> Iterator[None]:
    """Run decode attention over pages through this kernel in Pallas' interpreter, on any platform, while
    tracing inside the block (what the tests compare with the XLA path; slow: for checking, not serving)."""
    global _INTERPRETED
    before, _INTERPRETED = _INTERPRETED, True
    try:
        yield
    finally:
        _INTERPRETED = before


def use_paged_kernel() -> bool:
    """Whether decode attention over pages runs this kernel: on GPU (or interpreted inside
    :func:`interpreted_paged_kernel`); CPU and TPU gather the pages (XLA). ``SCALETRAIN_PAGED_KERNEL=0`` in the
    environment gathers on GPU too (what ``bench/gpu.py --paged`` measures the kernel against)."""
    if _INTERPRETED:
        return True
    return active_platform() == "gpu" and os.environ.get("SCALETRAIN_PAGED_KERNEL", "1") != "0"


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _dot_t(a: Array, b: Array) -> Array:
    """``a @ b.T`` accumulated in float32."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _kernel(bounds_ref, table_ref, mask_ref, sink_ref, q_ref, k_ref, v_ref, o_ref, *, scale: float, page_size: int,
            split: int | None) -> None:
    """One (slot, key/value head, block of its query rows): the online softmax over pages
    ``bounds[0] .. bounds[1] - 1`` of the slot's row."""
    rows = q_ref.shape[0]
    width = o_ref.shape[-1]
    q = q_ref[...]

    def body(i: Array, carry: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
        acc, m, l = carry
        page = table_ref[i]
        if split is None:  # separate keys and values
            s = _dot_t(q, k_ref[page, :, :])
            v = v_ref[page, :, :]
        else:  # a keys-only pool: scores over both parts, values the first `split` dims
            v = k_ref[page, :, pl.ds(0, split)]
            s = _dot_t(q_ref[:, pl.ds(0, split)], v)
            s = s + _dot_t(q_ref[:, pl.ds(split, k_ref.shape[-1] - split)],
                           k_ref[page, :, pl.ds(split, k_ref.shape[-1] - split)])
        keep = mask_ref[pl.ds(i * page_size, page_size)] != 0  # [page_size]
        s = jnp.where(keep[None, :], s * scale, MASKED)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.where(keep[None, :], jnp.exp(s - m_new[:, None]), 0.0)
        alpha = jnp.exp(m - m_new)
        acc = alpha[:, None] * acc + lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                                     preferred_element_type=jnp.float32)
        return acc, m_new, alpha * l + jnp.sum(p, axis=1)

    if sink_ref is None:
        m0, l0 = jnp.full((rows,), MASKED, jnp.float32), jnp.zeros((rows,), jnp.float32)
    else:  # the sink's logit starts the running max, its exp(0) = 1 the sum; it adds no value
        m0, l0 = sink_ref[...].astype(jnp.float32), jnp.ones((rows,), jnp.float32)
    acc0 = jnp.zeros((rows, width), jnp.float32)
    acc, _, l = lax.fori_loop(bounds_ref[0], bounds_ref[1], body, (acc0, m0, l0))
    o_ref[...] = (acc / jnp.maximum(l, 1e-30)[:, None]).astype(o_ref.dtype)


def paged_decode_attention(q: Array, cache: PagedKVCache, pages: PageTable, mask: Array, *, scale: float,
                           sinks: Array | None = None, value_dim: int | None = None,
                           interpret: bool | None = None, block_rows: int | None = None) -> Array:
    """Attention of one query per slot ``q`` [slots, 1, heads, D] over the slot's pages of ``cache``.

    ``mask`` [slots, 1, 1, max_pages * page_size] (:func:`paged_mask`: the layer's causal window), ``sinks``
    [heads] float32 or None; for a keys-only pool (``cache.values`` None) ``value_dim`` is the values' width,
    the keys' first dims. ``interpret`` None: inside :func:`interpreted_paged_kernel` only. ``block_rows``: the
    query rows of one program (a power of two; default 16 on GPU, the whole padded group interpreted): a
    large group (MLA's heads all share one latent "head") is split over programs, so its running sums stay
    small. Returns [slots, 1, heads, value width] in ``q``'s dtype.
    """
    interpret = _INTERPRETED if interpret is None else interpret
    slots, _, heads, d = q.shape
    num_pages, page_size, kv_heads, _ = cache.keys.shape
    group = heads // kv_heads
    rows = _next_pow2(group) if interpret else max(_next_pow2(group), GPU_MIN_ROWS)
    block = min(rows, block_rows or (rows if interpret else GPU_MIN_ROWS))
    split = None if cache.values is not None else value_dim
    width = cache.values.shape[-1] if split is None else split
    max_pages = pages.table.shape[1]
    cols = _next_pow2(max_pages)  # Triton's blocks are powers of two: pad the table (the pads are never read)
    table = jnp.pad(pages.table, ((0, 0), (0, cols - max_pages)))
    keep = jnp.pad(mask.reshape(slots, -1), ((0, 0), (0, (cols - max_pages) * page_size))).astype(jnp.int32)
    first = jnp.argmax(keep, axis=1) // page_size  # pages wholly before a sliding window are skipped
    bounds = jnp.stack([first, pages.lengths // page_size + 1], axis=1).astype(jnp.int32)

    qg = q.reshape(slots, kv_heads, group, d)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, rows - group), (0, 0)))
    pool = pl.BlockSpec((num_pages, page_size, None, d), lambda s, h, r: (0, 0, h, 0))
    specs = [pl.BlockSpec((None, 2), lambda s, h, r: (s, 0)), pl.BlockSpec((None, cols), lambda s, h, r: (s, 0)),
             pl.BlockSpec((None, cols * page_size), lambda s, h, r: (s, 0))]
    operands = [bounds, table, keep]
    if sinks is not None:
        sink = jnp.pad(sinks.astype(jnp.float32).reshape(kv_heads, group), ((0, 0), (0, rows - group)))
        specs.append(pl.BlockSpec((None, block), lambda s, h, r: (h, r)))
        operands.append(sink)
    specs += [pl.BlockSpec((None, None, block, d), lambda s, h, r: (s, h, r, 0)), pool]
    operands += [qg, cache.keys]
    if split is None:
        specs.append(pl.BlockSpec((num_pages, page_size, None, width), lambda s, h, r: (0, 0, h, 0)))
        operands.append(cache.values)

    def kernel(*refs: Ref) -> None:
        refs = list(refs)
        bounds_ref, table_ref, mask_ref = refs[:3]
        rest = refs[3:]
        sink_ref = rest.pop(0) if sinks is not None else None
        q_ref, k_ref = rest[:2]
        v_ref = rest[2] if split is None else None
        _kernel(bounds_ref, table_ref, mask_ref, sink_ref, q_ref, k_ref, v_ref, rest[-1], scale=scale,
                page_size=page_size, split=split)

    out = pl.pallas_call(
        kernel, grid=(slots, kv_heads, rows // block), in_specs=specs,
        out_specs=pl.BlockSpec((None, None, block, width), lambda s, h, r: (s, h, r, 0)),
        out_shape=jax.ShapeDtypeStruct((slots, kv_heads, rows, width), q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2), interpret=interpret,
        name="paged_decode_attention",
    )(*operands)
    return out[:, :, :group].reshape(slots, 1, heads, width)
