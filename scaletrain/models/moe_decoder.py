"""Mixture-of-experts causal decoders: Mixtral and Qwen3-MoE.

The Llama block (:mod:`scaletrain.models.llama`'s attention, RMSNorm, embeddings
and head; Qwen3's per-head q/k norms come with its config) with the MLP replaced by
a :class:`~scaletrain.models.moe.SparseMoeBlock`. The model has the Llama model's
interface throughout (``hidden_states``, ``compute_logits``, the KV-cache decoding
of :mod:`scaletrain.generation`, ``save_pretrained`` / ``from_pretrained``) plus
:meth:`MoeForCausalLM.hidden_states_and_router_stats`, which the train step uses to
add the router losses to its objective and to log how many tokens each expert got.
"""

from __future__ import annotations

from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from scaletrain.models.attention import KVCache, build_attention_mask, rope_inv_freq, rope_tables
from scaletrain.models.config import LlamaConfig, effective_sliding_window
from scaletrain.models.llama import _REMAT_POLICIES, Attention, Dense, LlamaForCausalLM, RMSNorm, _constrain, _init
from scaletrain.models.moe import RouterStats, SparseMoeBlock
from scaletrain.models.moe_config import MixtralConfig, Qwen3MoeConfig
from scaletrain.models.task import TaskType

Array = jax.Array
Rope = tuple[Array, Array]


class MoeDecoderLayer(nnx.Module):
    """Pre-norm residual block: attention, then the sparse MoE block (named as transformers names it)."""

    def __init__(self, config: Any, dtype: Any, param_dtype: Any, precision: Any, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, param_dtype)
        self.self_attn = Attention(config, dtype, param_dtype, precision, rngs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, param_dtype)
        # Mixtral's block is `block_sparse_moe`, Qwen3-MoE's `mlp`: our parameter names are the HF ones
        self.block_name = config.moe_block_name
        setattr(self, self.block_name, SparseMoeBlock(
            config, config.num_experts, config.expert_intermediate_size, config.expert_names, config.normalize_top_k,
            dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs))

    @property
    def moe(self) -> SparseMoeBlock:
        return getattr(self, self.block_name)

    def __call__(self, x: Array, mask: Array | None, rope: Rope, valid: Array) -> tuple[Array, RouterStats]:
        x = x + self.self_attn(self.input_layernorm(x), mask, rope)
        out, stats = self.moe(self.post_attention_layernorm(x), valid)
        return x + out, stats

    def call_with_cache(self, x: Array, mask: Array, rope: Rope, cache: KVCache, start: Array) -> tuple[Array, KVCache]:
        """The block's forward for decoding: same maths, keys/values kept in ``cache``."""
        attn, cache = self.self_attn.call_with_cache(self.input_layernorm(x), mask, rope, cache, start)
        x = x + attn
        h = self.post_attention_layernorm(x)
        out, _ = self.moe(h, jnp.ones(h.shape[:2], jnp.float32))
        return x + out, cache


class MoeModel(nnx.Module):
    """Embeddings, MoE decoder layers and the final norm (HF's ``model.*`` names)."""

    _model_task: ClassVar[TaskType] = TaskType.BASE_MODULE

    def __init__(self, config: Any, dtype: Any, param_dtype: Any, precision: Any, rngs: nnx.Rngs):
        self.embed_tokens = nnx.Param(
            _init(config)(rngs.params(), (config.vocab_size, config.hidden_size), param_dtype),
            logical_axes=("vocab", "embed"),
        )
        self.layers = nnx.List(
            [MoeDecoderLayer(config, dtype, param_dtype, precision, rngs) for _ in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, param_dtype)


class MoeForCausalLM(LlamaForCausalLM):
    """A mixture-of-experts decoder with its head; subclasses name the family."""

    _model_task: ClassVar[TaskType] = TaskType.CAUSAL_LM

    def __init__(self, config: Any, dtype: Any = jnp.float32, param_dtype: Any = jnp.float32, precision: Any = None,
                 *, rngs: nnx.Rngs):
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.param_dtype = jnp.dtype(param_dtype)
        self.precision = precision
        self.model = MoeModel(config, self.dtype, self.param_dtype, precision, rngs)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Dense(config.hidden_size, config.vocab_size, ("embed", "vocab"), use_bias=False, config=config,
                       dtype=self.dtype, param_dtype=self.param_dtype, precision=precision, rngs=rngs)
        )

    def hidden_states_and_router_stats(
        self,
        input_ids: Array,
        positions: Array | None = None,
        segment_ids: Array | None = None,
        attention_mask: Array | None = None,
    ) -> tuple[Array, RouterStats]:
        """Final-norm hidden states [B, T, hidden] and every layer's router statistics ([L, ...]).

        The inputs mean what they mean to :meth:`LlamaForCausalLM.hidden_states`;
        padding (segment 0) is routed like any token but left out of the statistics,
        as transformers leaves it out of the balancing loss given an attention mask.
        """
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
        mask = None if causal_only else build_attention_mask(segment_ids, positions, window)
        rope = rope_tables(positions, rope_inv_freq(cfg))
        valid = (segment_ids != 0).astype(jnp.float32)
        x = _constrain(jnp.take(self.model.embed_tokens[...], input_ids, axis=0).astype(self.dtype), act_spec)
        policy = cfg.gradient_checkpointing
        stats = []
        for layer in self.model.layers:
            if policy == "none":
                x, s = layer(x, mask, rope, valid)
            else:
                x, s = nnx.remat(lambda lyr, *a: lyr(*a), policy=_REMAT_POLICIES[policy])(layer, x, mask, rope, valid)
            x = _constrain(x, act_spec)
            stats.append(s)
        return self.model.norm(x), jax.tree.map(lambda *a: jnp.stack(a), *stats)

    def hidden_states(
        self,
        input_ids: Array,
        positions: Array | None = None,
        segment_ids: Array | None = None,
        attention_mask: Array | None = None,
    ) -> Array:
        """Final-norm hidden states [B, T, hidden] (the router statistics dropped)."""
        return self.hidden_states_and_router_stats(input_ids, positions, segment_ids, attention_mask)[0]


class MixtralForCausalLM(MoeForCausalLM):
    """Mixtral: top-2 of 8 SwiGLU experts (by default) in every layer, Mistral attention."""

    _model_type: ClassVar[str] = "mixtral"
    config_class: ClassVar[type[LlamaConfig]] = MixtralConfig


class Qwen3MoeForCausalLM(MoeForCausalLM):
    """Qwen3-MoE: top-k of many small SwiGLU experts in every layer, Qwen3 attention (q/k norms)."""

    _model_type: ClassVar[str] = "qwen3_moe"
    config_class: ClassVar[type[LlamaConfig]] = Qwen3MoeConfig
