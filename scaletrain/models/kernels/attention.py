"""Functional attention for every family: RoPE, masks, and the attention kernels.

Kept apart from the nnx modules in :mod:`scaletrain.models.common.layers` because these are
pure functions of arrays, shared by the training forward, the cached decoding forward
(:mod:`scaletrain.generation`) and the benchmarks that switch them
(``bench/variant_ab.py`` sets :data:`MAX_CAUSAL_BLOCKS` / :data:`MIN_CAUSAL_BLOCK`,
which are read at trace time). Two paths compute attention: the einsum path
(:func:`dot_product_attention`, float32 softmax, CPU-shaped dots) and cuDNN's fused
kernel (:func:`fused_attention`), chosen per layer by :func:`use_fused_attention`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from scaletrain.errors import ConfigError
from scaletrain.models.common.config import DecoderConfig
from scaletrain.models.kernels.cpu_dots import matmul
from scaletrain.parallel.partition import active_platform

Array = jax.Array


def rope_inv_freq(config: DecoderConfig) -> jnp.ndarray:
    """Inverse frequencies of RoPE, with ``linear``, ``llama3`` and ``yarn`` scaling (YaRN's attention factor:
    :func:`rope_attention_factor`).

    A config with ``partial_rotary_factor`` < 1 (Qwen3.5, Qwen3-Next) rotates only the first
    ``int(head_dim * factor)`` dimensions of each head: the tables are that much shorter and
    :func:`apply_rope` passes the rest through.
    """
    dim = int(config.head_dim * getattr(config, "partial_rotary_factor", 1.0))
    inv_freq = 1.0 / (config.rope_theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = jnp.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = jnp.where(is_mid, mid, scaled)
    elif kind == "yarn":
        inv_freq = _yarn_inv_freq(inv_freq, dim, config.rope_theta, scaling, config.max_position_embeddings)
    return inv_freq


def _yarn_factor(scaling: dict[str, Any], max_positions: int) -> float:
    """YaRN's context factor: ``factor``, else the ratio of the context to the original one (DeepSeek)."""
    factor = scaling.get("factor")
    return float(factor) if factor is not None else max_positions / float(scaling["original_max_position_embeddings"])


def _yarn_inv_freq(inv_freq: Array, dim: int, theta: float, scaling: dict[str, Any], max_positions: int) -> Array:
    """YaRN (Peng et al., 2023): the frequencies that turn fewer than ``beta_slow`` times over the original
    context are interpolated (divided by the factor), those that turn more than ``beta_fast`` times kept,
    with a linear ramp between; ``truncate`` (default true) rounds the ramp's ends to whole dimensions."""
    factor = _yarn_factor(scaling, max_positions)
    old_ctx = float(scaling["original_max_position_embeddings"])
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def rope_attention_factor(config: DecoderConfig) -> float:
    """What RoPE scales the rotated queries and keys by (1.0 but for YaRN, whose ``attention_factor`` defaults to
    ``0.1 ln(factor) + 1``, or the ratio of two such with DeepSeek's ``mscale`` / ``mscale_all_dim``).

    transformers multiplies cos and sin by it; both queries and keys are rotated, so the scores scale by
    its square, which is how an attention layer applies it (its softmax scale), with no table to change."""
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = _yarn_factor(scaling, config.max_position_embeddings)

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(float(scaling["mscale"])) / mscale(float(scaling["mscale_all_dim"]))
    return mscale()


def rope_tables(positions: Array, inv_freq: Array) -> tuple[Array, Array]:
    """cos and sin [B, T, 1, D/2] (float32) of the rotation angles at ``positions`` [B, T].

    Computed once per forward and shared by every layer's queries and keys (XLA may
    still fuse, i.e. recompute, them into each rotation; forcing them into memory with
    an ``optimization_barrier`` measured no faster on CPU).
    """
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, D/2]
    return jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]


def apply_rope(x: Array, rope: tuple[Array, Array]) -> Array:
    """Rotate ``x`` [B, T, H, D] by the :func:`rope_tables` (half-split layout, as transformers); tables
    shorter than D/2 (partial RoPE) rotate the first dimensions and leave the rest as they are."""
    cos, sin = rope
    rotary = 2 * cos.shape[-1]
    if rotary < x.shape[-1]:
        return jnp.concatenate([apply_rope(x[..., :rotary], rope), x[..., rotary:]], axis=-1)
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def build_attention_mask(
    segment_ids: Array, positions: Array, sliding_window: int | None
) -> Array:
    """Boolean [B, 1, T, S] mask: causal, same segment, not padding, inside the window."""
    t = segment_ids.shape[1]
    idx = jnp.arange(t)
    causal = idx[:, None] >= idx[None, :]
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    valid = (segment_ids != 0)[:, None, :]
    mask = causal[None] & same & valid
    if sliding_window is not None:
        dist = positions[:, :, None] - positions[:, None, :]
        mask = mask & (dist < sliding_window)
    # a fully padded query row would make softmax NaN: let it see itself
    mask = mask | jnp.eye(t, dtype=bool)[None]
    return mask[:, None]


