"""Qwen3.5-MoE's text config: Qwen3.5's hybrid of linear and gated full attention with a sparse MLP in every layer.

Field names are transformers' ``Qwen3_5MoeTextConfig`` keys. What the MoE adds to
:class:`~scaletrain.models.qwen3_5.config.Qwen3_5TextConfig`: ``num_experts`` routed SwiGLU experts of
width ``moe_intermediate_size``, ``num_experts_per_tok`` of them chosen per token by a softmax
router and renormalised (Qwen3.5-MoE always renormalises; Qwen3-Next says so with ``norm_topk_prob``),
plus one shared SwiGLU expert of ``shared_expert_intermediate_size`` scaled per token by a sigmoid
gate. There is no dense MLP: ``intermediate_size`` (absent from transformers' config) holds the shared
expert's width and is not written back. ``router_aux_loss_coef`` is transformers' balancing-loss
coefficient; ``router_z_loss_coef`` (0) is ours and not written to config.json.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import model_validator

from scaletrain.models.common.config import at_least_one
from scaletrain.models.qwen3_5.config import Qwen3_5TextConfig


class Qwen3_5MoeTextConfig(Qwen3_5TextConfig):
    """Qwen3.5-MoE text decoder (defaults: Qwen3.5-35B-A3B's language model)."""

    model_type: ClassVar[str] = "qwen3_5_moe_text"

    vocab_size: int = 248320
    hidden_size: int = 2048
    intermediate_size: int = 512
    num_hidden_layers: int = 40
    num_attention_heads: int = 16
    num_key_value_heads: int | None = 2
    head_dim: int | None = 256
    num_experts: int = 256
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    router_aux_loss_coef: float = 0.001
    router_z_loss_coef: float = 0.0

    @model_validator(mode="after")
    def _experts(self) -> Qwen3_5MoeTextConfig:
        for name in ("num_experts", "moe_intermediate_size", "shared_expert_intermediate_size"):
            at_least_one(getattr(self, name))
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} must be between 1 and num_experts "
                             f"({self.num_experts})")
        if self.mlp_bias:
            raise ValueError("mlp_bias: the experts of a mixture of experts have no biases")
        return self

    @property
    def normalize_top_k(self) -> bool:
        """Whether the chosen experts' probabilities are renormalised to sum to one: always for Qwen3.5-MoE."""
        return True

    def is_sparse(self, index: int) -> bool:
        """Whether layer ``index`` has the experts (every layer here; Qwen3-Next may mix in dense ones)."""
        return True

    def mlp_params(self, index: int, active: bool) -> int:
        """The router, the routed experts (``num_experts_per_tok`` of them when ``active``), the shared expert
        and its gate; a dense layer's SwiGLU of ``intermediate_size``."""
        h = self.hidden_size
        if not self.is_sparse(index):
            return 3 * h * self.intermediate_size
        experts = self.num_experts_per_tok if active else self.num_experts
        return (h * self.num_experts + experts * 3 * h * self.moe_intermediate_size
                + 3 * h * self.shared_expert_intermediate_size + h)
