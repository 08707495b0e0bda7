"""The precision policy: bf16 parameters train with every optimizer, moments in float32.

bf16 is RayDistributedTrainer's default ``param_dtype``; the optimizer runs in float32
(``training.optim.in_float32``) and only ``params + update`` is rounded to bf16.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import scaletrain as st
from scaletrain.models import LlamaConfig, LlamaForCausalLM, create_sharded_model
from scaletrain.training.optim import in_float32


def _rows(n=64, vocab=128, seed=0):
    rng = np.random.default_rng(seed)
    return [{"input_ids": (rng.integers(0, vocab) + np.arange(16)) % vocab} for _ in range(n)]


@pytest.mark.parametrize("optimizer,lr,extra", [
    ("adamw", 1e-2, {}),
    ("lion", 3e-3, {}),
    ("adafactor", 0.1, {}),
    ("sgd", 0.3, {"gradient_accumulation_steps": 2, "break_on_nan": False}),
])
def test_bf16_parameters_train_with_every_optimizer(tmp_path, tiny_config_kwargs, optimizer, lr, extra):
    cfg = LlamaConfig(**tiny_config_kwargs, sharding_axis_dims=(1, 2, 1, 4, 1))
    model, _ = create_sharded_model(LlamaForCausalLM, cfg, seed=0, param_dtype="bfloat16", dtype="bfloat16")
    args = st.TrainingArguments(output_dir=str(tmp_path), total_batch_size=8, max_length=16, num_train_epochs=None,
                                max_training_steps=24, learning_rate=lr, warmup_steps=0, scheduler="constant",
                                optimizer=optimizer, param_dtype="bfloat16", dtype="bfloat16", log_steps=1,
                                do_eval=False, progress_bar=False, save_at_end=False, report_to=(), **extra)
    trainer = st.Trainer(args, model=model, dataset_train=_rows())
    out = trainer.train()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in lines if r["split"] == "train"]
    assert len(losses) == 24 and all(np.isfinite(losses))
    # a falling loss: the last quarter well below the first step (a counting pattern is learnable)
    assert np.mean(losses[-6:]) < 0.8 * losses[0], losses
    for leaf in jax.tree.leaves(out.state.params):
        assert leaf.dtype == jnp.bfloat16
    floats = [x for x in jax.tree.leaves(out.state.opt_state) if jnp.issubdtype(x.dtype, jnp.floating) and x.ndim]
    assert floats and all(x.dtype == jnp.float32 for x in floats)


def test_in_float32_is_the_inner_optimizer_for_float32_params():
    params = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4), "b": jnp.ones((4,))}
    grads = jax.tree.map(lambda p: 0.1 * p + 0.01, params)
    inner = optax.adamw(1e-2, weight_decay=0.1)
    a, b = inner.init(params), in_float32(inner).init(params)
    ua, _ = inner.update(grads, a, params)
    ub, _ = in_float32(inner).update(grads, b, params)
    for x, y in zip(jax.tree.leaves(ua), jax.tree.leaves(ub)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_bf16_update_is_computed_in_float32_and_rounded_once():
    """A small Adam step on bf16 weights equals the float32 step rounded to bf16."""
    p32 = {"w": jnp.linspace(0.5, 1.5, 16).reshape(4, 4)}
    g32 = {"w": jnp.linspace(-1e-3, 1e-3, 16).reshape(4, 4)}
    p16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), p32)
    tx = in_float32(optax.adam(1e-2))
    u16, s16 = tx.update(jax.tree.map(lambda x: x.astype(jnp.bfloat16), g32), tx.init(p16), p16)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(s16) if x.ndim)
    new16 = optax.apply_updates(p16, u16)
    ref = optax.apply_updates(jax.tree.map(lambda x: x.astype(jnp.float32), p16),
                              optax.adam(1e-2).update(jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), g32),
                                                      optax.adam(1e-2).init(p32), p32)[0])
    np.testing.assert_array_equal(np.asarray(new16["w"], np.float32),
                                  np.asarray(ref["w"].astype(jnp.bfloat16), np.float32))