@functools.partial(jax.tree_util.register_dataclass, data_fields=["ids"], meta_fields=["window", "zigzag"])
@dataclasses.dataclass(frozen=True)
class PackedSegments:
    """A row's segment ids [B, T] (0 = padding; all ones for rows that are one sequence), given to
    attention in place of the [B, 1, T, S] mask when it runs the segment-aware flash kernel
    (:mod:`scaletrain.models.kernels.flash_attention`), which reads them and never builds the mask.
    ``window``: the layer kind's sliding window (None: none). ``zigzag``: the rows are in
    :func:`scaletrain.models.kernels.flash_sharding.zigzag_order`. Both are static facts of the trace."""

    ids: Array
    window: int | None = None
    zigzag: bool = False


@functools.partial(jax.tree_util.register_dataclass, data_fields=[], meta_fields=["window"])
@dataclasses.dataclass(frozen=True)
class CausalWindow:
    """Rows that are each one unpadded sequence, seen through a sliding ``window``: token ``i``
    attends to ``j`` where ``i - window < j <= i``. Given to attention in place of the
    [B, 1, T, S] mask because it needs no array: cuDNN takes the window itself (its
    ``sliding_window_length``, no bias to read or differentiate) and the einsum path builds
    it from iotas inside each block's fusion, as for plain causal attention."""

    window: int

    def block(self, q0: int, q1: int, s: int) -> Array:
        """The [1, 1, q1 - q0, s] booleans of queries ``q0:q1`` against keys ``0:s``."""
        dist = jnp.arange(q0, q1)[:, None] - jnp.arange(s)[None, :]
        return ((dist >= 0) & (dist < self.window))[None, None]


class ForwardInputs(NamedTuple):
    """What each attention layer of a training forward reads besides the hidden states."""

    positions: Array  # [B, T] RoPE positions
    segment_ids: Array  # [B, T] the document of each token, 0 for padding
    # [B, 1, T, S] boolean, the segment ids, a window over unpacked rows, or None for plain causal
    mask: Array | PackedSegments | CausalWindow | None
    rope: tuple[Array, Array]  # rope_tables(positions, inv_freq)


def prepare_inputs(input_ids: Array, positions: Array | None, segment_ids: Array | None,
                   attention_mask: Array | None, window: int | None, inv_freq: Array,
                   mechanism: str = "auto") -> ForwardInputs:
    """The :class:`ForwardInputs` of one kind of attention layer (its ``window`` and RoPE ``inv_freq``).

    ``segment_ids`` default to ``attention_mask`` (else one segment per row) and ``positions``
    count each row's real tokens. A model whose layers differ in window or RoPE (Gemma 3's
    local and global layers) calls this once per kind with the same inputs, so every family
    reads the inputs one way. With ``mechanism="pallas"`` ``mask`` is the
    :class:`PackedSegments` (with the window), for any rows. Otherwise, with no segment ids or
    attention mask, every row is one unpadded sequence: ``mask`` is None (plain causal
    attention) or, with a window and no ``positions`` given (the window counts positions, which
    are then the token indices), :class:`CausalWindow`; there is no [B, 1, T, S] mask to build,
    read, or (on cuDNN, where a mask becomes a bias) differentiate.
    """
    one_sequence_per_row = segment_ids is None and attention_mask is None
    positions_are_indices = positions is None
    if segment_ids is None:
        segment_ids = attention_mask.astype(jnp.int32) if attention_mask is not None else jnp.ones_like(input_ids)
    if positions is None:
        positions = jnp.maximum(jnp.cumsum(segment_ids != 0, axis=1) - 1, 0).astype(jnp.int32)
    if mechanism == "pallas":
        mask = PackedSegments(segment_ids, window=window)
    elif one_sequence_per_row and window is None:
        mask = None
    elif one_sequence_per_row and positions_are_indices:
        mask = CausalWindow(window)
    else:
        mask = build_attention_mask(segment_ids, positions, window)
    return ForwardInputs(positions, segment_ids, mask, rope_tables(positions, inv_freq))


class KVCache(NamedTuple):
    """One layer's keys and values, [B, S, kv_heads, head_dim], for S fixed cache slots."""

    keys: Array
    values: Array


