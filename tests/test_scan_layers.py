"""``model.scan_layers``: the decoder layers stored as one stack and run by ``lax.scan``
(models/common/scanned_layers.py) compute what the unrolled layers compute, from the same values,
and compile one layer body whatever the depth. Every family's stack against transformers (its
tensors in and out, logits, greedy tokens) is in test_families_conformance.py."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import scaletrain as st
from scaletrain.errors import CheckpointError
from scaletrain.models import factory
from scaletrain.models.llama.config import LlamaConfig
from scaletrain.models.registry import get_modules_by_type
from scaletrain.objectives import LanguageModelObjective
from flash_testing import assert_same_loss_and_grads
from hf_testing import unstacked

SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
MOE = dict(num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2)


def _model(family: str, scan: bool, dims: tuple[int, ...] = (1, 4, 1, 2, 1), **extra):
    config_class, module_class = get_modules_by_type(family)
    config = config_class(**{**SMALL, **extra}, sharding_axis_dims=dims, scan_layers=scan)
    return factory.create_sharded_model(module_class, config, seed=3)


def _packed_batch(length: int, rows: int = 8) -> dict:
    """Rows of two documents (5/12 and 3/8 of the row) and trailing padding."""
    first, second = 5 * length // 12, 3 * length // 8
    pad = length - first - second
    rs = np.random.RandomState(0)
    ids = rs.randint(1, 96, (rows, length)).astype(np.int32)
    segments = np.repeat(np.array([[1] * first + [2] * second + [0] * pad]), rows, axis=0).astype(np.int32)
    positions = np.concatenate([np.arange(first), np.arange(second), np.zeros(pad, int)])[None].repeat(rows, 0)
    return {"input_ids": ids, "segment_ids": segments, "positions": positions.astype(np.int32)}


def _lm_loss(graphdef, params, batch):
    """The language-model objective's summed loss: what the train step differentiates."""
    return LanguageModelObjective().loss_and_sums(nnx.merge(graphdef, params), batch, {})[0]


def _loss_and_grads(model: nnx.Module, mesh, batch: dict) -> tuple[float, dict]:
    graphdef, params = nnx.split(model, nnx.Param)
    grad = jax.jit(jax.value_and_grad(lambda p, b: _lm_loss(graphdef, p, b)))
    with jax.set_mesh(mesh):
        loss, grads = grad(params, batch)
    return float(loss), unstacked(nnx.to_pure_dict(grads))


@pytest.mark.parametrize("family,extra,remat,dims", [
    ("llama", {}, "dots", (1, 4, 1, 2, 1)),
    ("mixtral", MOE, "none", (1, 2, 4, 1, 1)),  # experts over ep: the all-to-all inside the scanned body
    # context parallelism: the flash kernel in shard_map, zigzag rows, inside the scanned body
    ("llama", dict(attn_mechanism="pallas", num_hidden_layers=2), "dots_and_attention", (1, 2, 1, 1, 4)),
    # local, global, local: each stacked layer picks its kind's window and RoPE by a lax.cond inside the remat
    ("gemma3_text", dict(sliding_window=5, sliding_window_pattern=2), "dots", (1, 4, 1, 2, 1)),
])
def test_stack_holds_the_unrolled_values_and_gives_their_loss_and_gradients(family, extra, remat, dims):
    """Bit-identical parameters (layer i from fold_in(key, i) either way), on fsdp x tp, ep or sp; loss
    and gradients of packed rows equal to float32 rounding (the scan changes only XLA's fusion of the
    same arithmetic), MoE router statistics included in the loss."""
    stacked, mesh = _model(family, True, dims, gradient_checkpointing=remat, **extra)
    unrolled, _ = _model(family, False, dims, gradient_checkpointing=remat, **extra)
    got, want = unstacked(nnx.to_pure_dict(nnx.state(stacked))), nnx.to_pure_dict(nnx.state(unrolled))
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
    q = nnx.to_pure_dict(nnx.state(stacked))["model"]["layers"]["stack"]["self_attn"]["q_proj"]["kernel"]
    # the layer axis comes first and is never split over devices
    assert q.shape[0] == stacked.config.num_hidden_layers and q.sharding.spec[0] is None
    # sp: whole 16-token tiles in each zigzag chunk; one row per device of the batch axes (the
    # interpreted kernel is slow)
    batch = _packed_batch(24, 8) if dims[4] == 1 else _packed_batch(32 * dims[4], dims[0] * dims[1])
    assert_same_loss_and_grads(_loss_and_grads(stacked, mesh, batch), _loss_and_grads(unrolled, mesh, batch))


