"""GLM-4.5 (``glm4_moe``; GLM-4.5-Air and its successors): grouped-query attention with partial RoPE,
q/k/v biases and optional per-head q/k norms, and DeepSeek-V3's MoE (sigmoid routing with the correction
bias, shared experts, dense first layers)."""

from __future__ import annotations

from typing import Any, ClassVar

from flax import nnx
from pydantic import field_validator

from scaletrain.errors import ConfigError
from scaletrain.models.common.config import DecoderConfig
from scaletrain.models.common.decoder import DecoderModel
from scaletrain.models.common.family import FamilyConformance, register
from scaletrain.models.common.layers import Attention
from scaletrain.models.deepseek_v3 import TINY_ROUTED, RoutedMoeConfig, RoutedMoeForCausalLM, RoutedMoeLayer
from scaletrain.models.deepseek_v3.hf import routed_moe_fields, routed_moe_kwargs
from scaletrain.models.deepseek_v3.model import RoutedMoeModel
from scaletrain.models.hf_family import HFFamily, Refuse, rope_from_hf, rope_to_hf


class Glm4MoeConfig(RoutedMoeConfig):
    """GLM-4.5: partial RoPE (``partial_rotary_factor`` of each head), biases on q/k/v (``qkv_bias``; HF's
    ``attention_bias``), per-head q/k norms when ``qk_norm`` (HF's ``use_qk_norm``). Defaults: GLM-4.5-Air."""

    model_type: ClassVar[str] = "glm4_moe"

    vocab_size: int = 151552
    hidden_size: int = 4096
    intermediate_size: int = 10944
    num_hidden_layers: int = 46
    num_attention_heads: int = 96
    num_key_value_heads: int | None = 8
    head_dim: int | None = 128
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-5
    qkv_bias: bool = True
    partial_rotary_factor: float = 0.5
    moe_intermediate_size: int = 1408
    n_routed_experts: int = 128
    first_k_dense_replace: int = 1

    @field_validator("partial_rotary_factor", mode="after")
    @classmethod
    def _fraction(cls, value: float) -> float:
        if not 0 < value <= 1:
            raise ValueError(f"partial_rotary_factor {value} must be in (0, 1]")
        return value


class Glm4MoeLayer(RoutedMoeLayer):
    """GLM-4.5's block: the shared attention (partial RoPE, q/k/v biases, optional q/k norms), then MLP or MoE."""

    attention_class: ClassVar[type[nnx.Module]] = Attention


class Glm4MoeModel(RoutedMoeModel):
    layer_class: ClassVar[type[nnx.Module]] = Glm4MoeLayer


class Glm4MoeForCausalLM(RoutedMoeForCausalLM):
    """GLM-4.5 with its head."""

    config_class: ClassVar[type[DecoderConfig]] = Glm4MoeConfig
    base_model_class: ClassVar[type[DecoderModel]] = Glm4MoeModel


def _from_hf(hf: Any, where: str) -> dict[str, Any]:
    rope = dict(hf.rope_parameters or {})
    factor = rope.pop("partial_rotary_factor", None) or getattr(hf, "partial_rotary_factor", None) or 1.0
    fields = routed_moe_fields(hf, where, rope=False)
    fields["rope_theta"], fields["rope_scaling"] = rope_from_hf(rope, where)
    if int(fields["head_dim"] * factor) % 2:
        raise ConfigError(f"{where}: rope_parameters.partial_rotary_factor {factor} rotates an odd number of "
                          f"the {fields['head_dim']} head dims; RoPE rotates pairs")
    return {**fields, "partial_rotary_factor": float(factor), "qkv_bias": bool(hf.attention_bias),
            "attention_bias": False, "qk_norm": bool(hf.use_qk_norm)}


def _to_hf(config: DecoderConfig, refuse: Refuse) -> dict[str, Any]:
    if config.attention_bias:
        raise refuse("attention_bias (a bias on o_proj; GLM-4.5's attention_bias is q/k/v only: qkv_bias)")
    kwargs = routed_moe_kwargs(config, rope=False)
    rope = {**rope_to_hf(config.rope_theta, config.rope_scaling), "partial_rotary_factor": config.partial_rotary_factor}
    return {**kwargs, "rope_parameters": rope, "attention_bias": config.qkv_bias, "use_qk_norm": config.qk_norm}


GLM4_MOE = HFFamily("Glm4MoeForCausalLM", "Glm4MoeConfig", Glm4MoeConfig, _from_hf, _to_hf)
register(GLM4_MOE, Glm4MoeForCausalLM, conformance=FamilyConformance(
    # half of each 24-dim head rotated, q/k/v biases, per-head q/k norms, two shared experts; experts over ep
    hf={**TINY_ROUTED, "head_dim": 24, "partial_rotary_factor": 0.5, "attention_bias": True, "use_qk_norm": True,
        "n_shared_experts": 2}, load=dict(sharding_axis_dims=(1, 2, 4, 1, 1)), lora="attention",
    scan_layers=False,
    variants={"quarter-rope": {**TINY_ROUTED, "partial_rotary_factor": 0.25, "tie_word_embeddings": True,
                               "n_group": 1, "norm_topk_prob": False, "first_k_dense_replace": 0}}))

__all__ = ["GLM4_MOE", "Glm4MoeConfig", "Glm4MoeForCausalLM"]