def build_cache_mask(start: Array, num_queries: int, kv_valid: Array, sliding_window: int | None) -> Array:
    """Boolean [B, 1, T, S] mask for queries at cache slots ``start + arange(T)``.

    ``kv_valid`` [B, S] marks slots holding a real token (prompt padding and
    not-yet-written slots are False). Prompts are left-padded, so slot distance
    equals position distance between real tokens and the window can use slots.
    """
    q_slot = start + jnp.arange(num_queries)
    k_slot = jnp.arange(kv_valid.shape[1])
    mask = (k_slot[None, :] <= q_slot[:, None])[None] & kv_valid[:, None, :].astype(bool)
    if sliding_window is not None:
        mask = mask & ((q_slot[:, None] - k_slot[None, :]) < sliding_window)[None]
    # a padding query would see no key at all (NaN softmax): let it see itself
    mask = mask | (k_slot[None, :] == q_slot[:, None])[None]
    return mask[:, None]


#: Causal self-attention computes the [T, S] scores in at most this many query blocks,
#: each against the keys up to its own end, so the blocks above the diagonal (which the
#: mask would zero) are never computed: (n + 1) / (2n) of the full work for n blocks.
MAX_CAUSAL_BLOCKS = 4
#: Queries per block at least (smaller dots lose more to overhead than they save).
MIN_CAUSAL_BLOCK = 128


def causal_blocks(t: int, s: int) -> int:
    """How many query blocks :func:`dot_product_attention` may split a causal ``[T, S=T]`` score into."""
    if t != s:
        return 1
    n = min(MAX_CAUSAL_BLOCKS, t // MIN_CAUSAL_BLOCK)
    while n > 1 and t % n:
        n -= 1
    return max(n, 1)


#: the smallest head_dim whose decode keys :func:`dot_product_attention` pins (``pin_keys``)
PIN_MIN_HEAD_DIM = 64


def dot_product_attention(q: Array, k: Array, v: Array, mask: Array | CausalWindow | None, softmax_dtype: Any,
                          precision: Any, blocks: int = 1, scale: float | None = None,
                          pin_keys: bool = False, sinks: Array | None = None) -> Array:
    """Softmax attention with GQA; scores and softmax in ``softmax_dtype`` (float32 by default).

    Heads are moved in front of the sequence (``[B, kv, group, T, D]``) before the
    dots, so both are batched over (B, kv) with the contraction last on the lhs: the
    layout XLA CPU runs on YNNPACK without copying the [T, S] scores (see
    :mod:`scaletrain.models.kernels.cpu_dots`). The moves fuse into RoPE or copy [T, D]-sized
    tensors only.

    ``blocks > 1`` (causal self-attention only, ``mask`` zero above the diagonal):
    query block ``i`` attends to keys ``[0, (i + 1) T / blocks)`` only. The skipped
    scores are masked to exactly zero probability anyway, so the result is the same
    up to summation order, for about ``(blocks + 1) / (2 blocks)`` of the work.

    ``mask=None`` is causal self-attention (``S == T``), the mask made from positions
    inside each block's fusion rather than read from memory; a :class:`CausalWindow` the
    same with its window. ``scale`` multiplies the
    scores (``1 / sqrt(head_dim)`` when None; Gemma 3 uses ``query_pre_attn_scalar ** -0.5``).

    ``pin_keys`` (decoding on CPU): keep the keys in the ``[b, kv, s, d]`` layout they arrive in
    (heads of at least :data:`PIN_MIN_HEAD_DIM`). For a one-token query XLA CPU would otherwise
    copy them into ``[b, kv, d, s]`` every step for another YNNPACK kernel than the training
    forward's score dot runs, whose sums round differently: measured on SmolLM2-135M, decode
    attention then equals the training forward's bit for bit instead of within ~1e-6 per layer.
    With smaller heads (16, 32) XLA lowers the dots otherwise and pinning measured no better.

    ``sinks`` [heads] (GPT-OSS): one learned logit per query head that joins every row's softmax
    denominator and attends to nothing, so a query may give part of its weight to no key at all.
    """
    b, t, nq, d = q.shape
    nkv = k.shape[2]
    group = nq // nkv
    qh = q.reshape(b, t, nkv, group, d).transpose(0, 2, 3, 1, 4)  # [b, kv, g, t, d]
    kh = k.transpose(0, 2, 1, 3)  # [b, kv, s, d]
    vh = v.transpose(0, 2, 1, 3)
    if pin_keys and d >= PIN_MIN_HEAD_DIM:
        kh = jax.lax.optimization_barrier(kh)
    scale = 1.0 / math.sqrt(d) if scale is None else scale

    def attend(qb: Array, kb: Array, vb: Array, mb: Array) -> Array:
        scores = matmul(qb, kb, batch=2, rhs_transposed=True, precision=precision).astype(softmax_dtype)
        scores = jnp.where(mb[:, :, None], scores * jnp.asarray(scale, softmax_dtype),
                           jnp.finfo(softmax_dtype).min)
        if sinks is None:
            probs = jax.nn.softmax(scores, axis=-1).astype(vb.dtype)
        else:  # the sink joins the normaliser: exp(s - logaddexp(logsumexp(s), sink))
            sink = sinks.astype(softmax_dtype).reshape(1, nkv, group, 1, 1)
            norm = jnp.logaddexp(jax.nn.logsumexp(scores, axis=-1, keepdims=True), sink)
            probs = jnp.exp(scores - norm).astype(vb.dtype)
        return matmul(probs, vb, batch=2, precision=precision)  # [b, kv, g, tq, d]

    def block_mask(q0: int, q1: int, s: int) -> Array:
        if isinstance(mask, CausalWindow):
            return mask.block(q0, q1, s)
        if mask is not None:
            return mask[:, :, q0:q1, :s]
        return (jnp.arange(q0, q1)[:, None] >= jnp.arange(s)[None, :])[None, None]

    if blocks <= 1:
        out = attend(qh, kh, vh, block_mask(0, t, kh.shape[2]))
    else:
        # a window's blocks could also skip the keys left of it, but keep the causal blocks' shapes:
        # Gemma 3's stacked layers run both kinds in one lax.cond, which keeps one set of saved
        # scores for both branches only where their shapes agree (+2.96 GB of temporaries for the
        # Gemma-3-1B step on XLA's attention when they did not; bench/aot.py --model gemma3-1b)
        size = t // blocks
        out = jnp.concatenate(
            [attend(qh[:, :, :, i * size:(i + 1) * size], kh[:, :, :(i + 1) * size], vh[:, :, :(i + 1) * size],
                    block_mask(i * size, (i + 1) * size, (i + 1) * size)) for i in range(blocks)],
            axis=3,
        )
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, nq, v.shape[-1])  # values may be narrower (MLA)


