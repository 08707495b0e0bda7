"""Gemma 3 (text) config and its config.json mapping.

Field names are transformers' ``Gemma3TextConfig`` keys, except the MLP activation,
which is ``hidden_act`` here as in every other family (``hidden_activation`` in the
config.json). What Gemma 3 adds to the Llama config: interleaved sliding-window and
global layers (``layer_types``), each kind with its own RoPE (``rope_local_base_freq``
for the local layers, ``rope_theta`` + ``rope_scaling`` for the global ones), the
softmax scale ``query_pre_attn_scalar ** -0.5`` and final logit soft-capping.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import field_validator, model_validator

from scaletrain.errors import ConfigError
from scaletrain.models.common.config import DecoderConfig, positive
from scaletrain.models.common.layer_types import FULL_ATTENTION as FULL
from scaletrain.models.common.layer_types import SLIDING_ATTENTION as SLIDING
from scaletrain.models.common.layer_types import LayerTypedConfig, RoPE, every_nth_full
from scaletrain.models.hf_family import Refuse, base_fields, base_hf_kwargs, rope_from_hf, rope_to_hf


class Gemma3TextConfig(LayerTypedConfig):
    """Gemma 3 text decoder: GeGLU MLP, (1 + w) RMSNorms around attention and MLP, q/k norm."""

    model_type: ClassVar[str] = "gemma3_text"
    activations: ClassVar[tuple[str, ...]] = ("gelu_pytorch_tanh",)

    vocab_size: int = 262208
    hidden_size: int = 2304
    intermediate_size: int = 9216
    num_hidden_layers: int = 26
    num_attention_heads: int = 8
    num_key_value_heads: int | None = 4
    head_dim: int | None = 256
    hidden_act: str = "gelu_pytorch_tanh"
    max_position_embeddings: int = 131072
    rope_theta: float = 1000000.0
    rope_local_base_freq: float = 10000.0
    query_pre_attn_scalar: float = 256
    sliding_window: int | None = 4096
    # every `sliding_window_pattern`-th layer is global when layer_types is not given (as transformers)
    sliding_window_pattern: int = 6
    final_logit_softcapping: float | None = None
    tie_word_embeddings: bool = True
    bos_token_id: int | None = 2
    eos_token_id: int | list[int] | None = 1
    pad_token_id: int | None = 0

    @field_validator("sliding_window_pattern", mode="after")
    @classmethod
    def _pattern(cls, value: int) -> int:
        if value < 1:
            raise ValueError("must be at least 1 (every n-th layer is global)")
        return value

    @field_validator("query_pre_attn_scalar", "rope_local_base_freq", "final_logit_softcapping", mode="after")
    @classmethod
    def _positive_scale(cls, value: float | None) -> float | None:
        return positive(value)  # a cap of 0 would squash every logit to 0

    @classmethod
    def default_layer_types(cls, config: LayerTypedConfig) -> list[str]:
        """Every ``sliding_window_pattern``-th layer global, the others local (as transformers)."""
        return every_nth_full(config.num_hidden_layers, config.sliding_window_pattern)

    @model_validator(mode="after")
    def _gemma_options(self) -> Gemma3TextConfig:
        if self.qk_norm or self.qkv_bias or self.mlp_bias:
            raise ValueError("qk_norm/qkv_bias/mlp_bias are not Gemma 3 options (its q/k norms are always there)")
        return self

    def type_rope(self, layer_type: str) -> RoPE:
        """Local layers rotate with ``rope_local_base_freq`` and no scaling, global ones by the config's RoPE."""
        return (self.rope_local_base_freq, None) if layer_type == SLIDING else super().type_rope(layer_type)

    @property
    def num_params(self) -> int:
        # four norms per layer (Llama has two) and the per-head q/k norms
        return super().num_params + self.num_hidden_layers * (2 * self.hidden_size + 2 * self.head_dim)


# ---------------------------------------------------------------------------------
# config.json
# ---------------------------------------------------------------------------------
def gemma3_from_hf(hf: Any, where: str) -> dict[str, Any]:
    if hf.hidden_activation != "gelu_pytorch_tanh":
        raise ConfigError(f"{where}: hidden_activation {hf.hidden_activation!r} is not supported "
                          "(only gelu_pytorch_tanh)")
    if hf.attn_logit_softcapping is not None:
        raise ConfigError(f"{where}: attn_logit_softcapping={hf.attn_logit_softcapping} is not supported "
                          "(only null, as in every released Gemma 3)")
    if getattr(hf, "use_bidirectional_attention", False):
        raise ConfigError(f"{where}: use_bidirectional_attention=true is not supported (causal LM only)")
    rope = hf.rope_parameters
    if not isinstance(rope, dict) or set(rope) != {FULL, SLIDING}:
        raise ConfigError(f"{where}: rope_parameters {rope!r}: expected one entry per layer type ({FULL}, {SLIDING})")
    theta, scaling = rope_from_hf(rope[FULL], where, f"rope_parameters.{FULL}")
    local_theta, local_scaling = rope_from_hf(rope[SLIDING], where, f"rope_parameters.{SLIDING}")
    if scaling is not None and scaling["rope_type"] == "yarn":  # its factor would scale the local layers too
        raise ConfigError(f"{where}: rope_parameters.{FULL}: rope type 'yarn' is not supported for Gemma 3 "
                          "(linear, llama3)")
    if local_scaling is not None:
        raise ConfigError(f"{where}: rope_parameters.{SLIDING}: rope type {local_scaling['rope_type']!r} is not "
                          "supported for the local layers (only default)")
    sliding = SLIDING in hf.layer_types
    return {
        **base_fields(hf, where, rope=False),
        "hidden_act": "gelu_pytorch_tanh",
        "attention_bias": bool(hf.attention_bias),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "rope_local_base_freq": local_theta,
        "query_pre_attn_scalar": hf.query_pre_attn_scalar,
        "sliding_window": hf.sliding_window if sliding else None,
        "layer_types": list(hf.layer_types),
        "final_logit_softcapping": hf.final_logit_softcapping,
    }


def gemma3_to_hf(config: DecoderConfig, refuse: Refuse) -> dict[str, Any]:
    scalar = config.query_pre_attn_scalar  # an int in transformers' (strict) config class when it is one
    return {
        **base_hf_kwargs(config, rope=False),
        "hidden_activation": config.hidden_act,
        "attention_bias": config.attention_bias,
        "rope_parameters": {FULL: rope_to_hf(config.rope_theta, config.rope_scaling),
                            SLIDING: rope_to_hf(config.rope_local_base_freq, None)},
        "query_pre_attn_scalar": int(scalar) if float(scalar).is_integer() else scalar,
        "sliding_window": config.sliding_window,
        "layer_types": list(config.layer_types),
        "final_logit_softcapping": config.final_logit_softcapping,
        "attn_logit_softcapping": None,
    }

