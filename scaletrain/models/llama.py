"""Llama-family causal decoder in Flax NNX (Llama, Mistral, Qwen2).

Pre-norm blocks of grouped-query attention with RoPE and a SwiGLU MLP, RMSNorm,
optional q/k/v(/o) biases, optional tied embeddings. Parameters are float32 by
default (``param_dtype``) and cast to the compute ``dtype`` at use, so bf16 compute
keeps float32 master weights. Every parameter carries ``logical_axes`` metadata that
:mod:`scaletrain.parallel.partition` maps onto the mesh.

Packed rows are supported through ``segment_ids`` (tokens attend only within their
own segment; 0 marks padding) and per-document ``positions`` for RoPE.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from scaletrain.errors import ConfigError
from scaletrain.models.cpu_dots import BATCHED_MATMUL, MATMUL, matmul
from scaletrain.models.config import LlamaConfig, MistralConfig, Qwen2Config, effective_sliding_window
from scaletrain.models.task import TaskType
from scaletrain.parallel.partition import active_axis_size, active_platform, active_sharding_axes

Array = jax.Array


def _init(config: LlamaConfig, scale: float = 1.0) -> Any:
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
        config: LlamaConfig,
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
        self.precision = precision

    def __call__(self, x: Array) -> Array:
        y = matmul(x.astype(self.dtype), self.kernel[...].astype(self.dtype), precision=self.precision)
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


def rope_inv_freq(config: LlamaConfig) -> jnp.ndarray:
    """Inverse frequencies of RoPE, with ``linear`` and ``llama3`` scaling."""
    dim = config.head_dim
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
    return inv_freq


def rope_tables(positions: Array, inv_freq: Array) -> tuple[Array, Array]:
    """cos and sin [B, T, 1, D/2] (float32) of the rotation angles at ``positions`` [B, T].

    Computed once per forward and shared by every layer's queries and keys (XLA may
    still fuse, i.e. recompute, them into each rotation; forcing them into memory with
    an ``optimization_barrier`` measured no faster on CPU).
    """
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, D/2]
    return jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]


def apply_rope(x: Array, rope: tuple[Array, Array]) -> Array:
    """Rotate ``x`` [B, T, H, D] by the :func:`rope_tables` (half-split layout, as transformers)."""
    cos, sin = rope
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


class Attention(nnx.Module):
    """Grouped-query attention with RoPE."""

    def __init__(self, config: LlamaConfig, dtype: Any, param_dtype: Any, precision: Any, rngs: nnx.Rngs):
        h, d = config.hidden_size, config.head_dim
        nq, nkv = config.num_attention_heads, config.num_key_value_heads
        qkv_bias = config.attention_bias or config.qkv_bias
        kw = dict(config=config, dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)
        self.q_proj = Dense(h, nq * d, ("embed", "heads"), use_bias=qkv_bias, **kw)
        self.k_proj = Dense(h, nkv * d, ("embed", "kv_heads"), use_bias=qkv_bias, **kw)
        self.v_proj = Dense(h, nkv * d, ("embed", "kv_heads"), use_bias=qkv_bias, **kw)
        self.o_proj = Dense(nq * d, h, ("heads", "embed"), use_bias=config.attention_bias, **kw)
        self.num_heads, self.num_kv_heads, self.head_dim = nq, nkv, d
        self.dtype = dtype
        self.softmax_dtype = jnp.dtype(config.attn_softmax_dtype or "float32")
        self.precision = precision
        self.mechanism = config.attn_mechanism
        self.sequence_axis = config.partition_axis.sequence_axis
        self.head_axes = (config.partition_axis.head_axis, config.partition_axis.kv_head_axis)

    def __call__(self, x: Array, mask: Array | None, rope: tuple[Array, Array]) -> Array:
        """Self-attention over ``x``; ``mask`` [B, 1, T, S] from :func:`build_attention_mask`, or None
        for plain causal attention (each row one unpadded sequence)."""
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        q = apply_rope(q, rope)
        k = apply_rope(k, rope)
        sequence_split = active_axis_size(self.sequence_axis) > 1
        if use_fused_attention(self.mechanism, q.dtype, self.head_dim, self._cudnn_sharding_problem(sequence_split)):
            out = fused_attention(q, k, v, mask)
        else:
            # query blocks slice the sequence: not where it is split over devices (sp)
            blocks = 1 if sequence_split else causal_blocks(t, t)
            out = dot_product_attention(q, k, v, mask, self.softmax_dtype, self.precision, blocks=blocks)
        out = checkpoint_name(out, "attn_out")
        return self.o_proj(out.reshape(b, t, self.num_heads * self.head_dim))

    def _cudnn_sharding_problem(self, sequence_split: bool) -> str | None:
        """Why JAX's cuDNN attention cannot take this layer's inputs as the active mesh shards
        them (its partitioner needs whole sequences and evenly split heads), or None."""
        if sequence_split:
            return "cannot attend over a sequence split across devices (mesh axis sp > 1)"
        q_split, kv_split = (active_axis_size(a) for a in self.head_axes)
        if self.num_heads % q_split or self.num_kv_heads % kv_split:
            return (f"needs the {self.num_heads} query and {self.num_kv_heads} key/value heads to split evenly "
                    f"over the {q_split} / {kv_split} devices of the head axes (tp)")
        return None

    def call_with_cache(
        self, x: Array, mask: Array, rope: tuple[Array, Array], cache: KVCache, start: Array
    ) -> tuple[Array, KVCache]:
        """Attend from ``x`` (cache slots ``[start, start + T)``) over the whole cache.

        The new keys and values are written into the fixed-size cache first, so the
        same compiled step serves every position; ``mask`` [B, 1, T, S] hides the
        slots that are empty, padding, in the future or outside the window.
        """
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        q = apply_rope(q, rope)
        k = apply_rope(k, rope)
        keys = lax.dynamic_update_slice_in_dim(cache.keys, k.astype(cache.keys.dtype), start, axis=1)
        values = lax.dynamic_update_slice_in_dim(cache.values, v.astype(cache.values.dtype), start, axis=1)
        out = dot_product_attention(q, keys, values, mask, self.softmax_dtype, self.precision)
        return self.o_proj(out.reshape(b, t, self.num_heads * self.head_dim)), KVCache(keys, values)


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


def dot_product_attention(q: Array, k: Array, v: Array, mask: Array | None, softmax_dtype: Any, precision: Any,
                          blocks: int = 1) -> Array:
    """Softmax attention with GQA; scores and softmax in ``softmax_dtype`` (float32 by default).

    Heads are moved in front of the sequence (``[B, kv, group, T, D]``) before the
    dots, so both are batched over (B, kv) with the contraction last on the lhs: the
    layout XLA CPU runs on YNNPACK without copying the [T, S] scores (see
    :mod:`scaletrain.models.cpu_dots`). The moves fuse into RoPE or copy [T, D]-sized
    tensors only.

    ``blocks > 1`` (causal self-attention only, ``mask`` zero above the diagonal):
    query block ``i`` attends to keys ``[0, (i + 1) T / blocks)`` only. The skipped
    scores are masked to exactly zero probability anyway, so the result is the same
    up to summation order, for about ``(blocks + 1) / (2 blocks)`` of the work.

    ``mask=None`` is causal self-attention (``S == T``), the mask made from positions
    inside each block's fusion rather than read from memory.
    """
    b, t, nq, d = q.shape
    nkv = k.shape[2]
    group = nq // nkv
    qh = q.reshape(b, t, nkv, group, d).transpose(0, 2, 3, 1, 4)  # [b, kv, g, t, d]
    kh = k.transpose(0, 2, 1, 3)  # [b, kv, s, d]
    vh = v.transpose(0, 2, 1, 3)
    scale = 1.0 / math.sqrt(d)

    def attend(qb: Array, kb: Array, vb: Array, mb: Array) -> Array:
        scores = matmul(qb, kb, batch=2, rhs_transposed=True, precision=precision).astype(softmax_dtype)
        scores = jnp.where(mb[:, :, None], scores * jnp.asarray(scale, softmax_dtype),
                           jnp.finfo(softmax_dtype).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(vb.dtype)
        return matmul(probs, vb, batch=2, precision=precision)  # [b, kv, g, tq, d]

    def block_mask(q0: int, q1: int, s: int) -> Array:
        if mask is not None:
            return mask[:, :, q0:q1, :s]
        return (jnp.arange(q0, q1)[:, None] >= jnp.arange(s)[None, :])[None, None]

    if blocks <= 1:
        out = attend(qh, kh, vh, block_mask(0, t, kh.shape[2]))
    else:
        size = t // blocks
        out = jnp.concatenate(
            [attend(qh[:, :, :, i * size:(i + 1) * size], kh[:, :, :(i + 1) * size], vh[:, :, :(i + 1) * size],
                    block_mask(i * size, (i + 1) * size, (i + 1) * size)) for i in range(blocks)],
            axis=3,
        )
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, nq, d)


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


def fused_attention(q: Array, k: Array, v: Array, mask: Array | None,
                    implementation: str | None = "cudnn") -> Array:
    """``jax.nn.dot_product_attention`` on cuDNN (flash attention: no [T, S] scores kept).

    The boolean ``mask`` [B, 1, T, S] from :func:`build_attention_mask` carries the
    same-segment, padding and window constraints (cuDNN adds it as a bias), and
    ``is_causal`` lets cuDNN skip the blocks above the diagonal, so packed rows keep
    exactly the semantics of the einsum path. Softmax runs in float32 inside cuDNN.
    ``mask=None`` (rows that are one unpadded sequence) is ``is_causal`` alone: cuDNN's
    kernel without a bias, whose backward also has no bias gradient to write.
    """
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation=implementation)


class MLP(nnx.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: LlamaConfig, dtype: Any, param_dtype: Any, precision: Any, rngs: nnx.Rngs):
        h, i = config.hidden_size, config.intermediate_size
        kw = dict(config=config, dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)
        self.gate_proj = Dense(h, i, ("embed", "mlp"), use_bias=config.mlp_bias, **kw)
        self.up_proj = Dense(h, i, ("embed", "mlp"), use_bias=config.mlp_bias, **kw)
        self.down_proj = Dense(i, h, ("mlp", "embed"), use_bias=config.mlp_bias, **kw)

    def __call__(self, x: Array) -> Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    """Pre-norm residual block: attention then MLP."""

    def __init__(self, config: LlamaConfig, dtype: Any, param_dtype: Any, precision: Any, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, param_dtype)
        self.self_attn = Attention(config, dtype, param_dtype, precision, rngs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, param_dtype)
        self.mlp = MLP(config, dtype, param_dtype, precision, rngs)

    def __call__(self, x: Array, mask: Array | None, rope: tuple[Array, Array]) -> Array:
        x = x + self.self_attn(self.input_layernorm(x), mask, rope)
        return x + self.mlp(self.post_attention_layernorm(x))

    def call_with_cache(
        self, x: Array, mask: Array, rope: tuple[Array, Array], cache: KVCache, start: Array
    ) -> tuple[Array, KVCache]:
        """The block's forward for decoding: same maths, keys/values kept in ``cache``."""
        attn, cache = self.self_attn.call_with_cache(
            self.input_layernorm(x), mask, rope, cache, start
        )
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), cache


