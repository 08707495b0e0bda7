"""OLMo 3: OLMo 2's post-norm block with sliding windows on three layers of four (``layer_types``).

Each layer type has its own RoPE in transformers' config (``rope_parameters`` per type): the full layers
take ``rope_scaling`` when there is one (the released OLMo 3 folders: YaRN, factor 8 over 8192 positions),
the sliding layers never do, and both share ``rope_theta``. YaRN's attention factor is then the full
layers' alone: it scales their RoPE tables, as transformers scales their cos and sin
(``rope_factor_per_layer_type``), and leaves the sliding layers' scores as they are.
"""

from __future__ import annotations

from typing import Any, ClassVar

from flax import nnx
from pydantic import model_validator

from scaletrain.errors import ConfigError
from scaletrain.models.common.decoder import CausalLM, DecoderModel
from scaletrain.models.common.family import FamilyConformance, register
from scaletrain.models.common.layer_types import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    LayerTypedConfig,
    RoPE,
    every_nth_full,
)
from scaletrain.models.common.post_norm import PostNormDecoderLayer
from scaletrain.models.common.config import DecoderConfig
from scaletrain.models.hf_family import HFFamily, Refuse, rope_from_hf, rope_to_hf
from scaletrain.models.olmo2 import olmo_fields, olmo_kwargs, olmo_num_params, refuse_llama_only



class Olmo3Config(LayerTypedConfig):
    """OLMo 3: OLMo 2's fields, a window on the ``sliding_attention`` layers (every fourth layer full by default)."""

    model_type: ClassVar[str] = "olmo3"
    layer_type_names: ClassVar[tuple[str, ...]] = (FULL_ATTENTION, SLIDING_ATTENTION)
    rope_factor_per_layer_type: ClassVar[bool] = True

    vocab_size: int = 50304
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    sliding_window: int | None = 4096
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = 50279
    pad_token_id: int | None = 1

    @classmethod
    def default_layer_types(cls, config: LayerTypedConfig) -> list[str]:
        """Three sliding layers, then a full one (transformers' default)."""
        return every_nth_full(config.num_hidden_layers, 4)

    @model_validator(mode="after")
    def _olmo_options(self) -> Olmo3Config:
        refuse_llama_only(self)
        if self.no_rope_layers is not None:
            raise ValueError("no_rope_layers is not an OLMo 3 option (every layer has RoPE)")
        return self

    def type_rope(self, layer_type: str) -> RoPE:
        """``rope_scaling`` applies to the full layers only, as transformers reads OLMo 3's config."""
        return (self.rope_theta, None) if layer_type == SLIDING_ATTENTION else super().type_rope(layer_type)

    @property
    def num_params(self) -> int:
        return olmo_num_params(self)


class Olmo3Model(DecoderModel):
    """Embeddings, post-norm layers and the final norm (HF's ``model.*``)."""

    config_class: ClassVar[type[DecoderConfig]] = Olmo3Config
    layer_class: ClassVar[type[nnx.Module]] = PostNormDecoderLayer


class Olmo3ForCausalLM(CausalLM):
    config_class: ClassVar[type[DecoderConfig]] = Olmo3Config
    base_model_class: ClassVar[type[DecoderModel]] = Olmo3Model


def _from_hf(hf: Any, where: str) -> dict[str, Any]:
    rope = hf.rope_parameters
    if not isinstance(rope, dict) or set(rope) != {FULL_ATTENTION, SLIDING_ATTENTION}:
        raise ConfigError(f"{where}: rope_parameters {rope!r}: expected one entry per layer type "
                          f"({FULL_ATTENTION}, {SLIDING_ATTENTION})")
    theta, scaling = rope_from_hf(rope[FULL_ATTENTION], where, f"rope_parameters.{FULL_ATTENTION}")
    local_theta, local_scaling = rope_from_hf(rope[SLIDING_ATTENTION], where, f"rope_parameters.{SLIDING_ATTENTION}")
    if local_scaling is not None or local_theta != theta:
        raise ConfigError(f"{where}: rope_parameters.{SLIDING_ATTENTION}: only the default rope type with the full "
                          f"layers' rope_theta ({theta}) is supported for the sliding layers")
    fields = olmo_fields(hf, where, rope=False)
    sliding = SLIDING_ATTENTION in hf.layer_types
    return {**fields, "rope_theta": theta, "rope_scaling": scaling, "layer_types": list(hf.layer_types),
            "sliding_window": hf.sliding_window if sliding else None}


def _to_hf(config: DecoderConfig, refuse: Refuse) -> dict[str, Any]:
    return {**olmo_kwargs(config, rope=False),
            "rope_parameters": {FULL_ATTENTION: rope_to_hf(config.rope_theta, config.rope_scaling),
                                SLIDING_ATTENTION: rope_to_hf(config.rope_theta, None)},
            "layer_types": list(config.layer_types), "sliding_window": config.sliding_window}


OLMO3 = HFFamily("Olmo3ForCausalLM", "Olmo3Config", Olmo3Config, _from_hf, _to_hf)
#: a sliding layer (window 8, shorter than the test rows and prompts) then a full one; the variant: the default
#: pattern (three sliding layers, then a full one) with YaRN on the full layers as the released OLMo 3 folders
#: have it (their keys, the context 4x the original here), a tied head
register(OLMO3, Olmo3ForCausalLM, Olmo3Model, conformance=FamilyConformance(
    hf=dict(layer_types=[SLIDING_ATTENTION, FULL_ATTENTION], sliding_window=8),
    variants={"yarn-full": dict(
        num_hidden_layers=4, sliding_window=8, tie_word_embeddings=True,
        rope_parameters={FULL_ATTENTION: {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                          "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
                                          "attention_factor": 1.2079441541679836},
                         SLIDING_ATTENTION: {"rope_type": "default", "rope_theta": 10000.0}})}))

__all__ = ["OLMO3", "Olmo3Config", "Olmo3ForCausalLM", "Olmo3Model"]