def _dots_in_step(layers: int, scan: bool) -> int:
    config = LlamaConfig(**{**SMALL, "num_hidden_layers": layers}, scan_layers=scan, sharding_axis_dims=(1, 1, 1, 1, 1))
    graphdef, params = factory.abstract_sharded_model(st.LlamaForCausalLM, config,
                                                      mesh=factory.mesh_for_config(config, jax.devices()[:1]))
    batch = {"input_ids": jax.ShapeDtypeStruct((2, 16), jnp.int32)}
    text = jax.jit(jax.grad(lambda p, b: _lm_loss(graphdef, p, b))).lower(params, batch).as_text()
    return text.count("stablehlo.dot_general")


def test_the_step_holds_one_layer_body_whatever_the_depth():
    """The unrolled forward and backward grow by a layer's matmuls per layer; the scanned one does not."""
    assert _dots_in_step(2, True) == _dots_in_step(6, True)
    assert _dots_in_step(6, False) > _dots_in_step(2, False)


def _train(tmp_path, scan: bool, resume: bool = False) -> list[dict]:
    config = LlamaConfig(**SMALL, scan_layers=scan, gradient_checkpointing="dots")
    rs = np.random.RandomState(0)
    data = [{"input_ids": rs.randint(1, 96, 16).tolist()} for _ in range(64)]
    args = st.TrainingArguments(output_dir=str(tmp_path), total_batch_size=8, max_length=16, max_training_steps=4,
                                num_train_epochs=None, learning_rate=3e-3, weight_decay=0.1, log_steps=1,
                                log_grad_norms=True, save_steps=2, resume_if_possible=resume, seed=0)
    model, _ = factory.create_sharded_model(st.LlamaForCausalLM, config, seed=0)
    st.Trainer(args, model=model, dataset_train=data).train()
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def stacked_run(tmp_path_factory) -> tuple[str, list[dict]]:
    """A run folder trained with the stack (checkpoints at steps 2 and 4) and its metrics."""
    folder = tmp_path_factory.mktemp("stacked_run")
    return str(folder), _train(folder, True)


def test_training_with_the_stack_follows_the_unrolled_run(stacked_run, tmp_path):
    """Four AdamW steps with weight decay (the norms' stacks are not decayed: the rank rule discounts
    the layer axis) give the unrolled run's losses and per-layer gradient norms."""
    got, want = stacked_run[1], _train(tmp_path, False)
    train = [(g, w) for g, w in zip(got, want) if "loss" in w and "grad_norm/layer_0" in w]
    assert len(train) == 4
    for g, w in train:
        for key in ("loss", "grad_norm", "grad_norm/layer_0", "grad_norm/layer_2"):
            # the same float32 arithmetic fused differently: measured at most 7e-8 (one ulp) over the 4 steps
            np.testing.assert_allclose(g[key], w[key], rtol=1e-6, err_msg=key)


def test_a_checkpoint_restores_only_into_its_own_layout(stacked_run):
    """Resuming a stacked run unrolled is one CheckpointError naming the saved layout; nothing saved changes."""
    folder = Path(stacked_run[0])
    before = {p: p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file()}
    with pytest.raises(CheckpointError, match="scan_layers=True"):
        _train(folder, False, resume=True)
    after = {p: p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file() and p.name != ".scaletrain.lock"}
    assert after == {p: t for p, t in before.items() if p.name != ".scaletrain.lock"}


@pytest.mark.parametrize("transpose", [False, True])
def test_a_device_reads_only_its_block_of_a_layers_by_experts_stack(transpose):
    """``read_stacked_block`` over two stacked axes (layers x experts, row-major tensors) gives the block of
    the whole stacked array, for a block that cuts every axis, reading only that block from each tensor."""
    from scaletrain.models.hf_experts import read_stacked_block

    rs = np.random.RandomState(0)
    whole = rs.randn(3, 4, 6, 10).astype(np.float32)  # [layers, experts, in, out]
    tensors = [whole[l, e].T if transpose else whole[l, e] for l in range(3) for e in range(4)]
    index = (slice(1, 3), slice(2, 4), slice(0, 3), slice(5, 10))
    got = read_stacked_block(tensors, index, whole.shape, transpose, lead=2)
    np.testing.assert_array_equal(got, whole[index])
    np.testing.assert_array_equal(read_stacked_block(tensors, (), whole.shape, transpose, lead=2), whole)
