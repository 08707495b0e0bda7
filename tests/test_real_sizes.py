"""Real sizes without a GPU: the published config.json of a released model, read as ours and built abstractly
(``nnx.eval_shape``: no array allocated), has the published parameter count.

The configs are written here from the published config.json values (no download); the counts are the
model cards' (in billions, to the card's digits), and :attr:`num_params` must count the abstract model
exactly, so throughput and MFU figures that use it are right for the real model. GPT-OSS's sizes are in
test_gpt_oss.py.
"""

from __future__ import annotations

import math

import jax
import pytest
from flax import nnx

from scaletrain.models import get_modules_by_type
from scaletrain.models.hf_config import config_from_hf

#: HuggingFaceTB/SmolLM3-3B config.json (every fourth layer NoPE, all layers full attention, tied head)
SMOLLM3_3B = {
    "architectures": ["SmolLM3ForCausalLM"], "model_type": "smollm3", "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": None, "eos_token_id": 128012, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 11008,
    "layer_types": ["full_attention"] * 36, "max_position_embeddings": 65536, "max_window_layers": 28,
    "mlp_bias": False, "no_rope_layer_interval": 4, "no_rope_layers": [int((i + 1) % 4 != 0) for i in range(36)],
    "num_attention_heads": 16, "num_hidden_layers": 36, "num_key_value_heads": 4, "pad_token_id": 128004,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 5000000.0, "sliding_window": None,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 128256,
}

#: allenai/Olmo-3-1025-7B config.json: three sliding layers (window 4096) to one full, untied head, MHA, YaRN on
#: the full layers (``rope_scaling``, which transformers gives the full layers only; RoPE has no parameters)
OLMO3_7B = {
    "architectures": ["Olmo3ForCausalLM"], "model_type": "olmo3", "attention_bias": False, "attention_dropout": 0.0,
    "eos_token_id": 100257, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 11008, "layer_types": (["sliding_attention"] * 3 + ["full_attention"]) * 8,
    "max_position_embeddings": 65536, "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 32, "pad_token_id": 100277, "rms_norm_eps": 1e-06, "rope_theta": 500000,
    "rope_scaling": {"attention_factor": 1.2079441541679836, "beta_fast": 32, "beta_slow": 1, "factor": 8.0,
                     "original_max_position_embeddings": 8192, "rope_type": "yarn"},
    "sliding_window": 4096, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 100278,
}


@pytest.mark.parametrize("published, billions", [(SMOLLM3_3B, 3.08), (OLMO3_7B, 7.30)],
                         ids=["SmolLM3-3B", "OLMo-3-7B"])
def test_real_config_parameter_count_equals_published(published, billions) -> None:
    config = config_from_hf(dict(published))
    model_class = get_modules_by_type(published["model_type"])[1]
    abstract = nnx.eval_shape(lambda: model_class(config, rngs=nnx.Rngs(0)))
    count = sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    print(f"{published['model_type']}: {count:,} parameters")
    assert count == config.num_params
    assert round(count / 1e9, 2) == billions, count
