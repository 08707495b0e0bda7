"""GPT-OSS beyond its conformance row (scaletrain/models/gpt_oss/__init__.py): YaRN against transformers' own
frequencies, the real sizes counted without allocating, MXFP4 folders in and plain folders out, the kernels
that cannot add sinks refused in one line, bad config.json keys named, and a tiny recipe whose loss falls.

The MXFP4 folder is built here in the exact block format (random 4-bit codes and exponents, the
layout transformers' quantizer writes), so nothing is downloaded; transformers itself, which
dequantises such a folder on CPU, is the oracle for what it holds.
"""

from __future__ import annotations

import json
import math
import os
import re

import jax
import numpy as np
import pytest
from flax import nnx

from scaletrain.errors import CheckpointError, ConfigError
from scaletrain.models.common.mxfp4 import BLOCK, dequantize
from scaletrain.models.gpt_oss import GptOssConfig, GptOssForCausalLM
from scaletrain.models.hf_config import config_from_hf
from scaletrain.models.kernels.attention import rope_attention_factor, rope_inv_freq
from scaletrain.models.registry import AutoModelForCausalLM
from hf_testing import assert_logits_match, hf_logits, hf_model, our_logits, save_hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: openai/gpt-oss-20b's config.json as published (the 120b differs in the two keys PUBLISHED_120B sets)
PUBLISHED_20B = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
    "attention_dropout": 0.0, "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64,
    "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
    "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072, "num_attention_heads": 64, "num_experts_per_tok": 4,
    "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False,
    "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "use_cache": True, "vocab_size": 201088,
}
PUBLISHED_120B = {**PUBLISHED_20B, "num_hidden_layers": 36, "num_local_experts": 128,
                  "layer_types": ["sliding_attention", "full_attention"] * 18}

#: the MXFP4 folder's model: four layers as the conformance row, experts 32 wide (whole MXFP4 blocks of inputs)
TINY_MXFP4 = dict(num_hidden_layers=2, sliding_window=8, num_local_experts=4, num_experts_per_tok=2,
                  intermediate_size=32, head_dim=16)


def _yarn(**rope: float) -> dict:
    return {"rope_type": "yarn", "rope_theta": 150000.0, **rope}


@pytest.mark.parametrize("rope", [
    _yarn(factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False, original_max_position_embeddings=4096),
    _yarn(factor=4.0, original_max_position_embeddings=32),  # truncated ramp ends, transformers' default
    _yarn(factor=40.0, mscale=1.0, mscale_all_dim=1.0, beta_fast=32, beta_slow=1,
          original_max_position_embeddings=4096),  # DeepSeek-V3's mscale pair (factor 1.0 overall)
    _yarn(factor=8.0, attention_factor=0.7, original_max_position_embeddings=64),
], ids=["gpt-oss", "truncated", "mscale", "explicit-factor"])
def test_yarn_frequencies_and_attention_factor_equal_transformers(rope) -> None:
    """Our YaRN inverse frequencies and attention factor are transformers' own (``ROPE_INIT_FUNCTIONS['yarn']``),
    for each of its options."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = transformers.GptOssConfig(head_dim=64, hidden_size=2880, num_attention_heads=64,
                                   max_position_embeddings=131072, rope_parameters=dict(rope))
    want_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    ours = config_from_hf({**hf.to_dict(), "model_type": "gpt_oss", "quantization_config": None})
    np.testing.assert_allclose(np.asarray(rope_inv_freq(ours)), want_freq.numpy(), rtol=1e-6)
    assert rope_attention_factor(ours) == pytest.approx(want_factor, rel=1e-12)


@pytest.mark.parametrize("published, total, active", [
    (PUBLISHED_20B, 20.91e9, 3.61e9), (PUBLISHED_120B, 116.83e9, 5.13e9)], ids=["gpt-oss-20b", "gpt-oss-120b"])
def test_gpt_oss_20b_and_120b_parameter_counts_equal_published(published, total, active) -> None:
    """The published config.json (MXFP4 quantization_config included) read as ours, its model built abstractly
    (``nnx.eval_shape``: nothing allocated): as many parameters as the model card's totals (to its two
    decimals, in billions), which ``num_params`` counts exactly, and its active parameters per token (the
    card counts the unembedding, not the embedding table)."""
    config = config_from_hf(dict(published))
    abstract = nnx.eval_shape(lambda: GptOssForCausalLM(config, rngs=nnx.Rngs(0)))
    count = sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    assert count == config.num_params
    assert round(count / 1e7) == round(total / 1e7), count
    embedding = config.vocab_size * config.hidden_size
    assert round((config.num_active_params - embedding) / 1e7) == round(active / 1e7), config.num_active_params
    print(f"{published['num_hidden_layers']} layers: {count:,} parameters, "
          f"{config.num_active_params - embedding:,} active without the embedding table")


def _tiny(**overrides: object) -> GptOssConfig:
    return GptOssConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                        num_experts_per_tok=2, sliding_window=4, **overrides)


@pytest.mark.parametrize("mechanism", ["pallas", "cudnn"])
def test_attention_sinks_refuse_the_kernels_without_them_in_one_line(mechanism) -> None:
    """The flash kernel and cuDNN add no sink to the softmax: asking for them is one line naming the key
    and what to use (``auto`` picks the einsum path, which has them)."""
    model = GptOssForCausalLM(_tiny(attn_mechanism=mechanism), rngs=nnx.Rngs(0))
    with pytest.raises(ConfigError, match=rf"^model.attn_mechanism: '{mechanism}' does not compute attention "
                                          r"sinks \(gpt_oss\); use 'auto'$"):
        model(np.zeros((1, 8), np.int32))


def test_sink_router_and_expert_gradients_equal_transformers(tmp_path) -> None:
    """The backward through the sinks' softmax term, the router's top-k softmax and the clamped, biased experts
    (both clamps bending: ``swiglu_limit`` 0.5) is torch autograd's on transformers' model: float32 gradients
    within 1e-4 of each tensor's largest."""
    ref = hf_model("gpt_oss", seed=5, **{**TINY_MXFP4, "swiglu_limit": 0.5})
    model = AutoModelForCausalLM.from_pretrained(save_hf(ref, str(tmp_path / "hf")))
    rng = np.random.RandomState(0)
    ids = rng.randint(0, 128, (2, 20)).astype(np.int32)
    weights = rng.randn(2, 20, 128).astype(np.float32)
    (ref(torch.tensor(ids)).logits * torch.tensor(weights)).sum().backward()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    # one jitted program, not op by op: each eager op of the layers would be compiled on its own
    with jax.set_mesh(jax.tree.leaves(params)[0].sharding.mesh):
        grads = jax.jit(jax.grad(lambda p: (nnx.merge(graphdef, p, rest)(ids) * weights).sum()))(params)
    ours = nnx.to_pure_dict(grads)["model"]["layers"]
    for layer in range(2):
        theirs = ref.model.layers[layer]
        pairs = {
            "sinks": (ours[layer]["self_attn"]["sinks"], theirs.self_attn.sinks.grad),
            "router": (ours[layer]["mlp"]["router"]["kernel"], theirs.mlp.router.weight.grad.T),
            "router bias": (ours[layer]["mlp"]["router"]["bias"], theirs.mlp.router.bias.grad),
            **{name: (ours[layer]["mlp"]["experts"][name], getattr(theirs.mlp.experts, name).grad)
               for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")},
        }
        for name, (got, want) in pairs.items():
            want = want.numpy()
            diff = float(np.abs(np.asarray(got) - want).max() / np.abs(want).max())
            print(f"layer {layer} {name}: gradient max rel diff {diff:.1e}")
            assert diff < 1e-4, (layer, name, diff)


def _write_config(folder, **config) -> str:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"model_type": "gpt_oss", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 32,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "num_local_experts": 4,
                   **config}, f)
    return str(folder)


