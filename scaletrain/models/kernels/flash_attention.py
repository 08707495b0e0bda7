"""Segment-aware flash attention for packed rows: a Pallas kernel that skips other documents' blocks.

Why: a packed row (several documents, :mod:`scaletrain.data.packing`) needs a
same-document mask. Given to cuDNN as a dense ``[B, 1, T, S]`` bias it costs a bias
read in the forward and a bias gradient written in the backward, and every block
left of the diagonal is still computed although most of it is another document.
This kernel reads the ``[B, T]`` segment ids instead, masks inside each
``[block_q, block_k]`` tile, and never visits a tile that the mask would zero whole:
tiles above the diagonal (the loop's upper bound) and tiles whose query and key
blocks share no document (the loop's lower bound).

Semantics are exactly :func:`scaletrain.models.kernels.attention.build_attention_mask`:
query ``i`` sees key ``j`` iff ``j <= i`` (``causal``), both are in the same segment
and that segment is not 0 (padding), ``i - j < window`` when there is a sliding
window, and every query sees itself — so a padding query's output is its own value
row and an all-padding row has no NaN.

**Caller contract.** ``segment_ids`` are the packed rows' (1..k per row, 0 for
padding). Causality is on the row index, not on ``positions``: that equals causality
within each document because a document's tokens are contiguous in its row with
positions counting up (what :func:`scaletrain.data.packing.pack_pieces` makes). The
result is exact for any segment layout; the skipping is tight when segments are
contiguous and non-decreasing with padding at the end (packing's layout), and only
wastes work otherwise. A sliding window is on row distance too, which is position
distance inside such a document, and its tiles wholly out of reach are skipped as well.

Structure (FlashAttention-2): the forward grid is ``(batch, q head, query block)``;
each program keeps its query tile, loops over the key blocks of its
:func:`block_schedule` range with an online softmax in float32 and writes the output
and the row log-sum-exp. The backward is two Pallas kernels with the same schedule:
dq on ``(batch, q head, query block)`` looping over key blocks, and dk/dv on
``(batch, kv head, key block)`` looping over the group's query heads and the query
blocks that see this key block, so GQA gradients are summed in the kernel.
On GPU the kernels lower through Pallas' Triton backend; ``interpret=True`` runs
them anywhere (the CPU tests).

The queries may also be a slice of a longer row of keys, at an offset (``q_offset``,
``kv_segment_ids``): one device's share of a sequence split over devices
(:mod:`scaletrain.models.kernels.flash_sharding` gathers the keys). The forward names its
output and log-sum-exp for remat policies (:mod:`scaletrain.models.common.remat`).
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.ad_checkpoint import checkpoint_name
from jax.experimental.pallas import triton as plgpu

Array = jax.Array
Ref = Any  # a Pallas kernel's view of one operand's block (indexed like an array)

#: ``checkpoint_name`` of the forward's output and row log-sum-exp, the backward's residuals besides
#: q, k, v: a remat policy that saves both (``gradient_checkpointing="save_attention"``) spares the
#: backward a second forward kernel
ATTENTION_OUTPUT, ATTENTION_LSE = "attn_out", "attn_lse"

#: score of a masked entry: finite, so ``m - MASKED`` never makes ``inf - inf``
MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)


class BlockSchedule(NamedTuple):
    """Which tiles the kernels visit, each row of blocks as a half-open range of the other side's blocks.

    ``kv_lo/kv_hi`` [B, T/block_q]: query block ``i`` loops over key blocks
    ``[kv_lo[i], kv_hi[i])``; ``q_lo/q_hi`` [B, S/block_k]: key block ``j`` over query
    blocks ``[q_lo[j], q_hi[j])``. Both cover every tile with an unmasked entry.
    """

    kv_lo: Array
    kv_hi: Array
    q_lo: Array
    q_hi: Array


def block_schedule(segment_ids: Array, block_q: int, block_k: int, causal: bool = True, *,
                   kv_segment_ids: Array | None = None, q_offset: Any = 0, window: int | None = None) -> BlockSchedule:
    """The tiles that can hold an unmasked entry, from each block's range of non-padding segment ids.

    ``segment_ids`` are the queries'; the keys' are ``kv_segment_ids`` (the same row
    when None), and query ``i`` sits at row index ``q_offset + i`` of the keys' row:
    a device's slice of a sequence split over devices (:mod:`~scaletrain.models.kernels.flash_sharding`).
    With a ``window``, tiles whose every query is ``window`` or more rows past every key
    are skipped too (sliding-window attention: block-sparse both ways).

    Tile ``(i, j)`` is needed when it is not above the diagonal (``causal``) and
    either the two blocks' ranges ``[min, max]`` of non-zero segment ids overlap (they
    may share a document: exact for contiguous segments, conservative otherwise) or
    the tile holds a diagonal entry (every token sees itself, padding included). Each
    query block's needed key blocks are spanned by one range (and vice versa), so the
    kernels' loops have dynamic bounds and no branches. Cheap: ``[B, nq, nk]`` booleans.
    """
    kv_segment_ids = segment_ids if kv_segment_ids is None else kv_segment_ids
    b = segment_ids.shape[0]
    nq, nk = segment_ids.shape[1] // block_q, kv_segment_ids.shape[1] // block_k
    big = jnp.iinfo(jnp.int32).max

    def ranges(seg: Array, size: int, n: int) -> tuple[Array, Array]:
        blocks = seg.astype(jnp.int32).reshape(b, n, size)
        real = blocks != 0
        return jnp.min(jnp.where(real, blocks, big), -1), jnp.max(jnp.where(real, blocks, -1), -1)

    q_min, q_max = ranges(segment_ids, block_q, nq)
    k_min, k_max = ranges(kv_segment_ids, block_k, nk)
    share = (q_min[:, :, None] <= k_max[:, None, :]) & (k_min[:, None, :] <= q_max[:, :, None])
    q_first = q_offset + jnp.arange(nq) * block_q
    q_last = q_first + block_q - 1
    k_first, k_last = jnp.arange(nk) * block_k, jnp.arange(nk) * block_k + block_k - 1
    diagonal = (k_first[None, :] <= q_last[:, None]) & (q_first[:, None] <= k_last[None, :])
    needed = share | diagonal[None]
    if causal:
        needed = needed & (k_first[None, :] <= q_last[:, None])[None]
    if window is not None:  # some query of the tile is within the window of some key: q_first - k_last < window
        needed = needed & (q_first[:, None] - k_last[None, :] < window)[None]

    def span(m: Array, axis: int) -> tuple[Array, Array]:
        n = m.shape[axis]
        first = jnp.argmax(m, axis=axis)
        last = n - 1 - jnp.argmax(jnp.flip(m, axis=axis), axis=axis)
        return first.astype(jnp.int32), (last + 1).astype(jnp.int32)

    kv_lo, kv_hi = span(needed, 2)
    q_lo, q_hi = span(needed, 1)
    return BlockSchedule(kv_lo, kv_hi, q_lo, q_hi)


def _tile_mask(q_seg: Array, k_seg: Array, q_start: Any, k_start: Any, causal: bool, window: int | None) -> Array:
    """[bq, bk] booleans of :func:`build_attention_mask` for one tile (the window on row distance)."""
    q_idx = q_start + lax.broadcasted_iota(jnp.int32, (q_seg.shape[0], k_seg.shape[0]), 0)
    k_idx = k_start + lax.broadcasted_iota(jnp.int32, (q_seg.shape[0], k_seg.shape[0]), 1)
    mask = (q_seg[:, None] == k_seg[None, :]) & (k_seg != 0)[None, :]
    if causal:
        mask = mask & (q_idx >= k_idx)
    if window is not None:
        mask = mask & (q_idx - k_idx < window)
    return mask | (q_idx == k_idx)


def _dot(a: Array, b: Array, a_dim: int = 1, b_dim: int = 0) -> Array:
    """2-D matmul contracting ``a``'s ``a_dim`` with ``b``'s ``b_dim``, accumulated in float32."""
    return lax.dot_general(a, b, (((a_dim,), (b_dim,)), ((), ())), preferred_element_type=jnp.float32)


def _forward_kernel(kv_lo_ref: Ref, kv_hi_ref: Ref, off_ref: Ref, qseg_ref: Ref, kseg_ref: Ref, q_ref: Ref,
                    k_ref: Ref, v_ref: Ref, o_ref: Ref, lse_ref: Ref, *count_ref: Ref, scale: float, causal: bool,
                    window: int | None, block_q: int, block_k: int) -> None:
    i = pl.program_id(2)
    q = q_ref[...]
    q_seg = qseg_ref[pl.ds(i * block_q, block_q)]
    q_start = off_ref[0] + i * block_q
    d = q.shape[-1]

    def body(j: Array, carry: tuple[Array, ...]) -> tuple[Array, ...]:
        acc, m, l, visits = carry
        k_slice = pl.ds(j * block_k, block_k)
        s = _dot(q, k_ref[k_slice, :], 1, 1) * scale
        mask = _tile_mask(q_seg, kseg_ref[k_slice], q_start, j * block_k, causal, window)
        m_new = jnp.maximum(m, jnp.max(jnp.where(mask, s, MASKED), axis=1))
        p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
        alpha = jnp.exp(m - m_new)
        acc = alpha[:, None] * acc + _dot(p.astype(v_ref.dtype), v_ref[k_slice, :])
        return acc, m_new, alpha * l + jnp.sum(p, axis=1), visits + 1

    init = (jnp.zeros((block_q, d), jnp.float32), jnp.full((block_q,), MASKED, jnp.float32),
            jnp.zeros((block_q,), jnp.float32), jnp.int32(0))
    acc, m, l, visits = lax.fori_loop(kv_lo_ref[i], kv_hi_ref[i], body, init)
    # l >= 1: every query sees itself and the diagonal tile is always in the range
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(l)
    if count_ref:
        count_ref[0][...] = jnp.full((1,), visits, jnp.int32)


def _dq_kernel(kv_lo_ref: Ref, kv_hi_ref: Ref, off_ref: Ref, qseg_ref: Ref, kseg_ref: Ref, q_ref: Ref, k_ref: Ref,
               v_ref: Ref, do_ref: Ref, lse_ref: Ref, delta_ref: Ref, dq_ref: Ref, *, scale: float, causal: bool,
               window: int | None, block_q: int, block_k: int) -> None:
    i = pl.program_id(2)
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    q_seg = qseg_ref[pl.ds(i * block_q, block_q)]
    q_start = off_ref[0] + i * block_q

    def body(j: Array, dq: Array) -> Array:
        k_slice = pl.ds(j * block_k, block_k)
        k = k_ref[k_slice, :]
        s = _dot(q, k, 1, 1) * scale
        mask = _tile_mask(q_seg, kseg_ref[k_slice], q_start, j * block_k, causal, window)
        p = jnp.where(mask, jnp.exp(s - lse[:, None]), 0.0)
        ds = p * (_dot(do, v_ref[k_slice, :], 1, 1) - delta[:, None])
        return dq + _dot(ds.astype(k.dtype), k)

    dq = lax.fori_loop(kv_lo_ref[i], kv_hi_ref[i], body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkv_kernel(q_lo_ref: Ref, q_hi_ref: Ref, off_ref: Ref, qseg_ref: Ref, kseg_ref: Ref, q_ref: Ref, k_ref: Ref,
                v_ref: Ref, do_ref: Ref, lse_ref: Ref, delta_ref: Ref, dk_ref: Ref, dv_ref: Ref, *, scale: float,
                causal: bool, window: int | None, block_q: int, block_k: int, group: int) -> None:
    j = pl.program_id(2)
    k, v = k_ref[...], v_ref[...]
    k_seg = kseg_ref[pl.ds(j * block_k, block_k)]
    lo, hi, offset = q_lo_ref[j], q_hi_ref[j], off_ref[0]

    def head(g: Array, carry: tuple[Array, Array]) -> tuple[Array, Array]:
        def body(i: Array, carry: tuple[Array, Array]) -> tuple[Array, Array]:
            dk, dv = carry
            q_slice = pl.ds(i * block_q, block_q)
            q, do = q_ref[q_slice, g, :], do_ref[q_slice, g, :]
            s = _dot(q, k, 1, 1) * scale
            mask = _tile_mask(qseg_ref[q_slice], k_seg, offset + i * block_q, j * block_k, causal, window)
            p = jnp.where(mask, jnp.exp(s - lse_ref[g, q_slice][:, None]), 0.0)
            ds = p * (_dot(do, v, 1, 1) - delta_ref[g, q_slice][:, None])
            return dk + _dot(ds.astype(q.dtype), q, 0, 0), dv + _dot(p.astype(do.dtype), do, 0, 0)

        return lax.fori_loop(lo, hi, body, carry)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(0, group, head, (zeros, zeros))
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


class _Config(NamedTuple):
    scale: float
    causal: bool
    window: int | None
    block_q: int
    block_k: int
    interpret: bool


#: Triton launch parameters, read at trace time (``bench/variant_ab.py`` can switch them on a GPU):
#: warps per program (None: 4 up to head dim 64, else 8) and software-pipelining stages. Untuned.
NUM_WARPS: int | None = None
NUM_STAGES = 2


def _compiler_params(head_dim: int) -> Any:
    warps = NUM_WARPS or (4 if head_dim <= 64 else 8)
    return plgpu.CompilerParams(num_warps=warps, num_stages=NUM_STAGES)


def _bound_specs(n: int) -> list[pl.BlockSpec]:
    """A schedule's two bounds, whole per batch row (each program reads its own two as scalars), then
    the query offset (one scalar for every program)."""
    return [pl.BlockSpec((None, n), lambda b, h, i: (b, 0))] * 2 + [pl.BlockSpec((1,), lambda b, h, i: (0,))]


def _segment_specs(tq: int, tk: int) -> list[pl.BlockSpec]:
    """The query and key segment ids, whole rows."""
    return [pl.BlockSpec((None, tq), lambda b, h, i: (b, 0)), pl.BlockSpec((None, tk), lambda b, h, i: (b, 0))]


def _forward(cfg: _Config, q: Array, k: Array, v: Array, q_seg: Array, kv_seg: Array, offset: Array,
             count_visits: bool = False) -> tuple[Array, ...]:
    b, tq, nq_heads, d = q.shape
    tk = k.shape[1]
    group = nq_heads // k.shape[2]
    nq = tq // cfg.block_q
    sched = block_schedule(q_seg, cfg.block_q, cfg.block_k, cfg.causal, kv_segment_ids=kv_seg, q_offset=offset[0],
                           window=cfg.window)
    row = pl.BlockSpec((None, tk, None, d), lambda b_, h, i: (b_, 0, h // group, 0))
    q_tile = pl.BlockSpec((None, cfg.block_q, None, d), lambda b_, h, i: (b_, i, h, 0))
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, nq_heads, tq), jnp.float32)]
    out_specs = [q_tile, pl.BlockSpec((None, None, cfg.block_q), lambda b_, h, i: (b_, h, i))]
    if count_visits:
        out_shape.append(jax.ShapeDtypeStruct((b, nq_heads, nq), jnp.int32))
        out_specs.append(pl.BlockSpec((None, None, 1), lambda b_, h, i: (b_, h, i)))
    kernel = functools.partial(_forward_kernel, scale=cfg.scale, causal=cfg.causal, window=cfg.window,
                               block_q=cfg.block_q, block_k=cfg.block_k)
    return pl.pallas_call(
        kernel, grid=(b, nq_heads, nq), out_shape=out_shape, out_specs=out_specs,
        in_specs=[*_bound_specs(nq), *_segment_specs(tq, tk), q_tile, row, row],
        compiler_params=_compiler_params(d), interpret=cfg.interpret, name="segment_flash_forward",
    )(sched.kv_lo, sched.kv_hi, offset, q_seg, kv_seg, q, k, v)


def _backward(cfg: _Config, res: tuple[Array, ...], do: Array) -> tuple[Array, Array, Array, None, None, None]:
    q, k, v, q_seg, kv_seg, offset, o, lse = res
    b, tq, nq_heads, d = q.shape
    tk, nkv = k.shape[1], k.shape[2]
    group = nq_heads // nkv
    nq, nk = tq // cfg.block_q, tk // cfg.block_k
    sched = block_schedule(q_seg, cfg.block_q, cfg.block_k, cfg.causal, kv_segment_ids=kv_seg, q_offset=offset[0],
                           window=cfg.window)
    # D_i = rowsum(dO * O): one elementwise pass, left to XLA to fuse
    delta = jnp.einsum("bthd,bthd->bht", do.astype(jnp.float32), o.astype(jnp.float32))
    kw = dict(scale=cfg.scale, causal=cfg.causal, window=cfg.window, block_q=cfg.block_q, block_k=cfg.block_k)

    kv_row = pl.BlockSpec((None, tk, None, d), lambda b_, h, i: (b_, 0, h // group, 0))
    q_tile = pl.BlockSpec((None, cfg.block_q, None, d), lambda b_, h, i: (b_, i, h, 0))
    stat_tile = pl.BlockSpec((None, None, cfg.block_q), lambda b_, h, i: (b_, h, i))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, **kw), grid=(b, nq_heads, nq),
        in_specs=[*_bound_specs(nq), *_segment_specs(tq, tk), q_tile, kv_row, kv_row, q_tile, stat_tile,
                  stat_tile],
        out_specs=q_tile, out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=_compiler_params(d), interpret=cfg.interpret, name="segment_flash_dq",
    )(sched.kv_lo, sched.kv_hi, offset, q_seg, kv_seg, q, k, v, do, lse, delta)

    # q heads h * group .. h * group + group - 1 share kv head h (the einsum path's grouping)
    group_rows = pl.BlockSpec((None, tq, group, d), lambda b_, h, j: (b_, 0, h, 0))
    group_stats = pl.BlockSpec((None, group, tq), lambda b_, h, j: (b_, h, 0))
    kv_tile = pl.BlockSpec((None, cfg.block_k, None, d), lambda b_, h, j: (b_, j, h, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, group=group, **kw), grid=(b, nkv, nk),
        in_specs=[*_bound_specs(nk), *_segment_specs(tq, tk), group_rows, kv_tile, kv_tile, group_rows,
                  group_stats, group_stats],
        out_specs=[kv_tile, kv_tile], out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype),
                                                 jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=_compiler_params(d), interpret=cfg.interpret, name="segment_flash_dkv",
    )(sched.q_lo, sched.q_hi, offset, q_seg, kv_seg, q, k, v, do, lse, delta)
    return dq, dk, dv, None, None, None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(cfg: _Config, q: Array, k: Array, v: Array, q_seg: Array, kv_seg: Array, offset: Array) -> Array:
    return _forward(cfg, q, k, v, q_seg, kv_seg, offset)[0]


def _attention_fwd(cfg: _Config, q: Array, k: Array, v: Array, q_seg: Array, kv_seg: Array,
                   offset: Array) -> tuple[Array, tuple]:
    o, lse = _forward(cfg, q, k, v, q_seg, kv_seg, offset)
    # named so a remat policy can keep them (``save_attention``): the backward then needs no second forward
    o, lse = checkpoint_name(o, ATTENTION_OUTPUT), checkpoint_name(lse, ATTENTION_LSE)
    return o, (q, k, v, q_seg, kv_seg, offset, o, lse)


_attention.defvjp(_attention_fwd, _backward)


def _prepare(q: Array, k: Array, v: Array, segment_ids: Array, kv_segment_ids: Array | None, q_offset: Any,
             scale: float | None, causal: bool, window: int | None, block_q: int, block_k: int,
             interpret: bool) -> tuple[_Config, tuple[Array, ...], int, int]:
    """Check shapes, clamp the blocks, and pad T to whole blocks and D to a power of two.

    Padding is exact: padded tokens are segment 0 (nobody sees them, they see only
    themselves) and zero head-dim columns add nothing to ``q . k`` and give zero
    output columns; both are sliced off. Triton needs power-of-two tile sizes. Queries
    against another row of keys (``kv_segment_ids`` given) are not padded: a padded
    query inside the keys' row would see a real key as its own diagonal, so both lengths
    must already be whole blocks.
    """
    b, tq, nq_heads, d = q.shape
    self_attention = kv_segment_ids is None
    tk = k.shape[1]
    if (k.shape != v.shape or k.shape[0] != b or k.shape[3] != d or nq_heads % k.shape[2]
            or (self_attention and tk != tq)):
        raise ValueError(f"segment_flash_attention wants q [B,Tq,Hq,D] and k, v [B,Tk,Hkv,D] with Hkv dividing Hq "
                         f"(Tk = Tq unless kv_segment_ids are given), got q {q.shape}, k {k.shape}, v {v.shape}")
    kv_segment_ids = segment_ids if self_attention else kv_segment_ids
    if segment_ids.shape != (b, tq) or kv_segment_ids.shape != (b, tk):
        raise ValueError(f"segment ids must be [B, Tq] = {(b, tq)} and [B, Tk] = {(b, tk)}, got "
                         f"{segment_ids.shape} and {kv_segment_ids.shape}")
    if window is not None and (not causal or window < 1):
        raise ValueError(f"a sliding window must be a positive number of tokens on causal attention, got {window}")
    for name, size in (("block_q", block_q), ("block_k", block_k)):
        if size < 16 or size & (size - 1):
            raise ValueError(f"{name} must be a power of two >= 16 (Triton tiles), got {size}")
    block_q, block_k = min(block_q, max(16, pl.next_power_of_2(tq))), min(block_k, max(16, pl.next_power_of_2(tk)))
    whole = max(block_q, block_k)  # both are powers of two: the larger is their lcm
    t_pad, d_pad = (-tq % whole if self_attention else 0), pl.next_power_of_2(d) - d
    if not self_attention and (tq % block_q or tk % block_k):
        raise ValueError(f"queries ({tq}) and keys ({tk}) of another row must be whole blocks of "
                         f"{block_q} / {block_k}")
    if t_pad or d_pad:
        widths = ((0, 0), (0, t_pad), (0, 0), (0, d_pad))
        q, k, v = (jnp.pad(x, widths) for x in (q, k, v))
        segment_ids = jnp.pad(segment_ids, ((0, 0), (0, t_pad)))
        kv_segment_ids = segment_ids if self_attention else kv_segment_ids
    cfg = _Config(1.0 / math.sqrt(d) if scale is None else float(scale), causal, window, block_q, block_k, interpret)
    offset = jnp.asarray(q_offset, jnp.int32).reshape(1)
    return cfg, (q, k, v, segment_ids.astype(jnp.int32), kv_segment_ids.astype(jnp.int32), offset), tq, d


def segment_flash_attention(q: Array, k: Array, v: Array, segment_ids: Array, *, scale: float | None = None,
                            causal: bool = True, block_q: int = 64, block_k: int = 64, interpret: bool = False,
                            kv_segment_ids: Array | None = None, q_offset: Any = 0,
                            window: int | None = None) -> Array:
    """Attention of packed rows, [B, T, Hq, D], equal to the einsum path with ``build_attention_mask``.

    ``q`` [B, T, Hq, D], ``k``/``v`` [B, T, Hkv, D] (GQA: q head ``h`` uses kv head
    ``h // (Hq // Hkv)``), ``segment_ids`` [B, T] (0 = padding). The caller promises
    that each document is one contiguous run of its row with positions increasing
    along it (packing's rows), so causality on the row index is causality within the
    document; ``positions`` are therefore not an argument, and a sliding ``window``
    (key ``j`` seen by query ``i`` only if ``i - j < window``) is on row distance, which is
    position distance inside a document. ``scale`` multiplies the scores (``1/sqrt(D)`` when None). Blocks are
    powers of two, clamped to the row; T and D are padded as needed. Differentiable
    (custom VJP: Pallas dq and dk/dv kernels with the forward's tile skipping, from
    the saved row log-sum-exp). ``interpret=True`` runs the kernels in Pallas'
    interpreter (CPU, tests); otherwise they lower through Triton (GPU).

    Context parallelism: with ``kv_segment_ids`` [B, Tk], ``k``/``v`` are a longer row
    [B, Tk, Hkv, D] and query ``i`` is row index ``q_offset + i`` of it (a traced scalar
    is fine: a device's slice of a sequence split over devices). Tq and Tk must then be
    whole blocks.
    """
    cfg, args, t, d = _prepare(q, k, v, segment_ids, kv_segment_ids, q_offset, scale, causal, window, block_q,
                               block_k, interpret)
    return _attention(cfg, *args)[:, :t, :, :d]


def attention_with_visits(q: Array, k: Array, v: Array, segment_ids: Array, *, causal: bool = True,
                          block_q: int = 64, block_k: int = 64, interpret: bool = False,
                          kv_segment_ids: Array | None = None, q_offset: Any = 0,
                          window: int | None = None) -> tuple[Array, Array]:
    """The forward alone, with the number of key tiles its loop visited per ``[B, Hq, T/block_q]`` query tile.

    For debugging and the tests that the skipping happens in the kernel, not only in
    :func:`block_schedule`; not differentiable.
    """
    cfg, args, t, d = _prepare(q, k, v, segment_ids, kv_segment_ids, q_offset, None, causal, window, block_q,
                               block_k, interpret)
    out, _, visits = _forward(cfg, *args, count_visits=True)
    return out[:, :t, :, :d], visits
