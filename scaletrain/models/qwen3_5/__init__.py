"""Qwen3.5 (dense text): Gated DeltaNet linear-attention layers and gated full attention, 3 : 1.

The config.json mapping reads and writes transformers' ``Qwen3_5TextConfig`` keys; RoPE's
``partial_rotary_factor`` and the multimodal sections (``mrope_*``, which change nothing for text
positions) travel inside ``rope_parameters`` as transformers writes them.
"""

from __future__ import annotations

from typing import Any

from scaletrain.errors import ConfigError
from scaletrain.models.common.family import FamilyConformance, register
from scaletrain.models.common.config import DecoderConfig
from scaletrain.models.hf_family import HFFamily, Refuse, base_fields, check_silu, rope_from_hf, rope_to_hf
from scaletrain.models.llama.hf import swiglu_kwargs
from scaletrain.models.qwen3_5.config import Qwen3_5TextConfig, hybrid_config_fields
from scaletrain.models.qwen3_5.model import Qwen3_5DecoderLayer, Qwen3_5ForCausalLM, Qwen3_5TextModel

_MROPE = ("mrope_section", "mrope_interleaved")


def hybrid_from_hf(hf: Any, where: str) -> dict[str, Any]:
    """Our fields of a Qwen3.5 / Qwen3-Next text config: sizes, partial RoPE, layer kinds, linear heads."""
    rope = dict(hf.rope_parameters or {})
    factor = rope.pop("partial_rotary_factor", getattr(hf, "partial_rotary_factor", None) or 1.0)
    mrope = {key: rope.pop(key) for key in _MROPE if key in rope}
    check_silu(hf, where)
    fields = {**base_fields(hf, where, rope=False), "hidden_act": "silu"}
    fields["rope_theta"], fields["rope_scaling"] = rope_from_hf(rope, where)
    layer_types = list(hf.layer_types)  # checked on the raw file (common/layer_types.check_hf_layer_types)
    return {**fields, **hybrid_config_fields(hf), **mrope, "partial_rotary_factor": float(factor),
            "layer_types": layer_types, "attention_bias": bool(hf.attention_bias), "qkv_bias": False,
            "mlp_bias": False, "qk_norm": True, "sliding_window": None}


def hybrid_to_hf(config: DecoderConfig, refuse: Refuse) -> dict[str, Any]:
    """transformers' keywords for a Qwen3.5 / Qwen3-Next text config (refusing what it cannot hold)."""
    if not config.qk_norm:
        raise refuse("qk_norm=False (Qwen3.5's attention always norms q and k)")
    if config.qkv_bias and not config.attention_bias:
        raise refuse("q/k/v-only biases (attention_bias puts biases on all four projections)")
    if config.mlp_bias or config.sliding_window is not None:
        raise refuse("mlp biases or a sliding window (Qwen3.5 has neither)")
    rope = {**rope_to_hf(config.rope_theta, config.rope_scaling), "partial_rotary_factor": config.partial_rotary_factor}
    rope.update({key: getattr(config, key) for key in _MROPE if getattr(config, key) is not None})
    linear = {name: getattr(config, name) for name in ("linear_conv_kernel_dim", "linear_key_head_dim",
                                                       "linear_value_head_dim", "linear_num_key_heads",
                                                       "linear_num_value_heads")}
    return {**swiglu_kwargs(config), **linear, "rope_parameters": rope, "layer_types": list(config.layer_types),
            "attention_bias": config.attention_bias}


QWEN3_5_TEXT = HFFamily("Qwen3_5ForCausalLM", "Qwen3_5TextConfig", Qwen3_5TextConfig, hybrid_from_hf, hybrid_to_hf)
#: the hybrid in four layers: linear, linear, linear, full (the default interval of 4), each full head rotating
#: its first quarter (partial RoPE), 2 linear key heads serving 4 value heads; heads over tp=4
HYBRID_CONFORMANCE = dict(num_hidden_layers=4, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=8,
                          linear_num_key_heads=2, linear_num_value_heads=4)
# the released Qwen3.5 folders are vision-language ones (qwen3_5): they load as their language model
register(QWEN3_5_TEXT, Qwen3_5ForCausalLM, multimodal=("qwen3_5",), conformance=FamilyConformance(
    hf=HYBRID_CONFORMANCE, load=dict(sharding_axis_dims=(1, 2, 1, 4, 1)), scan_layers=False,
    # linear, full, linear (full_attention_interval 2), a tied head, attention biases, one key head for 4 value heads
    variants={"tied-bias-interval": {**HYBRID_CONFORMANCE, "num_hidden_layers": 3, "full_attention_interval": 2,
                                     "tie_word_embeddings": True, "attention_bias": True, "linear_num_key_heads": 1}}))

__all__ = ["QWEN3_5_TEXT", "Qwen3_5DecoderLayer", "Qwen3_5ForCausalLM", "Qwen3_5TextConfig", "Qwen3_5TextModel",
           "hybrid_from_hf", "hybrid_to_hf"]
