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

from scaletrain.models.attention import KVCache
from scaletrain.models.config import LlamaConfig
from scaletrain.models.llama import Attention, LlamaForCausalLM, LlamaModel, RMSNorm
from scaletrain.models.moe import RouterStats, SparseMoeBlock
from scaletrain.models.moe_config import MixtralConfig, Qwen3MoeConfig
from scaletrain.models.stacked_layers import fold_layers
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


class MoeModel(LlamaModel):
    """Embeddings, MoE decoder layers and the final norm (HF's ``model.*`` names)."""

    # not registered as a base module of its own: ``model_class=MoeModel`` is refused by name
    _model_type: ClassVar[str | None] = None
    _model_task: ClassVar[TaskType] = TaskType.BASE_MODULE
    layer_class: ClassVar[type[nnx.Module]] = MoeDecoderLayer


class MoeForCausalLM(LlamaForCausalLM):
    """A mixture-of-experts decoder with its head; subclasses name the family."""

    _model_task: ClassVar[TaskType] = TaskType.CAUSAL_LM
    base_model_class: ClassVar[type[LlamaModel]] = MoeModel

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
        input_ids, inputs, restore = self._forward_inputs(input_ids, positions, segment_ids, attention_mask)
        valid = (inputs.segment_ids != 0).astype(jnp.float32)
        x = self._shard_activations(self._embed(input_ids))

        def step(layer: nnx.Module, h: Array) -> tuple[Array, RouterStats]:
            h, s = self._run_layer(layer, h, inputs.mask, inputs.rope, valid)
            return self._shard_activations(h), s

        x, stats = fold_layers(self.model.layers, step, x)
        return self.model.norm(self._in_row_order(x, restore)), stats

    def router_stats_shape(self) -> RouterStats:
        """The shapes and dtypes of :meth:`hidden_states_and_router_stats`' statistics, known without
        tracing the forward (the train step sizes its gradient-accumulation sums from them)."""
        layers, experts = self.config.num_hidden_layers, self.config.num_experts
        per_expert = jax.ShapeDtypeStruct((layers, experts), jnp.float32)
        per_layer = jax.ShapeDtypeStruct((layers,), jnp.float32)
        return RouterStats(counts=per_expert, prob_sums=per_expert, z_sums=per_layer, rows=per_layer)

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