def use_fused_attention(mechanism: str, dtype: Any, head_dim: int, sharding_problem: str | None = None) -> bool:
    """Whether to call cuDNN's fused attention instead of the einsum + softmax path.

    ``attn_mechanism="cudnn"`` forces it; ``"auto"`` (and ``"sdpa"``) picks it where it
    exists and is exact for us: a GPU backend, bf16/fp16 compute, a head dim cuDNN
    takes (a multiple of 8, at most 128), and inputs JAX's cuDNN partitioner accepts as
    the mesh shards them — ``sharding_problem`` says why not (a sequence split over
    devices, heads that do not divide over tp: both found by compiling for 8 H100s
    ahead of time, ``bench/aot.py``); there the einsum path leaves the collectives
    to XLA, and a forced ``cudnn`` is a ``ConfigError``. Anything else (CPU, float32,
    ``"xla"``, ``"vanilla"``) keeps :func:`dot_product_attention`, whose float32 softmax
    the HF parity tests check.
    """
    if mechanism == "cudnn":
        if sharding_problem:
            raise ConfigError(f"model.attn_mechanism: 'cudnn' {sharding_problem}; use 'auto' (einsum attention "
                              "there) or change mesh.axis_dims")
        return True
    if mechanism not in ("auto", "sdpa"):
        return False
    return (
        active_platform() == "gpu"
        and sharding_problem is None
        and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        and head_dim % 8 == 0
        and head_dim <= 128
    )


def fused_attention(q: Array, k: Array, v: Array, mask: Array | CausalWindow | None,
                    implementation: str | None = "cudnn", scale: float | None = None) -> Array:
    """``jax.nn.dot_product_attention`` on cuDNN (flash attention: no [T, S] scores kept).

    The boolean ``mask`` [B, 1, T, S] from :func:`build_attention_mask` carries the
    same-segment, padding and window constraints (cuDNN adds it as a bias), and
    ``is_causal`` lets cuDNN skip the blocks above the diagonal, so packed rows keep
    exactly the semantics of the einsum path. Softmax runs in float32 inside cuDNN.
    ``mask=None`` (rows that are one unpadded sequence) is ``is_causal`` alone: cuDNN's
    kernel without a bias, whose backward also has no bias gradient to write; a
    :class:`CausalWindow` is that kernel with cuDNN's own sliding window (``local_window_size``
    ``(window - 1, 0)``: the ``window`` keys up to the query), again with no bias.
    """
    if isinstance(mask, CausalWindow):
        return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                            local_window_size=(mask.window - 1, 0), implementation=implementation)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, is_causal=True,
                                        implementation=implementation)
