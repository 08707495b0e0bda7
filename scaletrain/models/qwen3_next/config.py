"""Qwen3-Next's text config: Qwen3.5-MoE's predecessor, the same hybrid with its own MoE options.

Field names are transformers' ``Qwen3NextConfig`` keys. Beyond Qwen3.5-MoE's
(:class:`~scaletrain.models.qwen3_5_moe.config.Qwen3_5MoeTextConfig`): ``norm_topk_prob`` (whether the
chosen experts' probabilities are renormalised), and dense layers among the MoE ones: a layer listed
in ``mlp_only_layers``, or one whose ``index + 1`` is not a multiple of ``decoder_sparse_step``, has a
SwiGLU of ``intermediate_size`` instead of the experts, as transformers builds it.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import StrictBool, model_validator

from scaletrain.models.common.config import at_least_one
from scaletrain.models.qwen3_5_moe.config import Qwen3_5MoeTextConfig


class Qwen3NextConfig(Qwen3_5MoeTextConfig):
    """Qwen3-Next (defaults: Qwen3-Next-80B-A3B)."""

    model_type: ClassVar[str] = "qwen3_next"

    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 5632
    num_hidden_layers: int = 48
    num_experts: int = 512
    num_experts_per_tok: int = 10
    norm_topk_prob: StrictBool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = []

    @model_validator(mode="after")
    def _dense_layers(self) -> Qwen3NextConfig:
        at_least_one(self.decoder_sparse_step)
        outside = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if outside:
            raise ValueError(f"mlp_only_layers {outside} are not layers of the {self.num_hidden_layers} "
                             f"(num_hidden_layers); list indices from 0 to {self.num_hidden_layers - 1}")
        return self

    @property
    def normalize_top_k(self) -> bool:
        return self.norm_topk_prob

    def is_sparse(self, index: int) -> bool:
        """transformers' rule: experts unless listed in ``mlp_only_layers`` or off the ``decoder_sparse_step``."""
        return index not in self.mlp_only_layers and (index + 1) % self.decoder_sparse_step == 0
