"""Qwen3-MoE: Qwen3's attention (q/k norms), every MLP a top-k of many small SwiGLU experts."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import field_validator

from scaletrain.models.common.family import FamilyConformance, register
from scaletrain.models.common.config import DecoderConfig, at_least_one
from scaletrain.models.hf_family import HFFamily, Refuse, base_fields, base_hf_kwargs
from scaletrain.models.common.moe_config import MoeConfigMixin, check_moe_hf, moe_fields
from scaletrain.models.common.moe_decoder import MoeForCausalLM
from scaletrain.models.qwen3 import Qwen3Config, qwen3_attention_to_hf


class Qwen3MoeConfig(MoeConfigMixin, Qwen3Config):
    """Qwen3-MoE: Qwen3 attention (per-head q/k norms), every MLP a top-k of many small SwiGLU experts."""

    model_type: ClassVar[str] = "qwen3_moe"
    moe_block_name: ClassVar[str] = "mlp"
    expert_names: ClassVar[tuple[str, str, str]] = ("gate_proj", "up_proj", "down_proj")

    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 6144
    num_hidden_layers: int = 24
    num_key_value_heads: int | None = 4
    max_position_embeddings: int = 32768
    rope_theta: float = 10000.0
    num_experts: int = 128
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = []
    router_aux_loss_coef: float = 0.001
    router_z_loss_coef: float = 0.0

    @field_validator("moe_intermediate_size", mode="after")
    @classmethod
    def _expert_width(cls, value: int) -> int:
        return at_least_one(value)

    @property
    def expert_intermediate_size(self) -> int:
        return self.moe_intermediate_size

    @property
    def normalize_top_k(self) -> bool:
        return self.norm_topk_prob


class Qwen3MoeForCausalLM(MoeForCausalLM):
    """Qwen3-MoE: top-k of many small SwiGLU experts in every layer, Qwen3 attention (q/k norms)."""

    config_class: ClassVar[type[DecoderConfig]] = Qwen3MoeConfig


def _from_hf(hf: Any, where: str) -> dict[str, Any]:
    check_moe_hf(hf, where)
    window = hf.sliding_window if hf.use_sliding_window else None
    return {**base_fields(hf, where), **moe_fields(hf, ("num_experts", "moe_intermediate_size")),
            "qkv_bias": False, "mlp_bias": False, "attention_bias": bool(hf.attention_bias), "qk_norm": True,
            "use_sliding_window": window is not None, "sliding_window": window,
            "norm_topk_prob": bool(hf.norm_topk_prob)}


def _to_hf(config: DecoderConfig, refuse: Refuse) -> dict[str, Any]:
    qwen3_attention_to_hf(config, refuse)
    sliding = bool(config.use_sliding_window) and config.sliding_window is not None
    return {**base_hf_kwargs(config), **moe_fields(config, ("num_experts", "moe_intermediate_size")),
            "attention_bias": config.attention_bias, "use_sliding_window": sliding,
            "sliding_window": config.sliding_window if sliding else None, "norm_topk_prob": config.norm_topk_prob,
            "decoder_sparse_step": 1, "mlp_only_layers": []}


QWEN3_MOE = HFFamily("Qwen3MoeForCausalLM", "Qwen3MoeConfig", Qwen3MoeConfig, _from_hf, _to_hf)
# top-3 of 8 small experts, not renormalised, head_dim != hidden / heads, attention biases
register(QWEN3_MOE, Qwen3MoeForCausalLM, conformance=FamilyConformance(
    hf=dict(intermediate_size=96, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=3, head_dim=24,
            norm_topk_prob=False, attention_bias=True, router_aux_loss_coef=0.05), lora="attention"))

__all__ = ["QWEN3_MOE", "Qwen3MoeConfig", "Qwen3MoeForCausalLM"]
