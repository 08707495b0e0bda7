"""Qwen2: Llama's block with biases on the q/k/v projections and a window only when asked."""

from __future__ import annotations

from typing import Any, ClassVar

from scaletrain.models.common.family import FamilyConformance, register
from scaletrain.models.common.config import DecoderConfig
from scaletrain.models.hf_family import HFFamily, Refuse, uniform_window, uniform_window_to_hf
from scaletrain.models.llama.hf import refuse_qk_norm, swiglu_fields, swiglu_kwargs
from scaletrain.models.llama.model import LlamaForCausalLM


class Qwen2Config(DecoderConfig):
    """Qwen2: Llama with biases on the q/k/v projections."""

    model_type: ClassVar[str] = "qwen2"
    qkv_bias: bool = True
    rope_theta: float = 1000000.0
    rms_norm_eps: float = 1e-6
    use_sliding_window: bool = False

    def attention_window(self) -> int | None:
        """``sliding_window`` only with ``use_sliding_window`` (as transformers reads Qwen2's config)."""
        return self.sliding_window if self.use_sliding_window else None


class Qwen2ForCausalLM(LlamaForCausalLM):
    config_class: ClassVar[type[DecoderConfig]] = Qwen2Config


def _from_hf(hf: Any, where: str) -> dict[str, Any]:
    window = uniform_window(hf, where)
    return {**swiglu_fields(hf, where), "attention_bias": False, "qkv_bias": True, "mlp_bias": False,
            "use_sliding_window": window is not None, "sliding_window": window}


def _to_hf(config: DecoderConfig, refuse: Refuse) -> dict[str, Any]:
    if not config.qkv_bias or config.attention_bias or config.mlp_bias:
        raise refuse("biases other than q/k/v")
    refuse_qk_norm(config, refuse)
    return {**swiglu_kwargs(config), **uniform_window_to_hf(config)}


QWEN2 = HFFamily("Qwen2ForCausalLM", "Qwen2Config", Qwen2Config, _from_hf, _to_hf)
# q/k/v biases (Qwen2's own) and a tied head
register(QWEN2, Qwen2ForCausalLM, conformance=FamilyConformance(hf=dict(tie_word_embeddings=True), variants={
    "sliding-window": dict(use_sliding_window=True, sliding_window=8, max_window_layers=0),
    "head-dim": dict(head_dim=24, num_key_value_heads=1),
}))

__all__ = ["QWEN2", "Qwen2Config", "Qwen2ForCausalLM"]
