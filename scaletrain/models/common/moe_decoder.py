"""The mixture-of-experts block and causal decoder Mixtral and Qwen3-MoE share.

The shared decoder (:mod:`scaletrain.models.common`: attention, RMSNorm, embeddings
and head; Qwen3's per-head q/k norms come with its config) with a block whose MLP is
a :class:`~scaletrain.models.common.moe.SparseMoeBlock`. The model has every family's
interface (``hidden_states``, ``compute_logits``, the KV-cache decoding
of :mod:`scaletrain.generation`, ``save_pretrained`` / ``from_pretrained``) plus
the router statistics among the blocks' auxiliary outputs (``aux["router"]`` of
``hidden_states_and_aux``), which the train step turns into the router losses and the
count of tokens each expert got.
"""

from __future__ import annotations

from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from scaletrain.models.kernels.attention import KVCache
from scaletrain.models.common.decoder import CausalLM, DecoderModel
from scaletrain.models.common.inputs import LayerInputs
from scaletrain.models.common.layers import Attention
from scaletrain.models.common.dense import RMSNorm
from scaletrain.models.common.moe import RouterStats, SparseMoeBlock
from scaletrain.models.task import BASE_MODULE

Array = jax.Array
#: the key of the router statistics among a mixture of experts' auxiliary outputs
ROUTER = "router"


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

    @classmethod
    def aux_shapes(cls, config: Any) -> dict[str, RouterStats]:
        """One layer's router statistics: counts and probability sums per expert, z and row sums."""
        per_expert = jax.ShapeDtypeStruct((config.num_experts,), jnp.float32)
        scalar = jax.ShapeDtypeStruct((), jnp.float32)
        return {ROUTER: RouterStats(counts=per_expert, prob_sums=per_expert, z_sums=scalar, rows=scalar)}

    def __call__(self, x: Array, inputs: LayerInputs,
                 cache: KVCache | None = None) -> tuple[Array, dict[str, RouterStats], KVCache | None]:
        """The block over ``x``; padding (``inputs.valid`` 0) is routed like any token but left out of the
        statistics, as transformers leaves it out of the balancing loss given an attention mask."""
        attn, cache = self.self_attn(self.input_layernorm(x), inputs, cache)
        x = x + attn
        out, stats = self.moe(self.post_attention_layernorm(x), inputs.valid)
        return x + out, {ROUTER: stats}, cache


class MoeModel(DecoderModel):
    """Embeddings, MoE decoder layers and the final norm (HF's ``model.*`` names)."""

    # not registered as a base module of its own: ``model_class=MoeModel`` is refused by name
    _model_type: ClassVar[str | None] = None
    _model_task: ClassVar[str] = BASE_MODULE
    layer_class: ClassVar[type[nnx.Module]] = MoeDecoderLayer


class MoeForCausalLM(CausalLM):
    """A mixture-of-experts decoder with its head; subclasses name the family."""

    base_model_class: ClassVar[type[DecoderModel]] = MoeModel

    def hidden_states_and_router_stats(
        self,
        input_ids: Array,
        positions: Array | None = None,
        segment_ids: Array | None = None,
        attention_mask: Array | None = None,
    ) -> tuple[Array, RouterStats]:
        """Final-norm hidden states [B, T, hidden] and every layer's router statistics ([L, ...])."""
        hidden, aux = self.hidden_states_and_aux(input_ids, positions, segment_ids, attention_mask)
        return hidden, aux[ROUTER]

    def router_stats_shape(self) -> RouterStats:
        """The shapes and dtypes of :meth:`hidden_states_and_router_stats`' statistics, known without
        tracing the forward (the train step sizes its gradient-accumulation sums from them)."""
        return self.aux_shapes()[ROUTER]
