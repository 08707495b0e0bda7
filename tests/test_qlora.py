"""QLoRA: int8 / NF4 block quantisation within its stated error, and a quantised base that trains."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import scaletrain as st
from scaletrain.models import LlamaConfig, LlamaForCausalLM, create_sharded_model
from scaletrain.peft.lora import LoRAConfig, LoRADense, QuantizedWeight, apply_lora, dense_layers
from scaletrain.peft.quantize import NF4_LEVELS, dequantize, max_abs_error, quantize


@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_dequantised_weights_are_within_the_stated_error(kind):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((256, 48)).astype(np.float32) * 0.02
    w[:64, 0] = 0.0  # an all-zero block dequantises to exact zeros
    w[64, 1] = 0.5  # an outlier: its block's error grows with its absmax, the others' does not
    codes, absmax = quantize(jnp.asarray(w), kind=kind, block_size=64)
    assert absmax.shape == (4, 48)
    assert codes.dtype == (jnp.int8 if kind == "int8" else jnp.uint8)
    assert codes.shape == ((256, 48) if kind == "int8" else (128, 48))
    back = np.asarray(dequantize(codes, absmax, kind, jnp.float32))
    bound = np.repeat(np.asarray(max_abs_error(absmax, kind)), 64, axis=0)
    # the bound is half a level gap times absmax; 1e-7 absorbs float32 rounding of the product
    assert np.all(np.abs(back - w) <= bound + 1e-7)
    assert np.all(back[:64, 0] == 0.0)
    # each block's largest value is a level exactly (±1 times absmax)
    np.testing.assert_allclose(np.abs(back).reshape(4, 64, 48).max(axis=1), np.asarray(absmax), rtol=1e-6)
    if kind == "nf4":
        assert set(np.unique(np.asarray(codes) & 0x0F)) <= set(range(len(NF4_LEVELS)))


def _data(n=16):
    rng = np.random.default_rng(0)
    return [{"input_ids": rng.integers(0, 128, 12)} for _ in range(n)]


def test_qlora_base_is_codes_only_and_trains(tmp_path):
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model, _ = create_sharded_model(LlamaForCausalLM, cfg, seed=0)
    kernels = {path: np.asarray(layer.kernel[...]) for path, _, _, layer in dense_layers(model)}
    lora = LoRAConfig(quantize="nf4", block_size=32, target_modules=["q_proj", "v_proj"])
    args = st.TrainingArguments(output_dir=str(tmp_path), total_batch_size=8, max_length=12, num_train_epochs=None,
                                max_training_steps=2, learning_rate=1e-2, log_steps=1, progress_bar=False,
                                do_eval=False, save_at_end=False, report_to=(), lora=lora)
    trainer = st.Trainer(args, model=model, dataset_train=_data())
    layers = {path: layer for path, _, _, layer in dense_layers(trainer.model)}
    for path, layer in layers.items():
        if path == "lm_head":  # the output layer stays as it was
            assert not isinstance(layer, LoRADense)
            continue
        assert layer.kernel is None and layer.quant == "nf4"
        bound = np.repeat(np.asarray(max_abs_error(layer.kernel_absmax[...], "nf4")), 32, axis=0)
        assert np.all(np.abs(np.asarray(layer.base_kernel()) - kernels[path]) <= bound + 1e-7)
    frozen = trainer.model_state.frozen
    quantised = [x for x in jax.tree.leaves(nnx.state(trainer.model, QuantizedWeight))]
    assert quantised and all(x.dtype in (jnp.uint8, jnp.float32) for x in quantised)
    # no float copy of a quantised kernel is kept anywhere in the state
    assert not any(str(p[-1].key) == "kernel" and str(p[-2].key) != "lm_head"
                   for p, _ in jax.tree_util.tree_flatten_with_path(frozen)[0])
    state = trainer.train().state
    assert trainer.summary["final_step"] == 2
    assert np.isfinite(trainer.last_train_metrics["loss"])
    assert any(np.any(np.asarray(x) != 0) for p, x in jax.tree_util.tree_flatten_with_path(state.params)[0]
               if str(p[-1].key) == "lora_b")
