"""Llama-family causal decoder in Flax NNX (Llama, Mistral, Qwen2, Qwen3).

Pre-norm blocks of grouped-query attention with RoPE and a SwiGLU MLP, RMSNorm,
optional q/k/v(/o) biases, optional per-head q/k norms, optional tied embeddings. Parameters are float32 by
default (``param_dtype``) and cast to the compute ``dtype`` at use, so bf16 compute
keeps float32 master weights. Every parameter carries ``logical_axes`` metadata that
:mod:`scaletrain.parallel.partition` maps onto the mesh.

Packed rows are supported through ``segment_ids`` (tokens attend only within their
own segment; 0 marks padding) and per-document ``positions`` for RoPE. RoPE, the masks
and the attention kernels themselves are functions in :mod:`scaletrain.models.attention`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from scaletrain.errors import ConfigError
from scaletrain.models.attention import (
    CausalWindow,
    ForwardInputs,
    KVCache,
    PackedSegments,
    apply_rope,
    build_cache_mask,
    causal_blocks,
    dot_product_attention,
    fused_attention,
    prepare_inputs,
    rope_inv_freq,
    rope_tables,
    use_fused_attention,
)
from scaletrain.models.config import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config, effective_sliding_window
from scaletrain.models.cpu_dots import matmul
from scaletrain.models.dense import Dense, RMSNorm, _init
from scaletrain.models.flash_attention import ATTENTION_OUTPUT
from scaletrain.models.flash_sharding import sharded_flash_attention, training_mechanism, zigzag_inputs
from scaletrain.models.fp8 import glu_product
from scaletrain.models.layer_stack import build_layers
from scaletrain.models.remat import run_layer
from scaletrain.models.stacked_layers import StackedLayers, fold_layers
from scaletrain.models.task import TaskType
from scaletrain.parallel.partition import active_axis_size, active_sharding_axes

Array = jax.Array


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
        self.q_norm = self._head_norm(config, dtype, param_dtype)
        self.k_norm = self._head_norm(config, dtype, param_dtype)
        # softmax scale; None is 1/sqrt(head_dim) (Gemma 3 sets query_pre_attn_scalar ** -0.5)
        self.scale: float | None = None
        self.num_heads, self.num_kv_heads, self.head_dim = nq, nkv, d
        self.dtype = dtype
        self.softmax_dtype = jnp.dtype(config.attn_softmax_dtype or "float32")
        self.precision = precision
        self.mechanism = config.attn_mechanism
        self.sequence_axis, self.batch_axis = config.partition_axis.sequence_axis, config.partition_axis.batch_axis
        self.head_axes = (config.partition_axis.head_axis, config.partition_axis.kv_head_axis)

    def __call__(self, x: Array, mask: Array | PackedSegments | CausalWindow | None,
                 rope: tuple[Array, Array]) -> Array:
        """Self-attention over ``x``; ``mask`` [B, 1, T, S] from :func:`build_attention_mask`, the
        segment ids (:class:`PackedSegments`), or for rows that are each one unpadded sequence a
        :class:`CausalWindow` or None (plain causal attention)."""
        b, t, _ = x.shape
        q, k, v = self._qkv(x, rope)
        sequence_split = active_axis_size(self.sequence_axis) > 1
        if isinstance(mask, PackedSegments):  # the flash kernel (see flash_sharding.training_mechanism)
            if problem := self._head_split_problem():
                raise ConfigError(f"model.attn_mechanism: 'pallas' {problem}; use 'auto'")
            out = sharded_flash_attention(q, k, v, mask.ids, scale=self.scale, batch_axis=self.batch_axis,
                                          sequence_axis=self.sequence_axis, head_axis=self.head_axes[0],
                                          kv_head_axis=self.head_axes[1], window=mask.window, zigzag=mask.zigzag)
        elif use_fused_attention(self.mechanism, q.dtype, self.head_dim, self._cudnn_sharding_problem(sequence_split)):
            out = fused_attention(q, k, v, mask, scale=self.scale)
        else:
            # query blocks slice the sequence: not where it is split over devices (sp)
            blocks = 1 if sequence_split else causal_blocks(t, t)
            out = dot_product_attention(q, k, v, mask, self.softmax_dtype, self.precision, blocks=blocks,
                                        scale=self.scale)
        out = checkpoint_name(out, ATTENTION_OUTPUT)
        return self.o_proj(out.reshape(b, t, self.num_heads * self.head_dim))

    def _head_norm(self, config: LlamaConfig, dtype: Any, param_dtype: Any) -> nnx.Module | None:
        """Qwen3's norm over head_dim for q or k, applied before RoPE (None unless ``qk_norm``)."""
        return RMSNorm(config.head_dim, config.rms_norm_eps, dtype, param_dtype) if config.qk_norm else None

    def _qkv(self, x: Array, rope: tuple[Array, Array]) -> tuple[Array, Array, Array]:
        """Queries, keys (normed per head when ``qk_norm``, then rotated) and values [B, T, heads, D]."""
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, rope), apply_rope(k, rope), v

    def _cudnn_sharding_problem(self, sequence_split: bool) -> str | None:
        """Why JAX's cuDNN attention cannot take this layer's inputs as the active mesh shards
        them (its partitioner needs whole sequences and evenly split heads), or None."""
        if sequence_split:
            return "cannot attend over a sequence split across devices (mesh axis sp > 1)"
        return self._head_split_problem()

    def _head_split_problem(self) -> str | None:
        """Why the heads do not split evenly over the active mesh's head axes (tp), or None."""
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
        q, k, v = self._qkv(x, rope)
        keys = lax.dynamic_update_slice_in_dim(cache.keys, k.astype(cache.keys.dtype), start, axis=1)
        values = lax.dynamic_update_slice_in_dim(cache.values, v.astype(cache.values.dtype), start, axis=1)
        out = dot_product_attention(q, keys, values, mask, self.softmax_dtype, self.precision, scale=self.scale)
        return self.o_proj(out.reshape(b, t, self.num_heads * self.head_dim)), KVCache(keys, values)


