"""Qwen3.5-MoE and Qwen3-Next beyond their conformance rows (scaletrain/models/qwen3_5_moe, qwen3_next): the real
sizes built without allocating, the released vision-language folders, and bad input as one line.

Logits, left padding, packing, greedy generation, the export round trip and PEFT adapters against transformers are
test_families_conformance.py's rows; every family's loss falling is test_families_train.py's.
"""

from __future__ import annotations

import json
import logging
import math
import os

import jax
import numpy as np
import pytest
from flax import nnx

from scaletrain.errors import ConfigError
from scaletrain.models.hf_config import config_from_hf
from scaletrain.models.qwen3_5 import Qwen3_5ForCausalLM
from scaletrain.models.qwen3_5_moe import MOE_CONFORMANCE, Qwen3_5MoeForCausalLM
from scaletrain.models.registry import AutoModelForCausalLM
from hf_testing import TINY, assert_logits_match, hf_logits, our_logits, save_hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

#: what the Qwen3.5 text configs share (Qwen/Qwen3.5-35B-A3B's and Qwen/Qwen3.5-27B's config.json text_config:
#: 3 linear layers to 1 full, partial RoPE over a quarter of each 256-dim head, multimodal RoPE sections)
_QWEN3_5_TEXT = {
    "attention_bias": False, "attention_dropout": 0.0, "full_attention_interval": 4, "head_dim": 256,
    "hidden_act": "silu", "initializer_range": 0.02, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_num_key_heads": 16, "linear_value_head_dim": 128, "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "vocab_size": 248320, "eos_token_id": 248044,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                        "mrope_section": [11, 11, 10], "mrope_interleaved": True},
}
#: Qwen/Qwen3.5-35B-A3B's text_config: 40 layers, 256 experts of 512 (top 8) and a shared expert of 512
QWEN3_5_35B_A3B = {**_QWEN3_5_TEXT, "model_type": "qwen3_5_moe_text", "hidden_size": 2048, "num_hidden_layers": 40,
                   "num_attention_heads": 16, "num_key_value_heads": 2, "linear_num_value_heads": 32,
                   "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
                   "shared_expert_intermediate_size": 512, "router_aux_loss_coef": 0.001}
#: Qwen/Qwen3.5-27B's text_config: 64 layers, 24 query heads and 4 KV heads, 48 linear value heads, a dense MLP
QWEN3_5_27B = {**_QWEN3_5_TEXT, "model_type": "qwen3_5_text", "hidden_size": 5120, "num_hidden_layers": 64,
               "intermediate_size": 17408, "num_attention_heads": 24, "num_key_value_heads": 4,
               "linear_num_value_heads": 48}


def _abstract_count(model_class: type, config: object) -> int:
    """Parameters of ``model_class(config)`` counted from its shapes (``nnx.eval_shape``: nothing allocated)."""
    model = nnx.eval_shape(lambda: model_class(config, rngs=nnx.Rngs(0)))
    return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def test_qwen3_5_35b_a3b_and_27b_parameter_counts_equal_published() -> None:
    """The published text configs read as ours and built abstractly hold the model cards' sizes: Qwen3.5-35B-A3B
    "35B in total and 3B activated", Qwen3.5-27B "27B" (the cards count the language model; the vision tower
    and the multi-token-prediction layer are left out on load, as transformers' causal LM leaves them out).
    ``num_params`` counts the abstract model exactly, so throughput and MFU figures are the real model's."""
    moe = config_from_hf(dict(QWEN3_5_35B_A3B), "Qwen3.5-35B-A3B")
    total = _abstract_count(Qwen3_5MoeForCausalLM, moe)
    print(f"Qwen3.5-35B-A3B: {total:,} parameters, {moe.num_active_params:,} active")
    assert total == moe.num_params == 34_660_610_688
    assert round(total / 1e9) == 35 and round(moe.num_active_params / 1e9) == 3
    dense = config_from_hf(dict(QWEN3_5_27B), "Qwen3.5-27B")
    total = _abstract_count(Qwen3_5ForCausalLM, dense)
    print(f"Qwen3.5-27B: {total:,} parameters")
    assert total == dense.num_params == dense.num_active_params
    assert round(total / 1e9) == 27


def _vision_language_folder(root: str) -> tuple[object, str]:
    """A tiny Qwen3.5-MoE vision-language model built by transformers (the released checkpoints' layout), saved."""
    vision = dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=4,
                  temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)
    torch.manual_seed(0)
    config = transformers.Qwen3_5MoeConfig(text_config={**TINY, **MOE_CONFORMANCE}, vision_config=vision)
    vl = transformers.Qwen3_5MoeForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in vl.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    return vl, save_hf(vl, os.path.join(root, "vl"))


def test_qwen3_5_moe_vision_language_folder_loads_its_language_model(tmp_path, caplog) -> None:
    """A qwen3_5_moe folder (experts written per expert under model.language_model) loads as qwen3_5_moe_text with
    experts over ep: the text logits of transformers' vision-language model on text alone, and one log line
    naming the vision tower's tensors it left out."""
    vl, folder = _vision_language_folder(str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="scaletrain"):
        model = AutoModelForCausalLM.from_pretrained(folder, sharding_axis_dims=(1, 4, 2, 1, 1))
    assert model.config.model_type == "qwen3_5_moe_text"
    [line] = [r.getMessage() for r in caplog.records if "vision-language" in r.getMessage()]
    assert "model.visual" in line and "left out" in line and "\n" not in line
    ids = np.random.RandomState(1).randint(0, 128, (2, 24)).astype(np.int32)
    assert_logits_match("qwen3_5_moe-vision-language", our_logits(model, ids), hf_logits(vl, ids))


@pytest.mark.parametrize("model_type, keys, message", [
    ("qwen3_5_moe_text", dict(num_experts_per_tok=9), "num_experts_per_tok 9 must be between 1 and num_experts (8)"),
    ("qwen3_next", dict(mlp_only_layers=[5]), "mlp_only_layers [5] are not layers of the 2"),
    ("qwen3_next", dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
], ids=["top-k", "mlp-only-layers", "activation"])
def test_bad_config_json_is_one_line_naming_the_file_and_key(model_type, keys, message, tmp_path) -> None:
    """A config.json our model cannot compute: one line naming the file and the key, nothing built."""
    hf = transformers.AutoConfig.for_model(model_type, **{**TINY, **MOE_CONFORMANCE})
    raw = {**hf.to_dict(), **keys}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as refused:
        config_from_hf(json.loads(path.read_text()), str(path))
    text = str(refused.value)
    assert text.startswith(str(path)) and message in text and "\n" not in text, text
