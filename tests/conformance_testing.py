"""The conformance suite's table: one tiny configuration per registered family, keyed by model_type.

Every causal-LM ``model_type`` in :mod:`scaletrain.models.registry` is checked by
``test_families_conformance.py`` against transformers' own implementation; the
configuration it is checked with lives beside the family (``register(..., conformance=
FamilyConformance(...))`` in its package) and is read here. A family registered without one
fails every check with a message saying what to add, so registering a family is what puts it
under the suite, and adding a family touches nothing outside its folder.

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
from scaletrain.models.common.family import CONFORMANCE, FamilyConformance
from scaletrain.models.registry import AutoModelForCausalLM, get_modules_by_type, registered_model_types
from hf_testing import hf_model, save_hf

#: every linear layer but the head, norms trained too, rsLoRA scaling: what PEFT must reproduce
LORA_ALL_LINEAR = dict(target_modules="all-linear", rank=4, alpha=8, rslora=True, train_norms=True)
#: the attention projections only: transformers' experts are fused 3-d tensors and its router no
#: nn.Linear, so PEFT's "all-linear" does not name the layers ours does in an MoE block; multi-head latent
#: attention's projections (DeepSeek-V3) are named too
LORA_ATTENTION = dict(target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj",
                                      "kv_a_proj_with_mqa", "kv_b_proj"], rank=4, alpha=8, rslora=True)


@dataclasses.dataclass(frozen=True)
class FamilyCase:
    """How one family is checked: transformers config overrides, our load options, extra variants, LoRA fields."""

    hf: dict[str, Any]
    load: dict[str, Any] = dataclasses.field(default_factory=dict)
    variants: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    #: LoRAConfig fields of the LoRA check
    lora: dict[str, Any] = dataclasses.field(default_factory=lambda: dict(LORA_ALL_LINEAR))
    #: False: the family refuses scan_layers (its layer kinds are not one stack)
    scan_layers: bool = True


def _case(row: FamilyConformance) -> FamilyCase:
    lora = {"all-linear": LORA_ALL_LINEAR, "attention": LORA_ATTENTION}[row.lora]
    return FamilyCase(hf=dict(row.hf), load=dict(row.load), variants=dict(row.variants), lora=dict(lora),
                      scan_layers=row.scan_layers)


#: model_type -> its case, from the conformance row each family registers beside itself
FAMILIES: dict[str, FamilyCase] = {model_type: _case(row) for model_type, row in CONFORMANCE.items()}


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
        pytest.fail(f"model_type {model_type!r} is registered but has no tiny configuration: in its family "
                    "package pass conformance=FamilyConformance(hf={...}) to register(...), with the transformers "
                    "config keys that switch on what the family adds, so the conformance suite checks it against "
                    "transformers", pytrace=False)
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
