"""Mixtral: Mistral's attention, every MLP a top-k of SwiGLU experts (the shared MoE block)."""

from __future__ import annotations

from typing import Any, ClassVar

from scaletrain.models.common.family import FamilyConformance, register
from scaletrain.models.common.config import DecoderConfig
from scaletrain.models.hf_family import HFFamily, Refuse, base_fields, base_hf_kwargs
from scaletrain.models.llama.hf import refuse_qk_norm
from scaletrain.models.common.moe_config import MoeConfigMixin, check_moe_hf, moe_fields
from scaletrain.models.common.moe_decoder import MoeForCausalLM


class MixtralConfig(MoeConfigMixin, DecoderConfig):
    """Mixtral: Mistral attention, every MLP a top-``num_experts_per_tok`` of ``num_local_experts`` SwiGLUs."""

    model_type: ClassVar[str] = "mixtral"
    #: the decoder layer's attribute for its MoE block and the experts' (gate, up, down) tensor
    #: names: transformers' on-disk names (``block_sparse_moe.experts.<e>.w1.weight``, ...)
    moe_block_name: ClassVar[str] = "block_sparse_moe"
    expert_names: ClassVar[tuple[str, str, str]] = ("w1", "w3", "w2")

    intermediate_size: int = 14336
    rms_norm_eps: float = 1e-5
    rope_theta: float = 1000000.0
    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    router_aux_loss_coef: float = 0.001
    router_z_loss_coef: float = 0.0
    router_jitter_noise: float = 0.0

    @property
    def num_experts(self) -> int:
        return self.num_local_experts

    @property
    def expert_intermediate_size(self) -> int:
        return self.intermediate_size

    @property
    def normalize_top_k(self) -> bool:
        """Mixtral always renormalises the chosen experts' probabilities."""
        return True


class MixtralForCausalLM(MoeForCausalLM):
    """Mixtral: top-2 of 8 SwiGLU experts (by default) in every layer, Mistral attention."""

    config_class: ClassVar[type[DecoderConfig]] = MixtralConfig


def _from_hf(hf: Any, where: str) -> dict[str, Any]:
    check_moe_hf(hf, where)
    return {**base_fields(hf, where), **moe_fields(hf, ("num_local_experts",)), "attention_bias": False,
            "qkv_bias": False, "mlp_bias": False, "sliding_window": hf.sliding_window}


def _to_hf(config: DecoderConfig, refuse: Refuse) -> dict[str, Any]:
    if config.attention_bias or config.qkv_bias:
        raise refuse("attention biases")
    refuse_qk_norm(config, refuse)
    return {**base_hf_kwargs(config), **moe_fields(config, ("num_local_experts",)),
            "sliding_window": config.sliding_window, "router_jitter_noise": 0.0}


MIXTRAL = HFFamily("MixtralForCausalLM", "MixtralConfig", MixtralConfig, _from_hf, _to_hf)
# top-2 of 4 experts, renormalised, a window shorter than the rows, tied head; loaded on fsdp=2 x ep=4,
# so every check also runs the expert-parallel dispatch (of batches too small to split over ep)
register(MIXTRAL, MixtralForCausalLM, conformance=FamilyConformance(
    hf=dict(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.02,
            sliding_window=8, tie_word_embeddings=True),
    load=dict(sharding_axis_dims=(1, 2, 4, 1, 1)), lora="attention"))

__all__ = ["MIXTRAL", "MixtralConfig", "MixtralForCausalLM"]
