"""Qwen3.5-MoE (text): Qwen3.5's hybrid of Gated DeltaNet and gated full attention with a shared-expert MoE.

The config.json mapping reads and writes transformers' ``Qwen3_5MoeTextConfig`` keys: Qwen3.5's
(:func:`scaletrain.models.qwen3_5.hybrid_from_hf`) plus the experts' (:data:`MOE_KEYS`). The released
checkpoints (Qwen3.5-35B-A3B, -122B-A10B, -397B-A17B) are vision-language folders (``model_type:
qwen3_5_moe``): they load as their language model, the vision tower left out and named in one log line.
"""

from __future__ import annotations

from typing import Any

from scaletrain.models.common.config import DecoderConfig
from scaletrain.models.common.family import FamilyConformance, register
from scaletrain.models.hf_family import HFFamily, Refuse
from scaletrain.models.qwen3_5 import HYBRID_CONFORMANCE, hybrid_from_hf, hybrid_to_hf
from scaletrain.models.qwen3_5_moe.config import Qwen3_5MoeTextConfig
from scaletrain.models.qwen3_5_moe.model import Qwen3_5MoeDecoderLayer, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextModel

#: the experts' keys, the same names in config.json and in our config
MOE_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
            "router_aux_loss_coef")


def moe_hybrid_from_hf(hf: Any, where: str) -> dict[str, Any]:
    """Our fields of a Qwen3.5-MoE / Qwen3-Next text config: the hybrid's, the experts'."""
    fields = {**hybrid_from_hf(hf, where), **{key: getattr(hf, key) for key in MOE_KEYS}}
    if fields["intermediate_size"] is None:  # no dense MLP: the field holds the shared expert's width
        fields["intermediate_size"] = hf.shared_expert_intermediate_size
    return fields


def moe_hybrid_to_hf(config: DecoderConfig, refuse: Refuse) -> dict[str, Any]:
    """transformers' keywords for a Qwen3.5-MoE / Qwen3-Next text config."""
    return {**hybrid_to_hf(config, refuse), **{key: getattr(config, key) for key in MOE_KEYS}}


def _to_hf(config: DecoderConfig, refuse: Refuse) -> dict[str, Any]:
    kwargs = moe_hybrid_to_hf(config, refuse)
    kwargs.pop("intermediate_size")  # Qwen3.5-MoE has no dense MLP and no such key
    return kwargs


QWEN3_5_MOE_TEXT = HFFamily("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig", Qwen3_5MoeTextConfig,
                            moe_hybrid_from_hf, _to_hf)
#: a linear and a full layer (full_attention_interval 2: the 3 : 1 pattern is qwen3_5_text's row; two layers keep
#: the row's compile short), each with top-2 of 8 small experts and a wider shared expert
MOE_CONFORMANCE = dict(HYBRID_CONFORMANCE, num_hidden_layers=2, full_attention_interval=2, num_experts=8,
                       num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)
# the released folders are vision-language ones (qwen3_5_moe): they load as their language model. LoRA on the
# attention projections: transformers' experts are fused tensors and its router no nn.Linear (PEFT's
# "all-linear" names other layers than ours). Experts over ep = 2, heads over tp = 2
register(QWEN3_5_MOE_TEXT, Qwen3_5MoeForCausalLM, multimodal=("qwen3_5_moe",), conformance=FamilyConformance(
    hf=MOE_CONFORMANCE, load=dict(sharding_axis_dims=(1, 2, 2, 2, 1)), lora="attention", scan_layers=False))

__all__ = ["MOE_CONFORMANCE", "QWEN3_5_MOE_TEXT", "Qwen3_5MoeDecoderLayer", "Qwen3_5MoeForCausalLM",
           "Qwen3_5MoeTextConfig", "Qwen3_5MoeTextModel", "moe_hybrid_from_hf", "moe_hybrid_to_hf"]
