"""GPT-OSS config and its config.json mapping.

Field names are transformers' ``GptOssConfig`` keys. What GPT-OSS adds to the Llama config:
layers that alternate a sliding window (128 tokens in the released models) and full attention
(``layer_types``), one learned attention sink per head, every MLP a top-k of
``num_local_experts`` experts whose router and linears carry biases and whose SwiGLU is clamped
(``swiglu_alpha``, ``swiglu_limit``), YaRN RoPE and biases on all four attention projections.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import field_validator, model_validator

from scaletrain.models.common.config import DecoderConfig, positive
from scaletrain.models.common.layer_types import SLIDING_ATTENTION, LayerTypedConfig, every_nth_full
from scaletrain.models.common.moe_config import check_moe
from scaletrain.models.hf_family import Refuse, base_fields, base_hf_kwargs, check_silu
#: released GPT-OSS RoPE: YaRN stretching a 4096-token context 32 times, ramp ends not rounded
GPT_OSS_YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}


class GptOssConfig(LayerTypedConfig):
    """GPT-OSS: sinks, alternating sliding/full layers, biased top-k experts with a clamped SwiGLU, YaRN.

    The defaults are GPT-OSS-20B's published config (openai/gpt-oss-20b, config.json)."""

    model_type: ClassVar[str] = "gpt_oss"
    #: the experts sit in checkpoints as the stacked [E, in, out] tensors we hold (``mlp.experts.gate_up_proj``),
    #: not one linear per expert (:func:`scaletrain.models.hf.hf_source`)
    experts_stored_whole: ClassVar[bool] = True
    #: the decoder layers' attention adds a learned sink per head (:func:`flash_sharding.training_mechanism`)
    attention_sinks: ClassVar[bool] = True

    vocab_size: int = 201088
    hidden_size: int = 2880
    intermediate_size: int = 2880
    num_hidden_layers: int = 24
    num_attention_heads: int = 64
    num_key_value_heads: int | None = 8
    head_dim: int | None = 64
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-5
    rope_theta: float = 150000.0
    rope_scaling: dict[str, Any] | None = dict(GPT_OSS_YARN)
    attention_bias: bool = True
    sliding_window: int | None = 128
    num_local_experts: int = 32
    num_experts_per_tok: int = 4
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    router_aux_loss_coef: float = 0.9
    router_z_loss_coef: float = 0.0
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = 200002
    pad_token_id: int | None = 199999

    @field_validator("swiglu_alpha", "swiglu_limit", mode="after")
    @classmethod
    def _positive_swiglu(cls, value: float) -> float:
        return positive(value)

    @classmethod
    def default_layer_types(cls, config: LayerTypedConfig) -> list[str]:
        """As transformers: sliding first, then every other layer full."""
        return every_nth_full(config.num_hidden_layers, 2)

    @model_validator(mode="after")
    def _gpt_oss(self) -> GptOssConfig:
        if self.no_rope_layers is not None:
            raise ValueError("no_rope_layers: every GPT-OSS layer rotates by RoPE")
        if self.qk_norm or self.qkv_bias:
            raise ValueError("qk_norm/qkv_bias are not GPT-OSS options (its four projections take attention_bias)")
        check_moe(self)
        return self

    @property
    def num_experts(self) -> int:
        return self.num_local_experts

    @property
    def expert_intermediate_size(self) -> int:
        return self.intermediate_size

    @property
    def normalize_top_k(self) -> bool:
        """A softmax over the k largest router logits: the top-k of the full softmax, renormalised."""
        return True

    def _params(self, experts: int) -> int:
        h, i, e = self.hidden_size, self.intermediate_size, self.num_local_experts
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        attention = 2 * h * q + 2 * h * kv + q + 2 * kv + h + self.num_attention_heads  # + biases, sinks
        moe = h * e + e + experts * (3 * h * i + 2 * i + h)  # router, experts' gate_up, down and biases
        layer = attention + moe + 2 * h
        head = 0 if self.tie_word_embeddings else h * self.vocab_size
        return self.vocab_size * h + self.num_hidden_layers * layer + h + head

    @property
    def num_params(self) -> int:
        return self._params(self.num_local_experts)

    @property
    def num_active_params(self) -> int:
        return self._params(self.num_experts_per_tok)


# ---------------------------------------------------------------------------------
# config.json
# ---------------------------------------------------------------------------------
def gpt_oss_from_hf(hf: Any, where: str) -> dict[str, Any]:
    check_silu(hf, where)  # unknown layer_types entries: hf_config.check_hf_layer_types, before transformers'
    return {
        **base_fields(hf, where),
        "hidden_act": "silu",
        "attention_bias": bool(hf.attention_bias),
        "sliding_window": hf.sliding_window if SLIDING_ATTENTION in hf.layer_types else None,
        "layer_types": list(hf.layer_types),
        **{key: getattr(hf, key) for key in ("num_local_experts", "num_experts_per_tok", "swiglu_alpha",
                                             "swiglu_limit", "router_aux_loss_coef")},
    }


def gpt_oss_to_hf(config: DecoderConfig, refuse: Refuse) -> dict[str, Any]:
    kwargs = base_hf_kwargs(config)
    return {
        **kwargs,
        "hidden_act": "silu",
        "attention_bias": config.attention_bias,
        "sliding_window": config.sliding_window,
        "layer_types": list(config.layer_types),
        **{key: getattr(config, key) for key in ("num_local_experts", "num_experts_per_tok", "swiglu_alpha",
                                                 "swiglu_limit", "router_aux_loss_coef")},
    }
