"""SmolLM3: Llama's pre-norm block with no RoPE on every fourth layer (NoPE, ``no_rope_layers``).

``no_rope_layers`` has 1 where a layer rotates queries and keys and 0 where it does not; by default every
``no_rope_layer_interval``-th layer (4) goes without. With ``use_sliding_window`` the NoPE layers are
``sliding_attention`` by default (transformers' default ``layer_types``); a sliding layer attends within
``sliding_window`` (what transformers' mask does, whatever ``use_sliding_window`` says).
"""

from __future__ import annotations

from typing import Any, ClassVar

from flax import nnx
from pydantic import model_validator

from scaletrain.models.common.decoder import CausalLM, DecoderModel
from scaletrain.models.common.family import FamilyConformance, register
from scaletrain.models.common.layer_types import FULL_ATTENTION, SLIDING_ATTENTION, LayerTypedConfig
from scaletrain.models.common.config import DecoderConfig
from scaletrain.models.hf_family import HFFamily, Refuse
from scaletrain.models.llama.hf import refuse_qk_norm, swiglu_fields, swiglu_kwargs
from scaletrain.models.llama.model import DecoderLayer


class SmolLM3Config(LayerTypedConfig):
    """SmolLM3: Llama's fields, NoPE layers and optional sliding layers (transformers' defaults)."""

    model_type: ClassVar[str] = "smollm3"

    vocab_size: int = 128256
    hidden_size: int = 2048
    intermediate_size: int = 11008
    num_hidden_layers: int = 36
    num_attention_heads: int = 16
    num_key_value_heads: int | None = 4
    max_position_embeddings: int = 32768
    rope_theta: float = 2000000.0
    tie_word_embeddings: bool = True
    use_sliding_window: bool = False
    no_rope_layer_interval: int = 4
    bos_token_id: int | None = 128000
    eos_token_id: int | list[int] | None = 128001
    pad_token_id: int | None = 128004

    @model_validator(mode="before")
    @classmethod
    def _default_no_rope_layers(cls, data: Any) -> Any:
        # every no_rope_layer_interval-th layer without RoPE unless the list is given (as transformers)
        if isinstance(data, dict) and data.get("no_rope_layers") is None:
            interval = data.get("no_rope_layer_interval", 4)
            layers = data.get("num_hidden_layers", cls.model_fields["num_hidden_layers"].default)
            if isinstance(interval, int) and interval >= 1 and isinstance(layers, int):
                data = {**data, "no_rope_layers": [int((i + 1) % interval != 0) for i in range(layers)]}
        return data

    @classmethod
    def default_layer_types(cls, config: LayerTypedConfig) -> list[str]:
        """The NoPE layers sliding when ``use_sliding_window`` and a window are set, every layer full otherwise."""
        sliding = config.use_sliding_window and config.sliding_window is not None
        return [SLIDING_ATTENTION if sliding and not config.no_rope_layers[i] else FULL_ATTENTION
                for i in range(config.num_hidden_layers)]


class SmolLM3Model(DecoderModel):
    """Embeddings, Llama's pre-norm layers and the final norm (HF's ``model.*``)."""

    config_class: ClassVar[type[DecoderConfig]] = SmolLM3Config
    layer_class: ClassVar[type[nnx.Module]] = DecoderLayer


class SmolLM3ForCausalLM(CausalLM):
    config_class: ClassVar[type[DecoderConfig]] = SmolLM3Config
    base_model_class: ClassVar[type[DecoderModel]] = SmolLM3Model


def _from_hf(hf: Any, where: str) -> dict[str, Any]:
    sliding = SLIDING_ATTENTION in hf.layer_types
    return {**swiglu_fields(hf, where), "attention_bias": bool(hf.attention_bias), "qkv_bias": False,
            "mlp_bias": bool(hf.mlp_bias), "use_sliding_window": bool(hf.use_sliding_window),
            "sliding_window": hf.sliding_window if sliding else None, "layer_types": list(hf.layer_types),
            "no_rope_layers": [int(x) for x in hf.no_rope_layers[:hf.num_hidden_layers]],
            "no_rope_layer_interval": hf.no_rope_layer_interval}


def _to_hf(config: DecoderConfig, refuse: Refuse) -> dict[str, Any]:
    if config.qkv_bias and not config.attention_bias:
        raise refuse("qkv_bias=True but attention_bias=False")
    refuse_qk_norm(config, refuse)
    return {**swiglu_kwargs(config), "attention_bias": config.attention_bias, "mlp_bias": config.mlp_bias,
            "use_sliding_window": config.use_sliding_window, "sliding_window": config.sliding_window,
            "layer_types": list(config.layer_types), "no_rope_layers": list(config.no_rope_layers),
            "no_rope_layer_interval": config.no_rope_layer_interval}


SMOLLM3 = HFFamily("SmolLM3ForCausalLM", "SmolLM3Config", SmolLM3Config, _from_hf, _to_hf)
#: a RoPE layer, then a NoPE layer that is also sliding (window 8): two kinds in one stack, a tied head (pad id 0:
#: the tiny vocabulary has no 128004); the variant: four full layers, the last NoPE, biases, an untied head
register(SMOLLM3, SmolLM3ForCausalLM, SmolLM3Model, conformance=FamilyConformance(
    hf=dict(pad_token_id=0, no_rope_layer_interval=2, use_sliding_window=True, sliding_window=8),
    variants={"all-full-biases": dict(pad_token_id=0, num_hidden_layers=4, attention_bias=True, mlp_bias=True,
                                      tie_word_embeddings=False)}))

__all__ = ["SMOLLM3", "SmolLM3Config", "SmolLM3ForCausalLM", "SmolLM3Model"]