@pytest.mark.parametrize("config, message", [
    (dict(num_hidden_layers=2, layer_types=["sliding_attention", "chunked_attention"]),
     "layer_types[1] 'chunked_attention' is not a layer type gpt_oss builds; use one of full_attention, "
     "sliding_attention"),
    (dict(quantization_config={"quant_method": "fp8"}),
     "quantization_config with quant_method 'fp8' is not supported (gpt_oss reads ['mxfp4'])"),
], ids=["layer-type", "quantization"])
def test_bad_config_json_is_one_line_naming_the_file_and_key(config, message, tmp_path) -> None:
    folder = _write_config(tmp_path / "m", **config)
    with pytest.raises(ConfigError) as err:
        AutoModelForCausalLM.from_pretrained(folder)
    assert str(err.value).startswith(os.path.join(folder, "config.json")) and message in str(err.value)
    assert "\n" not in str(err.value)


def _mxfp4_folder(root, seed: int = 0, bad: str | None = None) -> str:
    """transformers' random tiny GPT-OSS saved, its experts rewritten as random MXFP4 blocks and exponents (the
    exact on-disk layout: [E, out, in / 32, 16] codes, [E, out, in / 32] biased exponents) and the
    quantization_config of the released folders. ``bad`` names a tensor written one block short."""
    from safetensors.numpy import load_file, save_file

    folder = save_hf(hf_model("gpt_oss", seed=3, **TINY_MXFP4), os.path.join(root, "hf"))
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    rng = np.random.RandomState(seed)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, inputs, outputs = tensors.pop(name).shape
        groups = inputs // BLOCK - (name == bad)
        tensors[f"{name}_blocks"] = rng.randint(0, 256, (experts, outputs, groups, BLOCK // 2)).astype(np.uint8)
        tensors[f"{name}_scales"] = rng.randint(122, 126, (experts, outputs, groups)).astype(np.uint8)
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    config = json.load(open(os.path.join(folder, "config.json")))
    config["quantization_config"] = PUBLISHED_20B["quantization_config"]
    json.dump(config, open(os.path.join(folder, "config.json"), "w"))
    return folder


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory) -> tuple[str, object]:
    """The MXFP4 folder and transformers' model loaded from it (dequantised by transformers, float32)."""
    folder = _mxfp4_folder(str(tmp_path_factory.mktemp("mxfp4")))
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, ref


def test_mxfp4_blocks_dequantise_as_transformers_does(mxfp4) -> None:
    """Our decoding of every code and exponent equals transformers' ``convert_moe_packed_tensors``, bit for bit."""
    from safetensors.numpy import load_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    tensors = load_file(os.path.join(mxfp4[0], "model.safetensors"))
    blocks, scales = tensors["model.layers.0.mlp.experts.gate_up_proj_blocks"], \
        tensors["model.layers.0.mlp.experts.gate_up_proj_scales"]
    theirs = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    np.testing.assert_array_equal(dequantize(blocks, scales).transpose(0, 2, 1), theirs.numpy())
    assert len(np.unique(blocks & 0x0F)) == 16  # every code occurs


@pytest.mark.parametrize("scan_layers", [False, True], ids=["unrolled", "scanned"])
def test_mxfp4_folder_loads_per_device_slice_with_transformers_logits(mxfp4, scan_layers) -> None:
    """The folder loads on fsdp=2 x ep=4 (each device decoding only its experts' blocks), unrolled or stacked,
    with transformers' logits from the same folder."""
    folder, ref = mxfp4
    model = AutoModelForCausalLM.from_pretrained(folder, sharding_axis_dims=(1, 2, 4, 1, 1), scan_layers=scan_layers)
    ids = np.random.RandomState(0).randint(0, 128, (2, 24)).astype(np.int32)
    assert_logits_match(f"mxfp4-{'scanned' if scan_layers else 'unrolled'}", our_logits(model, ids),
                        hf_logits(ref, ids))
    if not scan_layers:
        kernel = model.model.layers[0].mlp.experts.gate_up_proj[...]
        assert {shard.data.shape[0] for shard in kernel.addressable_shards} == {1}  # one expert per ep device


def test_mxfp4_export_is_an_unquantised_folder_transformers_loads(mxfp4, tmp_path) -> None:
    """The export holds the dequantised experts as ordinary float32 tensors and no quantization_config:
    transformers loads it as a plain GPT-OSS with the very tensors and logits of the MXFP4 folder."""
    folder, ref = mxfp4
    out = AutoModelForCausalLM.from_pretrained(folder).save_pretrained(str(tmp_path / "export"))
    assert "quantization_config" not in json.load(open(os.path.join(out, "config.json")))
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    want = ref.state_dict()
    for name, tensor in back.state_dict().items():
        np.testing.assert_array_equal(tensor.numpy(), want[name].numpy(), err_msg=name)
    ids = np.random.RandomState(1).randint(0, 128, (1, 16)).astype(np.int32)
    np.testing.assert_array_equal(hf_logits(back, ids), hf_logits(ref, ids))


def test_mxfp4_block_of_the_wrong_shape_names_the_file_and_tensor(tmp_path) -> None:
    folder = _mxfp4_folder(str(tmp_path), bad="model.layers.1.mlp.experts.down_proj")
    with pytest.raises(CheckpointError) as err:
        AutoModelForCausalLM.from_pretrained(folder)
    message = str(err.value)
    assert message.startswith(os.path.join(folder, "model.safetensors") + ": tensor "
                              "model.layers.1.mlp.experts.down_proj_blocks: shape [4, 64, 0, 16]"), message
    assert "\n" not in message


def test_gpt_oss_recipe_trains_and_loss_falls(tmp_path) -> None:
    """examples/gpt_oss.yaml, shrunk, on an fsdp x ep mesh: the loss falls, routing is logged, and the
    checkpoint exports to a folder transformers loads as GPT-OSS."""
    from scaletrain.export import export_checkpoint
    from scaletrain.recipe import Recipe
    from scaletrain.run import run_training

    out = tmp_path / "run"
    recipe = Recipe.load(os.path.join(ROOT, "examples", "gpt_oss.yaml"), [
        f"training.output_dir={out}", "training.max_training_steps=10", "training.log_steps=1",
        "training.total_batch_size=8", "training.max_length=64", "training.warmup_steps=2",
        "training.evaluation_steps=null", "training.progress_bar=false", "data.max_documents=2",
        "data.eval_fraction=0.0", "model.num_hidden_layers=2", "model.hidden_size=64", "model.intermediate_size=64",
        "model.sliding_window=16", "sample.max_new_tokens=0", "mesh.axis_dims=[1,-1,2,1,1]",
    ])
    run_training(recipe)
    records = [json.loads(line) for line in open(out / "metrics.jsonl") if '"split": "train"' in line]
    assert len(records) == 10
    assert records[-1]["loss"] < records[0]["loss"] - 0.5, [r["loss"] for r in records]
    assert all(r["moe/aux_loss"] > 0 for r in records)
    back = transformers.AutoModelForCausalLM.from_pretrained(export_checkpoint(str(out), str(tmp_path / "hf")))
    assert type(back).__name__ == "GptOssForCausalLM"
    assert re.fullmatch(r"sliding_attention,full_attention", ",".join(back.config.layer_types))