_REMAT_POLICIES = {
    "full": None,
    # cpu_dots.matmul names its outputs: its custom VJP hides the dot from checkpoint_dots
    "dots": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.checkpoint_dots,
        jax.checkpoint_policies.save_only_these_names(MATMUL, BATCHED_MATMUL),
    ),
    "dots_with_no_batch_dims": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
        jax.checkpoint_policies.save_only_these_names(MATMUL),
    ),
    "save_attention": jax.checkpoint_policies.save_only_these_names("attn_out"),
}


def _constrain(x: Array, spec: tuple[Any, ...]) -> Array:
    """Shard an activation when a mesh is active (a no-op outside ``jax.set_mesh``).

    Mesh axes that are absent, of size 1, or that do not divide the dimension are
    dropped, so a batch of 1 (generation) still runs on an 8-way mesh.
    """
    if jax.sharding.get_abstract_mesh().empty:
        return x
    parts = [active_sharding_axes(axes, dim) or None for dim, axes in zip(x.shape, spec)]
    return lax.with_sharding_constraint(x, PartitionSpec(*parts))


class LlamaModel(nnx.Module):
    """Embeddings, decoder layers and the final norm."""

    def __init__(self, config: LlamaConfig, dtype: Any, param_dtype: Any, precision: Any, rngs: nnx.Rngs):
        self.embed_tokens = nnx.Param(
            _init(config)(rngs.params(), (config.vocab_size, config.hidden_size), param_dtype),
            logical_axes=("vocab", "embed"),
        )
        self.layers = nnx.List(
            [DecoderLayer(config, dtype, param_dtype, precision, rngs) for _ in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, param_dtype)
        self.dtype = dtype


class LlamaForCausalLM(nnx.Module):
    """Decoder with a language-model head; ``__call__`` returns float32-ready logits in ``dtype``."""

    _model_type: ClassVar[str] = "llama"
    _model_task: ClassVar[TaskType] = TaskType.CAUSAL_LM
    config_class: ClassVar[type[LlamaConfig]] = LlamaConfig

    def __init__(
        self,
        config: LlamaConfig,
        dtype: Any = jnp.float32,
        param_dtype: Any = jnp.float32,
        precision: Any = None,
        *,
        rngs: nnx.Rngs,
    ):
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.param_dtype = jnp.dtype(param_dtype)
        self.precision = precision
        self.model = LlamaModel(config, self.dtype, self.param_dtype, precision, rngs)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Dense(
                config.hidden_size,
                config.vocab_size,
                ("embed", "vocab"),
                use_bias=False,
                config=config,
                dtype=self.dtype,
                param_dtype=self.param_dtype,
                precision=precision,
                rngs=rngs,
            )
        )

    # -- forward --------------------------------------------------------------
    def hidden_states(
        self,
        input_ids: Array,
        positions: Array | None = None,
        segment_ids: Array | None = None,
        attention_mask: Array | None = None,
    ) -> Array:
        """Final-norm hidden states [B, T, hidden]."""
        cfg = self.config
        pa = cfg.partition_axis
        act_spec = (pa.batch_axis, pa.sequence_axis, None)
        window = effective_sliding_window(cfg)
        causal_only = segment_ids is None and attention_mask is None and window is None
        if segment_ids is None:
            segment_ids = (
                attention_mask.astype(jnp.int32) if attention_mask is not None else jnp.ones_like(input_ids)
            )
        if positions is None:
            positions = jnp.maximum(jnp.cumsum(segment_ids != 0, axis=1) - 1, 0).astype(jnp.int32)
        # one unpadded sequence per row: plain causal attention, with no [B, 1, T, S] mask to
        # build, read, or (on cuDNN, where a mask becomes a bias) differentiate
        mask = None if causal_only else build_attention_mask(segment_ids, positions, window)
        rope = rope_tables(positions, rope_inv_freq(cfg))
        x = jnp.take(self.model.embed_tokens[...], input_ids, axis=0).astype(self.dtype)
        x = _constrain(x, act_spec)
        policy = cfg.gradient_checkpointing
        for layer in self.model.layers:
            if policy == "none":
                x = layer(x, mask, rope)
            else:
                x = nnx.remat(lambda lyr, *a: lyr(*a), policy=_REMAT_POLICIES[policy])(
                    layer, x, mask, rope
                )
            x = _constrain(x, act_spec)
        return self.model.norm(x)

    def lm_head_weight(self) -> tuple[Array, bool]:
        """The output projection and whether it is transposed.

        ``([hidden, vocab], False)`` for a separate head; ``([vocab, hidden], True)``,
        the embedding itself, when tied: a transposed rhs costs the matmul nothing,
        while materialising the embedding's transpose would copy it every step.
        """
        if self.lm_head is None:
            return self.model.embed_tokens[...], True
        return self.lm_head.kernel[...], False

    def compute_logits(self, hidden: Array) -> Array:
        """Logits in the compute dtype from hidden states [..., hidden]."""
        w, transposed = self.lm_head_weight()
        return matmul(hidden.astype(self.dtype), w.astype(self.dtype), rhs_transposed=transposed,
                      precision=self.precision)

    def __call__(
        self,
        input_ids: Array,
        positions: Array | None = None,
        segment_ids: Array | None = None,
        attention_mask: Array | None = None,
    ) -> Array:
        return self.compute_logits(self.hidden_states(input_ids, positions, segment_ids, attention_mask))

    # -- incremental decoding ---------------------------------------------------
    def init_cache(self, batch_size: int, max_length: int, dtype: Any = None) -> list[KVCache]:
        """Empty per-layer key/value caches of ``max_length`` slots (compute dtype by default)."""
        cfg = self.config
        shape = (batch_size, max_length, cfg.num_key_value_heads, cfg.head_dim)
        dtype = self.dtype if dtype is None else dtype
        return [KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(cfg.num_hidden_layers)]

    def forward_with_cache(
        self,
        input_ids: Array,
        positions: Array,
        cache: list[KVCache],
        start: Array,
        kv_valid: Array,
    ) -> tuple[Array, list[KVCache]]:
        """Final-norm hidden states [B, T, hidden] of tokens written at cache slots ``[start, start+T)``.

        Used by :func:`scaletrain.generation.generate` for the prefill (T = prompt
        length) and each decode step (T = 1). ``kv_valid`` [B, S] must already mark
        the new tokens' slots. Kept apart from ``__call__`` so the training forward
        stays exactly as it is; :func:`build_cache_mask` gives the same attention
        pattern as :func:`build_attention_mask` for left-padded rows.
        """
        mask = build_cache_mask(start, input_ids.shape[1], kv_valid, effective_sliding_window(self.config))
        rope = rope_tables(positions, rope_inv_freq(self.config))
        x = jnp.take(self.model.embed_tokens[...], input_ids, axis=0).astype(self.dtype)
        new_cache = []
        for layer, layer_cache in zip(self.model.layers, cache, strict=True):
            x, layer_cache = layer.call_with_cache(x, mask, rope, layer_cache, start)
            new_cache.append(layer_cache)
        return self.model.norm(x), new_cache

    # -- Hugging Face format ------------------------------------------------------
    def save_pretrained(self, save_directory: str, tokenizer: Any = None, max_shard_size: int | str = "2GB") -> str:
        """Write a transformers-loadable folder (config.json, safetensors, tokenizer); returns its path."""
        from scaletrain.models.hf import save_hf_checkpoint

        return save_hf_checkpoint(self, save_directory, tokenizer=tokenizer, max_shard_size=max_shard_size)

    @classmethod
    def from_pretrained(cls, local_dir: str, **kwargs: Any) -> LlamaForCausalLM:
        """Load a local Hugging Face folder of this class's ``model_type`` (see ``load_hf_checkpoint``)."""
        from scaletrain.models.hf import load_hf_checkpoint

        return load_hf_checkpoint(local_dir, expected_model_type=cls._model_type, **kwargs)



class MistralForCausalLM(LlamaForCausalLM):
    _model_type: ClassVar[str] = "mistral"
    config_class: ClassVar[type[LlamaConfig]] = MistralConfig


class Qwen2ForCausalLM(LlamaForCausalLM):
    _model_type: ClassVar[str] = "qwen2"
    config_class: ClassVar[type[LlamaConfig]] = Qwen2Config
