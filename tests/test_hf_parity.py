"""Hugging Face import/export beyond the per-family checks: RoPE scalings, sharded folders on 8 devices,
what the loader and exporter refuse, and a real pretrained model (SmolLM2) against transformers.

Logits parity, the round trip and generation for every family (and its variants) are in
test_families_conformance.py."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest

import scaletrain
from scaletrain.errors import CheckpointError, ConfigError
from scaletrain.models.kernels.attention import rope_inv_freq
from scaletrain.models.hf import save_hf_checkpoint
from scaletrain.models.registry import AutoModelForCausalLM
from hf_testing import (
    LLAMA3_ROPE,
    assert_logits_match,
    convert_smollm2,
    hf_logits,
    hf_model,
    our_logits,
    save_hf,
    smollm2_missing_reason,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _ids(batch: int = 2, length: int = 40, seed: int = 0) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, 128, (batch, length)).astype(np.int32)


@pytest.mark.parametrize("rope", ["linear", "llama3"])
def test_rope_inv_freq_matches_transformers(rope: str) -> None:
    """Realistic sizes so llama3's low, middle and high frequency bands are all present."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = (
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
        if rope == "linear"
        else {**LLAMA3_ROPE, "original_max_position_embeddings": 8192}
    )
    hf_config = transformers.LlamaConfig(
        hidden_size=4096, num_attention_heads=32, max_position_embeddings=131072, rope_parameters=params
    )
    expected, _ = ROPE_INIT_FUNCTIONS[rope](hf_config, "cpu")
    config = load_config_only(hf_config)
    ours = np.asarray(rope_inv_freq(config))
    np.testing.assert_allclose(ours, expected.numpy(), rtol=1e-6)
    if rope == "llama3":  # all three bands exercised: unscaled, divided by factor, and interpolated
        ratio = expected.numpy() / (1.0 / 500000.0 ** (np.arange(0, 128, 2) / 128))
        assert np.isclose(ratio, 1.0).any() and np.isclose(ratio, 1 / 8).any()
        assert ((ratio < 0.99) & (ratio > 0.13)).any()


def load_config_only(hf_config) -> scaletrain.LlamaConfig:
    from scaletrain.models.hf_config import config_from_hf

    return config_from_hf(hf_config.to_dict())


def test_sharded_checkpoint_loads_sharded_on_8_devices(tmp_path) -> None:
    ref_model = hf_model("llama", num_attention_heads=8, num_key_value_heads=4, hidden_size=64)
    src = save_hf(ref_model, tmp_path / "hf", max_shard_size="40KB")
    weight_files = set(json.load(open(os.path.join(src, "model.safetensors.index.json")))["weight_map"].values())
    assert len(weight_files) > 1
    model = scaletrain.AutoModelForCausalLM.from_pretrained(src, sharding_axis_dims=(1, 2, 1, 4, 1))
    mesh = jax.tree.leaves(model)[0].sharding.mesh
    assert dict(mesh.shape) == {"dp": 1, "fsdp": 2, "ep": 1, "tp": 4, "sp": 1}
    q = model.model.layers[0].self_attn.q_proj.kernel[...]
    assert q.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tp")
    assert {s.data.shape for s in q.addressable_shards} == {(32, 16)}  # [64, 64] over fsdp=2 x tp=4
    emb = model.model.embed_tokens[...]
    assert len({str(s.index) for s in emb.addressable_shards}) == 8
    ids = _ids()
    assert_logits_match("llama-sharded", our_logits(model, ids), hf_logits(ref_model, ids))

    # a sharded export, gathered one tensor at a time, is read back by transformers
    out = save_hf_checkpoint(model, tmp_path / "export", max_shard_size="30KB")
    assert len(set(json.load(open(os.path.join(out, "model.safetensors.index.json")))["weight_map"].values())) > 1
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    np.testing.assert_array_equal(hf_logits(back, ids), hf_logits(ref_model, ids))