class MLP(nnx.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: LlamaConfig, dtype: Any, param_dtype: Any, precision: Any, rngs: nnx.Rngs):
        h, i = config.hidden_size, config.intermediate_size
        kw = dict(config=config, dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)
        self.gate_proj = Dense(h, i, ("embed", "mlp"), use_bias=config.mlp_bias, **kw)
        self.up_proj = Dense(h, i, ("embed", "mlp"), use_bias=config.mlp_bias, **kw)
        self.down_proj = Dense(i, h, ("mlp", "embed"), use_bias=config.mlp_bias, **kw)

    def __call__(self, x: Array) -> Array:
        return self.down_proj(glu_product(jax.nn.silu, self.gate_proj(x), self.up_proj(x), self.down_proj.fp8))


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
    """Embeddings, decoder layers and the final norm; a family swaps in its ``layer_class`` and ``norm_class``."""

    # EasyDeL's names: a base module (no head), which the trainer does not train by itself
    _model_type: ClassVar[str | None] = "llama"
    _model_task: ClassVar[TaskType] = TaskType.BASE_MODULE
    config_class: ClassVar[type[LlamaConfig]] = LlamaConfig
    layer_class: ClassVar[type[nnx.Module]] = DecoderLayer
    norm_class: ClassVar[type[nnx.Module]] = RMSNorm

    def __init__(self, config: LlamaConfig, dtype: Any, param_dtype: Any, precision: Any, rngs: nnx.Rngs):
        self.embed_tokens = nnx.Param(
            _init(config)(rngs.params(), (config.vocab_size, config.hidden_size), param_dtype),
            logical_axes=("vocab", "embed"),
        )
        # each layer from its own key: identical layers share one compiled initialiser (layer_stack)
        layer = self.layer_class
        build = lambda _, r: layer(config, dtype, param_dtype, precision, r)  # noqa: E731
        self.layers = (StackedLayers(build, config.num_hidden_layers, rngs.params()) if config.scan_layers
                       else build_layers(build, config.num_hidden_layers, rngs))
        self.norm = self.norm_class(config.hidden_size, config.rms_norm_eps, dtype, param_dtype)
        self.dtype = dtype


