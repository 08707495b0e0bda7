"""config.json mappings of the dense Llama-block families: Llama, Mistral, Qwen2, Qwen3.

Each function pair says what that ``model_type``'s keys mean for our config and
which of its options we refuse (see :class:`scaletrain.models.hf_family.HFFamily`).
"""

from __future__ import annotations

from typing import Any

from scaletrain.models.config import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config
from scaletrain.models.hf_family import (
    HFFamily,
    Refuse,
    base_fields,
    base_hf_kwargs,
    check_silu,
    uniform_window,
    uniform_window_to_hf,
)


def _swiglu_fields(hf: Any, where: str) -> dict[str, Any]:
    check_silu(hf, where)
    return {**base_fields(hf, where), "hidden_act": "silu"}


def _swiglu_kwargs(config: LlamaConfig) -> dict[str, Any]:
    return {**base_hf_kwargs(config), "hidden_act": "silu"}


def _llama_from_hf(hf: Any, where: str) -> dict[str, Any]:
    return {**_swiglu_fields(hf, where), "attention_bias": bool(hf.attention_bias), "qkv_bias": False,
            "mlp_bias": bool(hf.mlp_bias), "sliding_window": None}


def _llama_to_hf(config: LlamaConfig, refuse: Refuse) -> dict[str, Any]:
    if config.qkv_bias and not config.attention_bias:
        raise refuse("qkv_bias=True but attention_bias=False")
    if config.sliding_window is not None:
        raise refuse(f"sliding_window={config.sliding_window} (use model_type mistral)")
    if config.qk_norm:
        raise refuse("qk_norm=True (use model_type qwen3)")
    return {**_swiglu_kwargs(config), "attention_bias": config.attention_bias, "mlp_bias": config.mlp_bias}


def _mistral_from_hf(hf: Any, where: str) -> dict[str, Any]:
    return {**_swiglu_fields(hf, where), "attention_bias": False, "qkv_bias": False, "mlp_bias": False,
            "sliding_window": hf.sliding_window}


def _mistral_to_hf(config: LlamaConfig, refuse: Refuse) -> dict[str, Any]:
    if config.attention_bias or config.qkv_bias or config.mlp_bias:
        raise refuse("attention/qkv/mlp biases")
    if config.qk_norm:
        raise refuse("qk_norm=True (use model_type qwen3)")
    return {**_swiglu_kwargs(config), "sliding_window": config.sliding_window}


def _qwen2_from_hf(hf: Any, where: str) -> dict[str, Any]:
    window = uniform_window(hf, where)
    return {**_swiglu_fields(hf, where), "attention_bias": False, "qkv_bias": True, "mlp_bias": False,
            "use_sliding_window": window is not None, "sliding_window": window}


def _qwen2_to_hf(config: LlamaConfig, refuse: Refuse) -> dict[str, Any]:
    if not config.qkv_bias or config.attention_bias or config.mlp_bias:
        raise refuse("biases other than q/k/v")
    if config.qk_norm:
        raise refuse("qk_norm=True (use model_type qwen3)")
    return {**_swiglu_kwargs(config), **uniform_window_to_hf(config)}


def _qwen3_from_hf(hf: Any, where: str) -> dict[str, Any]:
    window = uniform_window(hf, where)
    return {**_swiglu_fields(hf, where), "attention_bias": bool(hf.attention_bias), "qkv_bias": False,
            "mlp_bias": False, "qk_norm": True, "use_sliding_window": window is not None, "sliding_window": window}


def _qwen3_to_hf(config: LlamaConfig, refuse: Refuse) -> dict[str, Any]:
    if not config.qk_norm:
        raise refuse("qk_norm=False (Qwen3 always norms q and k; use model_type qwen2 or llama)")
    if config.mlp_bias or (config.qkv_bias and not config.attention_bias):
        raise refuse("mlp or q/k/v-only biases (Qwen3 has attention_bias on all four projections)")
    return {**_swiglu_kwargs(config), "attention_bias": config.attention_bias, **uniform_window_to_hf(config)}


DENSE_FAMILIES: tuple[HFFamily, ...] = (
    HFFamily("llama", "LlamaForCausalLM", "LlamaConfig", LlamaConfig, _llama_from_hf, _llama_to_hf),
    HFFamily("mistral", "MistralForCausalLM", "MistralConfig", MistralConfig, _mistral_from_hf, _mistral_to_hf),
    HFFamily("qwen2", "Qwen2ForCausalLM", "Qwen2Config", Qwen2Config, _qwen2_from_hf, _qwen2_to_hf),
    HFFamily("qwen3", "Qwen3ForCausalLM", "Qwen3Config", Qwen3Config, _qwen3_from_hf, _qwen3_to_hf),
)
