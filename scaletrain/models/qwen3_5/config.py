"""Qwen3.5's text config: the hybrid of Gated DeltaNet (linear-attention) and gated full-attention layers.

Field names are transformers' ``Qwen3_5TextConfig`` keys. What Qwen3.5 adds to the decoder's fields:
``layer_types`` (``linear_attention`` or ``full_attention`` per layer; by default every
``full_attention_interval``-th layer is full, 3 linear : 1 full), the linear layers' head counts and
sizes (``linear_*``), the convolution's width, and partial RoPE (``partial_rotary_factor``: the full
layers rotate the first quarter of each head). Its q/k norms are always there.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import model_validator

from scaletrain.errors import ConfigError
from scaletrain.models.common.config import at_least_one
from scaletrain.models.common.layer_types import FULL_ATTENTION, LayerTypedConfig

LINEAR = "linear_attention"
#: the layer types Qwen3.5's blocks build
LAYER_TYPES = (LINEAR, FULL_ATTENTION)


class Qwen3_5TextConfig(LayerTypedConfig):
    """Qwen3.5 (dense) text decoder: linear-attention and gated full-attention layers, SwiGLU MLPs."""

    model_type: ClassVar[str] = "qwen3_5_text"
    layer_type_names: ClassVar[tuple[str, ...]] = LAYER_TYPES

    vocab_size: int = 248320
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 32
    num_attention_heads: int = 16
    num_key_value_heads: int | None = 4
    head_dim: int | None = 256
    max_position_embeddings: int = 32768
    rope_theta: float = 10000000.0
    partial_rotary_factor: float = 0.25
    qk_norm: bool = True
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    full_attention_interval: int = 4
    # transformers' multimodal RoPE sections: text positions are equal on all three, so they change nothing
    # here; kept to write them back on export
    mrope_section: list[int] | None = None
    mrope_interleaved: bool | None = None

    @classmethod
    def default_layer_types(cls, config: LayerTypedConfig) -> list[str]:
        """transformers' pattern: every ``full_attention_interval``-th layer full attention, the rest linear."""
        interval = config.full_attention_interval
        return [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR for i in range(config.num_hidden_layers)]

    @model_validator(mode="after")
    def _hybrid(self) -> Qwen3_5TextConfig:
        for name in ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                     "linear_num_key_heads", "linear_num_value_heads", "full_attention_interval"):
            at_least_one(getattr(self, name))
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"linear_num_value_heads {self.linear_num_value_heads} is not a multiple of "
                             f"linear_num_key_heads {self.linear_num_key_heads}")
        if not 0 < self.partial_rotary_factor <= 1:
            raise ValueError(f"partial_rotary_factor {self.partial_rotary_factor} must be in (0, 1]")
        if self.scan_layers:  # raised as it is (not a ValueError pydantic would wrap in lines of its own)
            raise ConfigError(f"scan_layers: true is not supported for {self.model_type}: its linear-attention and "
                              "full-attention layers hold different parameters, so they are not one stack; "
                              "set scan_layers: false")
        return self

    @property
    def full_layers(self) -> int:
        """How many layers are full attention."""
        return self.layer_types.count(FULL_ATTENTION)

    def _count(self, active: bool) -> int:
        """All parameters (``active``: a token's, the routed experts it does not use left out)."""
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        full = 2 * h * q + 2 * h * kv + q * h + 2 * d  # q_proj holds the gate too; q/k norms
        if self.attention_bias:
            full += 2 * q + 2 * kv + h
        key, value = self.linear_num_key_heads * self.linear_key_head_dim, (
            self.linear_num_value_heads * self.linear_value_head_dim)
        conv = 2 * key + value
        linear = (h * conv + h * value + 2 * h * self.linear_num_value_heads + conv * self.linear_conv_kernel_dim
                  + 2 * self.linear_num_value_heads + self.linear_value_head_dim + value * h)
        mlps = sum(self.mlp_params(i, active) for i in range(self.num_hidden_layers))
        layers = (self.num_hidden_layers * 2 * h + mlps + self.full_layers * full
                  + (self.num_hidden_layers - self.full_layers) * linear)
        head = 0 if self.tie_word_embeddings else h * self.vocab_size
        return self.vocab_size * h + layers + h + head

    def mlp_params(self, index: int, active: bool) -> int:
        """Layer ``index``'s feed-forward parameters (``active``: those one token computes with): a SwiGLU here;
        the MoE families (:mod:`scaletrain.models.qwen3_5_moe`) count their experts."""
        return 3 * self.hidden_size * self.intermediate_size

    @property
    def num_params(self) -> int:
        return self._count(active=False)

    @property
    def num_active_params(self) -> int:
        return self._count(active=True)

    def flops_per_token(self, seq_len: int) -> float:
        """6 x matmul parameters, plus causal attention on the full layers only, plus the linear layers'
        state reads and writes (about 4 Dk Dv per value head and token forward, as a chunk of the rule costs)."""
        matmul = self.num_active_params - self.vocab_size * self.hidden_size
        if self.tie_word_embeddings:
            matmul += self.vocab_size * self.hidden_size
        attention = 6 * self.full_layers * seq_len * self.num_attention_heads * self.head_dim
        state = 3 * 4 * (self.num_hidden_layers - self.full_layers) * self.linear_num_value_heads * (
            self.linear_key_head_dim * self.linear_value_head_dim)
        return 6.0 * matmul + attention + state


def hybrid_config_fields(hf: Any) -> dict[str, Any]:
    """The linear-attention fields every Qwen3.5 / Qwen3-Next config.json shares."""
    return {name: getattr(hf, name) for name in ("linear_conv_kernel_dim", "linear_key_head_dim",
                                                 "linear_value_head_dim", "linear_num_key_heads",
                                                 "linear_num_value_heads")}