class LlamaForCausalLM(nnx.Module):
    """Decoder with a language-model head; ``__call__`` returns float32-ready logits in ``dtype``."""

    _model_type: ClassVar[str] = "llama"
    _model_task: ClassVar[TaskType] = TaskType.CAUSAL_LM
    config_class: ClassVar[type[LlamaConfig]] = LlamaConfig
    #: the embeddings, layers and final norm (``model.*``): what a family subclass changes
    base_model_class: ClassVar[type[LlamaModel]] = LlamaModel

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
        self.model = self.base_model_class(config, self.dtype, self.param_dtype, precision, rngs)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Dense(config.hidden_size, config.vocab_size, ("embed", "vocab"), use_bias=False, config=config,
                       dtype=self.dtype, param_dtype=self.param_dtype, precision=precision, rngs=rngs)
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
        input_ids, inputs, restore = self._forward_inputs(input_ids, positions, segment_ids, attention_mask)
        x = self._shard_activations(self._embed(input_ids))
        x, _ = fold_layers(self.model.layers, lambda layer, h: (
            self._shard_activations(self._run_layer(layer, h, inputs.mask, inputs.rope)), None), x)
        return self.model.norm(self._in_row_order(x, restore))

    # -- pieces every family's forward shares ----------------------------------------
    def _forward_inputs(self, input_ids: Array, positions: Array | None, segment_ids: Array | None,
                        attention_mask: Array | None) -> tuple[Array, ForwardInputs, np.ndarray | None]:
        """The layers' inputs, in the zigzag layout when the flash kernel splits rows over sp, and the
        permutation that puts the final hidden states back in row order (None: nothing permuted)."""
        cfg = self.config
        inputs = prepare_inputs(input_ids, positions, segment_ids, attention_mask, effective_sliding_window(cfg),
                                rope_inv_freq(cfg), training_mechanism(cfg, input_ids.shape[1]))
        return zigzag_inputs(cfg.partition_axis.sequence_axis, input_ids, inputs)

    def _in_row_order(self, x: Array, restore: np.ndarray | None) -> Array:
        """Hidden states [B, T, hidden] back in row order after :meth:`_forward_inputs`' permutation."""
        return x if restore is None else self._shard_activations(jnp.take(x, restore, axis=1))

    def _embed(self, input_ids: Array) -> Array:
        """Token embeddings [B, T, hidden] in the compute dtype (Gemma 3 scales them)."""
        return jnp.take(self.model.embed_tokens[...], input_ids, axis=0).astype(self.dtype)

    def _shard_activations(self, x: Array) -> Array:
        """``x`` [B, T, hidden] constrained to the batch and sequence axes of the active mesh."""
        pa = self.config.partition_axis
        return _constrain(x, (pa.batch_axis, pa.sequence_axis, None))

    def _run_layer(self, layer: nnx.Module, *args: Any, call: Callable[..., Any] | None = None) -> Any:
        """``layer(*args)`` (or ``call(layer, *args)``), rematerialised in the backward pass as
        ``config.gradient_checkpointing`` says."""
        return run_layer(layer, self.config.gradient_checkpointing, *args, call=call)

    def lm_head_weight(self) -> tuple[Array, bool]:
        """The output projection and whether it is transposed.

        ``([hidden, vocab], False)`` for a separate head; ``([vocab, hidden], True)``,
        the embedding itself, when tied: a transposed rhs costs the matmul nothing,
        while materialising the embedding's transpose would copy it every step.
        """
        if self.lm_head is None:
            return self.model.embed_tokens[...], True
        return self.lm_head.kernel[...], False

    def logit_softcap(self) -> float | None:
        """``c`` if logits are soft-capped to ``c * tanh(logits / c)`` (Gemma): the chunked loss caps them too."""
        return None

    def compute_logits(self, hidden: Array) -> Array:
        """Logits in the compute dtype from hidden states [..., hidden]."""
        w, transposed = self.lm_head_weight()
        logits = matmul(hidden.astype(self.dtype), w.astype(self.dtype), rhs_transposed=transposed,
                        precision=self.precision)
        cap = self.logit_softcap()
        return logits if cap is None else jnp.tanh(logits / cap) * cap

    def __call__(
        self,
        input_ids: Array,
        positions: Array | None = None,
        segment_ids: Array | None = None,
        attention_mask: Array | None = None,
    ) -> Array:
        return self.compute_logits(self.hidden_states(input_ids, positions, segment_ids, attention_mask))

    # -- incremental decoding ---------------------------------------------------
    def init_cache(self, batch_size: int, max_length: int, dtype: Any = None) -> list[KVCache] | KVCache:
        """Empty per-layer key/value caches of ``max_length`` slots (compute dtype by default): a list,
        or with stacked layers one cache with a leading layer axis, which the decoding scan reads."""
        cfg = self.config
        shape = (batch_size, max_length, cfg.num_key_value_heads, cfg.head_dim)
        dtype = self.dtype if dtype is None else dtype
        if isinstance(self.model.layers, StackedLayers):
            stacked = (cfg.num_hidden_layers, *shape)
            return KVCache(jnp.zeros(stacked, dtype), jnp.zeros(stacked, dtype))
        return [KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(cfg.num_hidden_layers)]

    def forward_with_cache(
        self,
        input_ids: Array,
        positions: Array,
        cache: list[KVCache] | KVCache,
        start: Array,
        kv_valid: Array,
    ) -> tuple[Array, list[KVCache] | KVCache]:
        """Final-norm hidden states [B, T, hidden] of tokens written at cache slots ``[start, start+T)``.

        Used by :func:`scaletrain.generation.generate` for the prefill (T = prompt
        length) and each decode step (T = 1). ``kv_valid`` [B, S] must already mark
        the new tokens' slots. Kept apart from ``__call__`` so the training forward
        stays exactly as it is; :func:`build_cache_mask` gives the same attention
        pattern as :func:`build_attention_mask` for left-padded rows.
        """
        mask = build_cache_mask(start, input_ids.shape[1], kv_valid, effective_sliding_window(self.config))
        rope = rope_tables(positions, rope_inv_freq(self.config))
        x = self._embed(input_ids)
        if isinstance(self.model.layers, StackedLayers):
            x, cache = self.model.layers.scan(lambda layer, h, c: layer.call_with_cache(h, mask, rope, c, start),
                                              x, cache)
            return self.model.norm(x), cache
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
        """Load a local Hugging Face folder of this class's ``model_type`` (see ``load_hf_checkpoint``).

        ``hf`` is imported here so that building a model does not load the checkpoint
        code; ``hf`` never imports this module, so there is no cycle either way.
        """
        from scaletrain.models.hf import load_hf_checkpoint

        return load_hf_checkpoint(local_dir, cls, **kwargs)


class MistralForCausalLM(LlamaForCausalLM):
    _model_type: ClassVar[str] = "mistral"
    config_class: ClassVar[type[LlamaConfig]] = MistralConfig


class Qwen2ForCausalLM(LlamaForCausalLM):
    _model_type: ClassVar[str] = "qwen2"
    config_class: ClassVar[type[LlamaConfig]] = Qwen2Config


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 (dense): the Llama block with per-head q/k RMSNorm (``config.qk_norm``)."""

    _model_type: ClassVar[str] = "qwen3"
    config_class: ClassVar[type[LlamaConfig]] = Qwen3Config
