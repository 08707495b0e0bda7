"""The conformance suite's table: one tiny configuration per registered family, keyed by model_type.

Every causal-LM ``model_type`` in :mod:`scaletrain.models.registry` is checked by
``test_families_conformance.py`` against transformers' own implementation; the
configuration it is checked with lives here. A family registered without an entry
fails every check with a message saying to add one, so registering a family is what
puts it under the suite.

Each entry's ``hf`` overrides (on top of :data:`hf_testing.TINY`) are chosen to switch
on what is particular to the family (windows shorter than the test rows, biases, tied
heads, ``head_dim != hidden / heads``, several experts per token on an ``ep`` mesh);
``variants`` are further configurations of the same family (overrides on ``TINY`` too, not on
``hf``) checked for logits and the export round trip only: they exercise the HF mapping and
config options, not new code paths of generation, packing or the layer loop.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np
import pytest
from flax import nnx

from scaletrain.errors import ConfigError
from scaletrain.models.registry import AutoModelForCausalLM, get_modules_by_type, registered_model_types
from hf_testing import GEMMA3_LOCAL_GLOBAL, LLAMA3_ROPE, hf_model, save_hf

#: every linear layer but the head, norms trained too, rsLoRA scaling: what PEFT must reproduce
LORA_ALL_LINEAR = dict(target_modules="all-linear", rank=4, alpha=8, rslora=True, train_norms=True)
#: the attention projections only: transformers' experts are fused 3-d tensors and its router no
#: nn.Linear, so PEFT's "all-linear" does not name the layers ours does in an MoE block
LORA_ATTENTION = dict(target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], rank=4, alpha=8, rslora=True)


@dataclasses.dataclass(frozen=True)
class FamilyCase:
    """How one family is checked: transformers config overrides, our load options, extra variants."""

    hf: dict[str, Any]
    load: dict[str, Any] = dataclasses.field(default_factory=dict)
    variants: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    #: LoRAConfig fields of the LoRA check: adapters on every linear layer and trained norms (rsLoRA)
    lora: dict[str, Any] = dataclasses.field(default_factory=lambda: dict(LORA_ALL_LINEAR))


FAMILIES: dict[str, FamilyCase] = {
    "llama": FamilyCase(hf={}, variants={  # GQA, untied head
        "tied": dict(tie_word_embeddings=True),
        "attention-mlp-bias": dict(attention_bias=True, mlp_bias=True),
        "rope-linear": dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
        "rope-llama3": dict(rope_parameters=LLAMA3_ROPE),
        "head-dim": dict(head_dim=24),
        "mha": dict(num_key_value_heads=4),
    }),
    # a sliding window (8) shorter than the rows and prompts + generated tokens
    "mistral": FamilyCase(hf=dict(sliding_window=8)),
    # q/k/v biases (Qwen2's own) and a tied head
    "qwen2": FamilyCase(hf=dict(tie_word_embeddings=True), variants={
        "sliding-window": dict(use_sliding_window=True, sliding_window=8, max_window_layers=0),
        "head-dim": dict(head_dim=24, num_key_value_heads=1),
    }),
    # q/k norms, head_dim 24 != hidden 64 / 4 heads, untied head
    "qwen3": FamilyCase(hf=dict(head_dim=24), variants={
        "tied-bias": dict(tie_word_embeddings=True, attention_bias=True, head_dim=32),
    }),
    # local, local, global layers, per-kind RoPE, soft-capped logits: GEMMA3_LOCAL_GLOBAL says what each checks
    "gemma3_text": FamilyCase(hf=GEMMA3_LOCAL_GLOBAL, variants={
        # explicit layer_types (global first), an untied head, no soft-capping, attention biases
        "untied": dict(layer_types=["full_attention", "sliding_attention"], sliding_window=6,
                       tie_word_embeddings=False, attention_bias=True, head_dim=32, query_pre_attn_scalar=16),
    }),
    # top-2 of 4 experts, renormalised, a window shorter than the rows, tied head; loaded on fsdp=2 x ep=4,
    # so every check also runs the expert-parallel dispatch (of batches too small to split over ep)
    "mixtral": FamilyCase(
        hf=dict(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.02,
                sliding_window=8, tie_word_embeddings=True),
        load=dict(sharding_axis_dims=(1, 2, 4, 1, 1)), lora=LORA_ATTENTION),
    # top-3 of 8 small experts, not renormalised, head_dim != hidden / heads, attention biases
    "qwen3_moe": FamilyCase(hf=dict(intermediate_size=96, moe_intermediate_size=16, num_experts=8,
                                    num_experts_per_tok=3, head_dim=24, norm_topk_prob=False, attention_bias=True,
                                    router_aux_loss_coef=0.05), lora=LORA_ATTENTION),
}


def causal_lm_types() -> list[str]:
    """Every registered model_type that has a causal-LM class (what ``AutoModelForCausalLM`` loads)."""
    types = []
    for model_type in registered_model_types():
        try:
            get_modules_by_type(model_type)
        except ConfigError:  # registered for another task only
            continue
        types.append(model_type)
    return types


def family_case(model_type: str) -> FamilyCase:
    """The table's entry for ``model_type``; a registered family without one fails, saying what to add."""
    if model_type not in FAMILIES:
        pytest.fail(f"model_type {model_type!r} is registered but has no tiny configuration in "
                    f"tests/conformance_testing.py: add FAMILIES[{model_type!r}] = FamilyCase(hf={{...}}) with the "
                    "transformers config keys that switch on what the family adds, so the conformance suite "
                    "checks it against transformers", pytrace=False)
    return FAMILIES[model_type]


def variant_ids() -> list[str]:
    """``model_type/variant`` for every extra variant in the table."""
    return [f"{t}/{v}" for t in causal_lm_types() if t in FAMILIES for v in FAMILIES[t].variants]


@dataclasses.dataclass
class Loaded:
    """A family under test: transformers' model, the HF folder it was saved to, ours loaded from it."""

    name: str
    ref: Any
    folder: str
    model: nnx.Module
    load: dict[str, Any]
    #: what tests compute once per family and share (a jitted forward)
    shared: dict[str, Any] = dataclasses.field(default_factory=dict)


def load_case(name: str, model_type: str, overrides: dict[str, Any], load: dict[str, Any],
              root: str | os.PathLike) -> Loaded:
    """transformers' random model of ``model_type`` saved under ``root``, and ours loaded from that folder."""
    ref = hf_model(model_type, seed=3, **overrides)
    folder = save_hf(ref, os.path.join(os.fspath(root), "hf"))
    model = AutoModelForCausalLM.from_pretrained(folder, **load)
    assert model.config.model_type == model_type
    return Loaded(name, ref, folder, model, load)


def token_ids(batch: int = 2, length: int = 40, seed: int = 0) -> np.ndarray:
    """Random ids [batch, length] (40: longer than every window in the table and llama3's original context)."""
    return np.random.RandomState(seed).randint(0, 128, (batch, length)).astype(np.int32)
