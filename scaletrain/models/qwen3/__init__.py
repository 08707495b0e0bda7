"""Qwen3 (dense): Llama's block with an RMSNorm over each head's queries and keys (``qk_norm``)."""

from __future__ import annotations

from typing import Any, ClassVar

from scaletrain.models.common.family import FamilyConformance, register
from scaletrain.models.common.config import DecoderConfig
from scaletrain.models.hf_family import HFFamily, Refuse, uniform_window, uniform_window_to_hf
from scaletrain.models.llama.hf import swiglu_fields, swiglu_kwargs
from scaletrain.models.llama.model import LlamaForCausalLM
from scaletrain.models.qwen2 import Qwen2Config


class Qwen3Config(Qwen2Config):
    """Qwen3 (dense): Qwen2's optional window, no q/k/v bias, RMSNorm on each head's q and k.

    ``attention_bias`` puts biases on all four projections, as in Llama.
    """

    model_type: ClassVar[str] = "qwen3"
    qkv_bias: bool = False
    qk_norm: bool = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 (dense): the Llama block with per-head q/k RMSNorm (``config.qk_norm``)."""

    config_class: ClassVar[type[DecoderConfig]] = Qwen3Config


def qwen3_attention_to_hf(config: DecoderConfig, refuse: Refuse) -> None:
    """Refuse what Qwen3's attention (dense or MoE) cannot write: no q/k norms, q/k/v-only biases."""
    if not config.qk_norm:
        raise refuse("qk_norm=False (Qwen3 always norms q and k; use model_type qwen2 or llama)")
    if config.qkv_bias and not config.attention_bias:
        raise refuse("q/k/v-only biases (Qwen3 has attention_bias on all four projections)")


def _from_hf(hf: Any, where: str) -> dict[str, Any]:
    window = uniform_window(hf, where)
    return {**swiglu_fields(hf, where), "attention_bias": bool(hf.attention_bias), "qkv_bias": False,
            "mlp_bias": False, "qk_norm": True, "use_sliding_window": window is not None, "sliding_window": window}


def _to_hf(config: DecoderConfig, refuse: Refuse) -> dict[str, Any]:
    qwen3_attention_to_hf(config, refuse)
    if config.mlp_bias:
        raise refuse("mlp biases (Qwen3 has none)")
    return {**swiglu_kwargs(config), "attention_bias": config.attention_bias, **uniform_window_to_hf(config)}


QWEN3 = HFFamily("Qwen3ForCausalLM", "Qwen3Config", Qwen3Config, _from_hf, _to_hf)
# q/k norms, head_dim 24 != hidden 64 / 4 heads, untied head
register(QWEN3, Qwen3ForCausalLM, conformance=FamilyConformance(hf=dict(head_dim=24), variants={
    "tied-bias": dict(tie_word_embeddings=True, attention_bias=True, head_dim=32),
}))

__all__ = ["QWEN3", "Qwen3Config", "Qwen3ForCausalLM", "qwen3_attention_to_hf"]
