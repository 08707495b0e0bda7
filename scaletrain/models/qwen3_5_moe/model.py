"""Qwen3.5-MoE's (and Qwen3-Next's) hybrid decoder: Qwen3.5's layers with a shared-expert MoE as the MLP.

The token mixers, norms and per-layer-kind decode cache are Qwen3.5's
(:mod:`scaletrain.models.qwen3_5.model`); the feed-forward block is
:class:`~scaletrain.models.common.shared_moe.SharedExpertMoe` with softmax top-k routing and the
shared expert (``mlp.shared_expert``) gated per token by ``mlp.shared_expert_gate``, as transformers'
``Qwen3NextSparseMoeBlock`` computes it. Routed experts are split over ``ep``. Every layer returns
router statistics (a dense layer's, Qwen3-Next's ``mlp_only_layers``, are zero with no rows), so they
stack over the layers as the objective's balancing loss and the logged per-expert loads read them.
"""

from __future__ import annotations

from typing import Any, ClassVar

import jax
from flax import nnx

from scaletrain.models.common.config import DecoderConfig
from scaletrain.models.common.decoder import DecoderModel
from scaletrain.models.common.inputs import LayerInputs
from scaletrain.models.common.moe import RouterStats
from scaletrain.models.common.moe_decoder import ROUTER
from scaletrain.models.common.shared_moe import SharedExpertMoe, empty_stats
from scaletrain.models.qwen3_5.config import LINEAR
from scaletrain.models.qwen3_5.model import Qwen3_5DecoderLayer, Qwen3_5ForCausalLM, Qwen3_5TextModel
from scaletrain.models.qwen3_5_moe.config import Qwen3_5MoeTextConfig

Array = jax.Array


class Qwen3_5MoeDecoderLayer(Qwen3_5DecoderLayer):
    """Qwen3.5's layer whose MLP is the shared-expert MoE block (``sparse``), or a SwiGLU where the config
    makes the layer dense (Qwen3-Next's ``mlp_only_layers`` / ``decoder_sparse_step``)."""

    def __init__(self, config: Qwen3_5MoeTextConfig, dtype: Any, param_dtype: Any, precision: Any,
                 rngs: nnx.Rngs, layer_type: str = LINEAR, sparse: bool = True):
        self.sparse, self.num_experts = sparse, config.num_experts
        super().__init__(config, dtype, param_dtype, precision, rngs, layer_type)

    def _mlp(self, config: Any, dtype: Any, param_dtype: Any, precision: Any, rngs: nnx.Rngs) -> nnx.Module:
        if not self.sparse:
            return super()._mlp(config, dtype, param_dtype, precision, rngs)
        return SharedExpertMoe(config, config.num_experts, config.moe_intermediate_size,
                               config.shared_expert_intermediate_size, router="softmax",
                               normalize=config.normalize_top_k, shared_name="shared_expert", gated=True,
                               dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)

    @classmethod
    def aux_shapes(cls, config: DecoderConfig) -> dict[str, RouterStats]:
        """One layer's router statistics (zeros for a dense layer)."""
        return {ROUTER: jax.eval_shape(lambda: empty_stats(config.num_experts))}

    def _ffn(self, x: Array, inputs: LayerInputs) -> tuple[Array, dict[str, RouterStats]]:
        if not self.sparse:
            return self.mlp(x), {ROUTER: empty_stats(self.num_experts)}
        out, stats = self.mlp(x, inputs.valid)
        return out, {ROUTER: stats}


class Qwen3_5MoeTextModel(Qwen3_5TextModel):
    """Embeddings, the hybrid MoE layers (each built as its ``layer_types`` entry says) and the final norm."""

    config_class: ClassVar[type[DecoderConfig]] = Qwen3_5MoeTextConfig
    layer_class: ClassVar[type[nnx.Module]] = Qwen3_5MoeDecoderLayer

    def build_layer(self, index: int, config: Qwen3_5MoeTextConfig, dtype: Any, param_dtype: Any, precision: Any,
                    rngs: nnx.Rngs) -> nnx.Module:
        return self.layer_class(config, dtype, param_dtype, precision, rngs, config.layer_types[index],
                                sparse=config.is_sparse(index))


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5-MoE text decoder with its head."""

    config_class: ClassVar[type[DecoderConfig]] = Qwen3_5MoeTextConfig
    base_model_class: ClassVar[type[DecoderModel]] = Qwen3_5MoeTextModel
