"""OLMo 2: post-norm blocks (norms after attention and the MLP) with q/k norms over all heads.

Everything else is Llama's: grouped-query attention with RoPE, a SwiGLU MLP, RMSNorm, an untied head.
The block is :class:`~scaletrain.models.common.post_norm.PostNormDecoderLayer`, which OLMo 3 reuses.
"""

from __future__ import annotations

from typing import Any, ClassVar

from flax import nnx
from pydantic import model_validator

from scaletrain.models.common.decoder import CausalLM, DecoderModel
from scaletrain.models.common.family import FamilyConformance, register
from scaletrain.models.common.post_norm import PostNormDecoderLayer
from scaletrain.models.common.config import DecoderConfig
from scaletrain.models.hf_family import HFFamily, Refuse, base_fields, base_hf_kwargs, check_silu


def olmo_num_params(config: DecoderConfig) -> int:
    """Llama's count with OLMo's norms: two per layer as Llama's, plus q/k norms over all heads."""
    qk = (config.num_attention_heads + config.num_key_value_heads) * config.head_dim
    return DecoderConfig.num_params.fget(config) + config.num_hidden_layers * qk


def refuse_llama_only(config: DecoderConfig) -> None:
    """ValueError for the Llama options OLMo has no place for (per-head q/k norms, q/k/v-only or MLP biases)."""
    if config.qk_norm or config.qkv_bias or config.mlp_bias:
        raise ValueError("qk_norm/qkv_bias/mlp_bias are not OLMo options (its q/k norms over all heads are always "
                         "there; attention_bias puts biases on all four projections)")


class Olmo2Config(DecoderConfig):
    """OLMo 2: Llama's fields and defaults of transformers' ``Olmo2Config``."""

    model_type: ClassVar[str] = "olmo2"

    vocab_size: int = 50304
    rms_norm_eps: float = 1e-5
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = 50279
    pad_token_id: int | None = 1

    @model_validator(mode="after")
    def _olmo_options(self) -> Olmo2Config:
        refuse_llama_only(self)
        return self

    @property
    def num_params(self) -> int:
        return olmo_num_params(self)


class Olmo2Model(DecoderModel):
    """Embeddings, post-norm layers and the final norm (HF's ``model.*``)."""

    config_class: ClassVar[type[DecoderConfig]] = Olmo2Config
    layer_class: ClassVar[type[nnx.Module]] = PostNormDecoderLayer


class Olmo2ForCausalLM(CausalLM):
    config_class: ClassVar[type[DecoderConfig]] = Olmo2Config
    base_model_class: ClassVar[type[DecoderModel]] = Olmo2Model


def olmo_fields(hf: Any, where: str, *, rope: bool = True) -> dict[str, Any]:
    """The fields OLMo 2 and 3 read alike from a transformers config (SiLU checked; RoPE unless ``rope=False``)."""
    check_silu(hf, where)
    return {**base_fields(hf, where, rope=rope), "hidden_act": "silu", "attention_bias": bool(hf.attention_bias)}


def olmo_kwargs(config: DecoderConfig, *, rope: bool = True) -> dict[str, Any]:
    """The transformers keywords OLMo 2 and 3 write alike (RoPE unless ``rope=False``)."""
    return {**base_hf_kwargs(config, rope=rope), "hidden_act": "silu", "attention_bias": config.attention_bias}


def _from_hf(hf: Any, where: str) -> dict[str, Any]:
    return olmo_fields(hf, where)


def _to_hf(config: DecoderConfig, refuse: Refuse) -> dict[str, Any]:
    if config.sliding_window is not None:
        raise refuse(f"sliding_window={config.sliding_window} (use model_type olmo3)")
    return olmo_kwargs(config)


OLMO2 = HFFamily("Olmo2ForCausalLM", "Olmo2Config", Olmo2Config, _from_hf, _to_hf)
#: post-norm blocks, q/k norms over all heads, biases on the four attention projections
register(OLMO2, Olmo2ForCausalLM, Olmo2Model, conformance=FamilyConformance(hf=dict(attention_bias=True)))

__all__ = ["OLMO2", "Olmo2Config", "Olmo2ForCausalLM", "Olmo2Model", "olmo_fields", "olmo_kwargs",
           "olmo_num_params", "refuse_llama_only"]
