"""DeepSeek-V3 (the architecture DeepSeek-R1's and Kimi K2's checkpoints declare): multi-head latent
attention, sigmoid group-limited routing with the correction bias, shared experts, dense first layers."""

from __future__ import annotations

from typing import Any

from scaletrain.models.common.config import DecoderConfig
from scaletrain.models.common.family import FamilyConformance, register
from scaletrain.models.deepseek_v3.config import DeepseekV3Config, RoutedMoeConfig
from scaletrain.models.deepseek_v3.hf import routed_moe_fields, routed_moe_kwargs
from scaletrain.models.deepseek_v3.model import DeepseekV3ForCausalLM, RoutedMoeForCausalLM, RoutedMoeLayer
from scaletrain.models.hf_family import HFFamily, Refuse

#: the multi-head latent attention keys, the same names in config.json and in our config
MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")


def _from_hf(hf: Any, where: str) -> dict[str, Any]:
    return {**routed_moe_fields(hf, where), **{key: getattr(hf, key) for key in MLA_KEYS},
            "rope_interleave": bool(hf.rope_interleave), "attention_bias": bool(hf.attention_bias)}


def _to_hf(config: DecoderConfig, refuse: Refuse) -> dict[str, Any]:
    if config.qkv_bias or config.qk_norm:
        raise refuse("qkv_bias or qk_norm (multi-head latent attention has neither)")
    kwargs = routed_moe_kwargs(config)
    kwargs.pop("head_dim")  # transformers derives it (qk_rope_head_dim)
    return {**kwargs, **{key: getattr(config, key) for key in MLA_KEYS}, "rope_interleave": config.rope_interleave,
            "attention_bias": config.attention_bias}


DEEPSEEK_V3 = HFFamily("DeepseekV3ForCausalLM", "DeepseekV3Config", DeepseekV3Config, _from_hf, _to_hf)
#: the tiny MoE of both families' rows: 8 experts in 2 groups, top-2 from the best group, scaled
TINY_ROUTED = dict(num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                   topk_group=1, moe_intermediate_size=16, routed_scaling_factor=2.5)
#: latent ranks below the hidden size, a RoPE part narrower than the rest, values narrower than keys
TINY_MLA = dict(kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
                num_key_value_heads=4)
register(DEEPSEEK_V3, DeepseekV3ForCausalLM, conformance=FamilyConformance(
    # the first layer dense, then MoE layers; interleaved RoPE, compressed queries; heads over tp, experts over ep
    hf={**TINY_ROUTED, **TINY_MLA}, load=dict(sharding_axis_dims=(1, 2, 2, 2, 1)), lora="attention",
    scan_layers=False,
    variants={"plain-q": {**TINY_ROUTED, **TINY_MLA, "q_lora_rank": None, "rope_interleave": False,
                          "attention_bias": True, "tie_word_embeddings": True, "norm_topk_prob": False,
                          "n_shared_experts": 2, "first_k_dense_replace": 0,
                          # YaRN as DeepSeek-V3's config has it, with mscale != mscale_all_dim: both factors apply
                          "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                              "original_max_position_embeddings": 16, "mscale": 1.0,
                                              "mscale_all_dim": 0.7}}}))

__all__ = ["DEEPSEEK_V3", "TINY_ROUTED", "DeepseekV3Config", "DeepseekV3ForCausalLM", "RoutedMoeConfig",
           "RoutedMoeForCausalLM",
           "RoutedMoeLayer"]
