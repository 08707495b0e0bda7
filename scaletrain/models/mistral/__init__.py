"""Mistral: Llama's block with a sliding attention window (and no biases)."""

from __future__ import annotations

from typing import Any, ClassVar

from scaletrain.models.common.family import FamilyConformance, register
from scaletrain.models.common.config import DecoderConfig
from scaletrain.models.hf_family import HFFamily, Refuse
from scaletrain.models.llama.hf import refuse_qk_norm, swiglu_fields, swiglu_kwargs
from scaletrain.models.llama.model import LlamaForCausalLM


class MistralConfig(DecoderConfig):
    """Mistral: Llama with an optional sliding attention window."""

    model_type: ClassVar[str] = "mistral"
    sliding_window: int | None = 4096
    rms_norm_eps: float = 1e-5


class MistralForCausalLM(LlamaForCausalLM):
    config_class: ClassVar[type[DecoderConfig]] = MistralConfig


def _from_hf(hf: Any, where: str) -> dict[str, Any]:
    return {**swiglu_fields(hf, where), "attention_bias": False, "qkv_bias": False, "mlp_bias": False,
            "sliding_window": hf.sliding_window}


def _to_hf(config: DecoderConfig, refuse: Refuse) -> dict[str, Any]:
    if config.attention_bias or config.qkv_bias or config.mlp_bias:
        raise refuse("attention/qkv/mlp biases")
    refuse_qk_norm(config, refuse)
    return {**swiglu_kwargs(config), "sliding_window": config.sliding_window}


MISTRAL = HFFamily("MistralForCausalLM", "MistralConfig", MistralConfig, _from_hf, _to_hf)
# a sliding window (8) shorter than the suite's rows and prompts + generated tokens
register(MISTRAL, MistralForCausalLM, conformance=FamilyConformance(hf=dict(sliding_window=8)))

__all__ = ["MISTRAL", "MistralConfig", "MistralForCausalLM"]
