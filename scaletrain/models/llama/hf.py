"""Llama's config.json mapping, and the SwiGLU fields every Llama-block family (Mistral, Qwen2, Qwen3)
reads and writes alike (see :class:`scaletrain.models.hf_family.HFFamily`)."""

from __future__ import annotations

from typing import Any

from scaletrain.models.llama.config import LlamaConfig
from scaletrain.models.hf_family import Refuse, base_fields, base_hf_kwargs, check_silu

#: the refusal of q/k norms by a family without them, written once for the three that have none
QK_NORM_ELSEWHERE = "qk_norm=True (use model_type qwen3)"


def swiglu_fields(hf: Any, where: str) -> dict[str, Any]:
    """Our config's fields common to the SwiGLU families, from a transformers config (SiLU checked)."""
    check_silu(hf, where)
    return {**base_fields(hf, where), "hidden_act": "silu"}


def swiglu_kwargs(config: LlamaConfig) -> dict[str, Any]:
    """The transformers config's keyword arguments common to the SwiGLU families."""
    return {**base_hf_kwargs(config), "hidden_act": "silu"}


def refuse_qk_norm(config: LlamaConfig, refuse: Refuse) -> None:
    """Raise the export refusal of a family without q/k norms given a config that has them."""
    if config.qk_norm:
        raise refuse(QK_NORM_ELSEWHERE)


def llama_from_hf(hf: Any, where: str) -> dict[str, Any]:
    return {**swiglu_fields(hf, where), "attention_bias": bool(hf.attention_bias), "qkv_bias": False,
            "mlp_bias": bool(hf.mlp_bias), "sliding_window": None}


def llama_to_hf(config: LlamaConfig, refuse: Refuse) -> dict[str, Any]:
    if config.qkv_bias and not config.attention_bias:
        raise refuse("qkv_bias=True but attention_bias=False")
    if config.sliding_window is not None:
        raise refuse(f"sliding_window={config.sliding_window} (use model_type mistral)")
    refuse_qk_norm(config, refuse)
    return {**swiglu_kwargs(config), "attention_bias": config.attention_bias, "mlp_bias": config.mlp_bias}
