"""Qwen3-Next: Qwen3.5-MoE's predecessor (Qwen3-Next-80B-A3B), the same hybrid with fused linear-attention
projections (:mod:`scaletrain.models.qwen3_next.model`), ``norm_topk_prob`` and optional dense layers.

The config.json mapping reads and writes transformers' ``Qwen3NextConfig`` keys: Qwen3.5-MoE's
(:func:`scaletrain.models.qwen3_5_moe.moe_hybrid_from_hf`) plus ``norm_topk_prob``,
``decoder_sparse_step`` and ``mlp_only_layers``.
"""

from __future__ import annotations

from typing import Any

from scaletrain.models.common.config import DecoderConfig
from scaletrain.models.common.family import FamilyConformance, register
from scaletrain.models.hf_family import HFFamily, Refuse
from scaletrain.models.qwen3_5_moe import MOE_CONFORMANCE, moe_hybrid_from_hf, moe_hybrid_to_hf
from scaletrain.models.qwen3_next.config import Qwen3NextConfig
from scaletrain.models.qwen3_next.model import (
    Qwen3NextDecoderLayer,
    Qwen3NextForCausalLM,
    Qwen3NextGatedDeltaNet,
    Qwen3NextModel,
)

_KEYS = ("norm_topk_prob", "decoder_sparse_step", "mlp_only_layers")


def _from_hf(hf: Any, where: str) -> dict[str, Any]:
    fields = {**moe_hybrid_from_hf(hf, where), **{key: getattr(hf, key) for key in _KEYS}}
    return {**fields, "norm_topk_prob": bool(fields["norm_topk_prob"]), "mlp_only_layers": list(hf.mlp_only_layers)}


def _to_hf(config: DecoderConfig, refuse: Refuse) -> dict[str, Any]:
    return {**moe_hybrid_to_hf(config, refuse), **{key: getattr(config, key) for key in _KEYS}}


QWEN3_NEXT = HFFamily("Qwen3NextForCausalLM", "Qwen3NextConfig", Qwen3NextConfig, _from_hf, _to_hf)
# linear, full, linear: the top-2 weights not renormalised, the last (linear) layer dense
register(QWEN3_NEXT, Qwen3NextForCausalLM, conformance=FamilyConformance(
    hf={**MOE_CONFORMANCE, "num_hidden_layers": 3, "norm_topk_prob": False, "mlp_only_layers": [2]},
    load=dict(sharding_axis_dims=(1, 2, 2, 2, 1)), lora="attention", scan_layers=False,
    # linear then full: the first layer dense by decoder_sparse_step 2, one key head for 4 value heads, a tied
    # head, attention biases
    variants={"sparse-step-tied": {**MOE_CONFORMANCE, "decoder_sparse_step": 2, "linear_num_key_heads": 1,
                                   "tie_word_embeddings": True, "attention_bias": True}}))

__all__ = ["QWEN3_NEXT", "Qwen3NextConfig", "Qwen3NextDecoderLayer", "Qwen3NextForCausalLM",
           "Qwen3NextGatedDeltaNet", "Qwen3NextModel"]