def test_export_refuses_foreign_folder_and_replaces_own(tmp_path) -> None:
    ref_model = hf_model("llama")
    src = save_hf(ref_model, tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(src)
    before = {f: os.path.getsize(os.path.join(src, f)) for f in os.listdir(src)}
    with pytest.raises(ConfigError, match="not a previous scaletrain export"):
        model.save_pretrained(src)
    assert {f: os.path.getsize(os.path.join(src, f)) for f in os.listdir(src)} == before
    out = str(tmp_path / "export")
    model.save_pretrained(out, max_shard_size="30KB")
    model.save_pretrained(out)  # our own previous export is replaced, atomically
    assert "model.safetensors" in os.listdir(out) and "model.safetensors.index.json" not in os.listdir(out)
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".export")]  # no temporary folders left


def _write_config(path, **config) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return str(path)


def test_unsupported_model_type_names_it(tmp_path) -> None:
    src = _write_config(tmp_path / "m", model_type="gpt2", vocab_size=10)
    with pytest.raises(ConfigError, match="'gpt2'"):
        AutoModelForCausalLM.from_pretrained(src)


@pytest.mark.parametrize("rope_type", ["dynamic"])
def test_unsupported_rope_type_names_it(rope_type: str, tmp_path) -> None:
    src = _write_config(tmp_path / "m", model_type="llama", rope_scaling={"type": rope_type, "factor": 2.0})
    with pytest.raises(ConfigError, match=f"'{rope_type}'"):
        AutoModelForCausalLM.from_pretrained(src)


def test_unsupported_options_name_them(tmp_path) -> None:
    with pytest.raises(ConfigError, match="hidden_act 'gelu'"):
        AutoModelForCausalLM.from_pretrained(_write_config(tmp_path / "a", model_type="llama", hidden_act="gelu"))
    with pytest.raises(ConfigError, match="per-layer attention types"):
        AutoModelForCausalLM.from_pretrained(_write_config(
            tmp_path / "b", model_type="qwen2", num_hidden_layers=4, use_sliding_window=True, max_window_layers=2
        ))


def test_missing_files_name_the_path(tmp_path) -> None:
    with pytest.raises(ConfigError, match=str(tmp_path / "empty")):
        AutoModelForCausalLM.from_pretrained(tmp_path / "empty")
    os.makedirs(tmp_path / "empty")
    with pytest.raises(ConfigError, match="config.json"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "empty")
    src = _write_config(tmp_path / "noweights", model_type="llama", **{"num_hidden_layers": 1})
    with pytest.raises(ConfigError, match="model.safetensors"):
        AutoModelForCausalLM.from_pretrained(src)


def test_missing_tensor_is_a_checkpoint_error(tmp_path) -> None:
    from safetensors.numpy import load_file, save_file

    src = save_hf(hf_model("llama"), tmp_path / "hf")
    tensors = load_file(os.path.join(src, "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, os.path.join(src, "model.safetensors"))
    with pytest.raises(CheckpointError, match="model.layers.1.mlp.up_proj.weight"):
        AutoModelForCausalLM.from_pretrained(src)


def test_model_class_from_pretrained_checks_type(tmp_path) -> None:
    src = save_hf(hf_model("qwen2"), tmp_path / "hf")
    assert isinstance(scaletrain.Qwen2ForCausalLM.from_pretrained(src), scaletrain.Qwen2ForCausalLM)
    with pytest.raises(ConfigError, match="'qwen2'"):
        scaletrain.MistralForCausalLM.from_pretrained(src)


@pytest.mark.slow
def test_smollm2_matches_transformers() -> None:
    reason = smollm2_missing_reason()
    if reason:
        pytest.skip(reason)
    from scaletrain.generation import generate

    folder = convert_smollm2()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, return_dict=True
    )["input_ids"]
    ids = np.asarray([ids], np.int32)
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    model = scaletrain.AutoModelForCausalLM.from_pretrained(folder)
    assert model.config.tie_word_embeddings and model.config.num_key_value_heads == 3
    assert_logits_match("smollm2-135m", our_logits(model, ids), hf_logits(ref_model, ids))

    with jax.set_mesh(jax.tree.leaves(model)[0].sharding.mesh):
        ours = generate(model, ids, max_new_tokens=32)
    with torch.no_grad():
        theirs = ref_model.generate(
            torch.tensor(ids), attention_mask=torch.ones(ids.shape, dtype=torch.long),
            max_new_tokens=32, do_sample=False, eos_token_id=None,
        ).numpy()[:, ids.shape[1]:]
    np.testing.assert_array_equal(ours, theirs)
    assert "Paris" in tokenizer.decode(ours[0])
