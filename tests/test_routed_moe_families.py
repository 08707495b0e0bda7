"""DeepSeek-V3 and GLM-4.5: what the conformance suite does not check for them.

The real configurations' parameter counts (built abstractly, nothing allocated), options that
cannot route refused in one line naming the file and key, and each family's tiny recipe training
on the bundled corpus with its loss falling and each expert's load logged. Logits, generation,
packing, the export round trip and LoRA against transformers are in test_families_conformance.py;
the routing and shared-expert blocks alone in test_shared_moe.py.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest
from flax import nnx

from scaletrain.errors import ConfigError
from scaletrain.models.deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM
from scaletrain.models.glm4_moe import Glm4MoeConfig, Glm4MoeForCausalLM
from scaletrain.models.registry import AutoModelForCausalLM

#: deepseek-ai/DeepSeek-V3's config.json (the MoE and attention keys; its YaRN RoPE does not change the count)
DEEPSEEK_V3_671B = dict(
    vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
    num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256,
    routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
    qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8, first_k_dense_replace=3,
    norm_topk_prob=True, tie_word_embeddings=False)
#: zai-org/GLM-4.5-Air's config.json (transformers' keys: attention_bias is our qkv_bias, use_qk_norm our qk_norm)
GLM_45_AIR = dict(
    vocab_size=151552, hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=46,
    num_attention_heads=96, num_key_value_heads=8, head_dim=128, n_shared_experts=1, n_routed_experts=128,
    num_experts_per_tok=8, first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=1.0,
    norm_topk_prob=True, partial_rotary_factor=0.5, qkv_bias=True, qk_norm=False, tie_word_embeddings=False)


def _abstract_count(model_class: type, config: object) -> int:
    model = nnx.eval_shape(lambda: model_class(config, rngs=nnx.Rngs(0)))
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def test_real_sizes_parameter_counts_equal_published() -> None:
    """The abstract models of the published configs hold what their model cards say, counted from the shapes:
    DeepSeek-V3 671B with 37B active (its report counts the embeddings: 37.55B), GLM-4.5-Air 106B with 12B
    active (its card counts the active weights without the input embedding table: 12.80B). The multi-token
    prediction layers the checkpoints add are outside both counts, as transformers leaves them out."""
    deepseek = DeepseekV3Config(**DEEPSEEK_V3_671B)
    total = _abstract_count(DeepseekV3ForCausalLM, deepseek)
    assert total == deepseek.num_params == 671_026_419_200
    assert deepseek.num_active_params // 10**9 == 37
    glm = Glm4MoeConfig(**GLM_45_AIR)
    total = _abstract_count(Glm4MoeForCausalLM, glm)
    assert total == glm.num_params and total // 10**9 == 106
    assert (glm.num_active_params - glm.vocab_size * glm.hidden_size) // 10**9 == 12


@pytest.mark.parametrize("keys, message", [
    (dict(n_routed_experts=6, n_group=4), "n_routed_experts 6 is not divisible by n_group 4"),
    (dict(n_group=2, topk_group=3), "topk_group 3 must be between 1 and n_group (2)"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
], ids=["groups", "topk-group", "activation"])
def test_routing_that_cannot_route_is_one_line_naming_the_file_and_key(keys, message, tmp_path) -> None:
    folder = tmp_path / "m"
    os.makedirs(folder)
    config = dict(model_type="deepseek_v3", vocab_size=64, hidden_size=16, intermediate_size=32,
                  moe_intermediate_size=8, num_hidden_layers=2, num_attention_heads=2, n_routed_experts=8,
                  num_experts_per_tok=2, kv_lora_rank=8, q_lora_rank=None, qk_rope_head_dim=4, qk_nope_head_dim=4,
                  v_head_dim=4)
    config.update(keys)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as err:
        AutoModelForCausalLM.from_pretrained(str(folder))
    assert str(err.value).startswith(f"{folder / 'config.json'}: ") and message in str(err.value)
    assert "\n" not in str(err.value)


_MODELS = {
    # MLA with values narrower than keys, a dense first layer, 8 experts in 2 groups; experts over ep=2
    "deepseek_v3": dict(kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8),
    # half of each head rotated, q/k/v biases and q/k norms
    "glm4_moe": dict(head_dim=16, partial_rotary_factor=0.5, qkv_bias=True, qk_norm=True),
}


@pytest.mark.parametrize("model_type", ["deepseek_v3"])
def test_tiny_recipe_trains_loss_falls_and_logs_expert_load(model_type, tmp_path) -> None:
    """A 2-layer model of the family (the first layer dense) trains from a recipe on the bundled corpus with
    experts over ``ep``: the loss falls and metrics.jsonl counts each expert's tokens (the load DeepSeek
    balances). GLM-4.5 shares the block but for its attention; every family's loss falls on its conformance
    configuration in test_families_train.py."""
    from scaletrain.recipe import Recipe
    from scaletrain.run import run_training

    out = tmp_path / "run"
    model = dict(type=model_type, vocab_size=4096, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True, moe_intermediate_size=32,
                 n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                 first_k_dense_replace=1, **_MODELS[model_type])
    recipe = Recipe.from_dict(dict(
        model=model, data=dict(source="bundled:shakespeare", max_documents=2, eval_fraction=0.0),
        tokenizer=dict(path="bundled"), mesh=dict(axis_dims=[1, -1, 2, 1, 1]), sample=dict(max_new_tokens=0),
        training=dict(output_dir=str(out), total_batch_size=8, max_length=64, num_train_epochs=None,
                      max_training_steps=10, learning_rate=3e-3, warmup_steps=2, log_steps=1, evaluation_steps=None,
                      progress_bar=False, save_at_end=False)))
    run_training(recipe)
    records = [json.loads(line) for line in open(out / "metrics.jsonl") if '"split": "train"' in line]
    assert len(records) == 10
    assert np.mean([r["loss"] for r in records[-2:]]) < np.mean([r["loss"] for r in records[:2]]) - 0.3, records
    for r in records:
        counts = [r[f"moe/expert_{e}_tokens"] for e in range(8)]
        # one MoE layer: each real token counts for its top-2 experts
        assert 2 * r["target_tokens"] <= sum(counts) <= 2 * 8 * 64


def test_multi_token_prediction_layers_in_a_folder_are_left_out(tmp_path, caplog) -> None:
    """A released folder carries its multi-token-prediction layer as ``model.layers.<num_hidden_layers>.*``
    (``num_nextn_predict_layers: 1``): the model loads without it, as transformers does, says so, and gives
    transformers' logits; a tensor of any other unused layer is still refused."""
    from safetensors.numpy import load_file, save_file

    from scaletrain.errors import CheckpointError
    from conformance_testing import token_ids
    from hf_testing import assert_logits_match, hf_logits, hf_model, our_logits, save_hf

    small = dict(num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, n_group=2,
                 topk_group=1, moe_intermediate_size=16, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
                 qk_nope_head_dim=8, v_head_dim=8, num_key_value_heads=4, num_nextn_predict_layers=1)
    ref = hf_model("deepseek_v3", **small)
    folder = save_hf(ref, tmp_path / "hf")
    weights = os.path.join(folder, "model.safetensors")
    tensors = load_file(weights)
    tensors["model.layers.2.eh_proj.weight"] = np.zeros((16, 128), np.float32)  # the MTP layer's own projection
    save_file(tensors, weights, metadata={"format": "pt"})
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert "tensors of layers scaletrain does not compute are left out" in caplog.text
    ids = token_ids(2, 12)
    assert_logits_match("deepseek_v3-mtp-left-out", our_logits(model, ids), hf_logits(ref, ids))
    tensors["model.layers.3.eh_proj.weight"] = tensors.pop("model.layers.2.eh_proj.weight")
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="does not use: .*model.layers.3.eh_proj.weight"):
        AutoModelForCausalLM.from_pretrained(folder)
