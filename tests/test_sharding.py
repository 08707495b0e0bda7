"""One train step gives the same loss and parameters on every mesh as on one device."""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from scaletrain.arguments import TrainingArguments
from scaletrain.errors import ConfigError
from scaletrain.models import LlamaConfig, LlamaForCausalLM, create_sharded_model
from scaletrain.parallel import PartitionAxis, create_mesh, logical_to_spec, resolve_axis_dims
from scaletrain.training.optim import make_optimizer, make_schedule
from scaletrain.training.state import create_train_state, state_shardings
from scaletrain.objectives import LanguageModelObjective
from scaletrain.training.steps import make_step_functions


def _batch(rows=8, length=16, vocab=128, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (rows, length)).astype(np.int32)
    seg = np.ones((rows, length), np.int32)
    # ragged padding so that token weighting matters
    for r in range(rows):
        seg[r, length - (r % 5) :] = 0
    pos = np.where(seg > 0, np.arange(length)[None], 0).astype(np.int32)
    return {"input_ids": ids, "segment_ids": seg, "positions": pos}


# Where only the sharding is under test, the step is plain SGD with learning rate 1 and no
# clipping, so new parameters are ``p - g`` and the gradient can be read back from them
# (``p0 - p1``, exact up to one float32 rounding of p1). Adam's first step would turn a
# last-bit difference in a gradient element near ``epsilon`` into a change of up to
# ``2 * lr`` in that parameter: a flaky comparison, not a sharding bug.
PLAIN_SGD = {"optimizer": "sgd", "momentum": 0.0, "learning_rate": 1.0, "clip_grad": None, "scheduler": "constant"}


def _setup(kw, dims, devices=None, grad_accum=1, loss_chunk_size=None, **optim):
    cfg = LlamaConfig(**kw, sharding_axis_dims=dims)
    mesh = create_mesh(dims, devices=devices)
    model, mesh = create_sharded_model(LlamaForCausalLM, cfg, mesh=mesh, seed=3)
    optim = {"learning_rate": 1e-2, **optim}
    args = TrainingArguments(total_batch_size=8, gradient_accumulation_steps=grad_accum, max_length=16,
                             max_training_steps=10, warmup_steps=0, **optim)
    tx = make_optimizer(args, make_schedule(args, 10))
    state = create_train_state(model, tx, mesh)
    batch_sharding = NamedSharding(mesh, PartitionSpec(("dp", "fsdp"), "sp"))
    train, _ = make_step_functions(tx, state_shardings(state), batch_sharding,
                                   NamedSharding(mesh, PartitionSpec()),
                                   LanguageModelObjective(chunk_size=loss_chunk_size), grad_accum)
    return train, state, batch_sharding, mesh


def _one_step(kw, dims, devices=None, grad_accum=1, batch=None, steps=1, loss_chunk_size=None, **optim):
    train, state, batch_sharding, mesh = _setup(kw, dims, devices, grad_accum, loss_chunk_size, **optim)
    batch = batch if batch is not None else _batch()
    with jax.set_mesh(mesh):
        for _ in range(steps):
            state, metrics = train(state, jax.device_put(batch, batch_sharding))
    return state, jax.device_get(metrics)


def _initial_params(kw):
    model, _ = create_sharded_model(LlamaForCausalLM, LlamaConfig(**kw, sharding_axis_dims=(1, 1, 1, 1, 1)),
                                    mesh=create_mesh((1, 1, 1, 1, 1), devices=jax.devices()[:1]), seed=3)
    return jax.device_get(nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def assert_same_sgd_updates(p0, params, ref_params):
    """The summed SGD updates ``p0 - p`` agree tensor by tensor.

    Tolerance: float32 sums of the same terms in another order differ by up to about
    ``n * 2**-24`` of the summed magnitudes (n <= 256 tokens here: ~1.5e-5), and where
    terms cancel the summed magnitudes exceed the result: 3e-4 of the tensor's largest
    update allows a factor of 20 for that (the worst seen over the meshes of this file is
    4e-5). Reading the update back costs one float32 rounding of ``p``: 2**-24 * |p| per
    element, for each side. A wrong sharding (a missing or doubled reduction) moves
    updates by O(1) of their size, far outside this.
    """
    def check(path, a0, a, b):
        a0, a, b = (np.asarray(x, np.float64) for x in (a0, a, b))
        upd, ref = a0 - a, a0 - b
        tol = 3e-4 * np.abs(ref).max() + 2 * 2.0**-24 * np.maximum(np.abs(a), np.abs(b))
        worst = np.max(np.abs(upd - ref) - tol)
        assert worst <= 0, f"{jax.tree_util.keystr(path)}: updates differ by {np.abs(upd - ref).max():.3g}"

    jax.tree_util.tree_map_with_path(check, p0, jax.device_get(params), jax.device_get(ref_params))


@pytest.mark.parametrize("dims", [(1, 8, 1, 1, 1), (2, 2, 1, 2, 1), (1, 2, 1, 4, 1)])
def test_step_matches_single_device(tiny_config_kwargs, dims):
    ref_state, ref_metrics = _one_step(tiny_config_kwargs, (1, 1, 1, 1, 1), devices=jax.devices()[:1], **PLAIN_SGD)
    state, metrics = _one_step(tiny_config_kwargs, dims, **PLAIN_SGD)
    np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-5)
    np.testing.assert_allclose(metrics["grad_norm"], ref_metrics["grad_norm"], rtol=1e-4)
    assert_same_sgd_updates(_initial_params(tiny_config_kwargs), state.params, ref_state.params)


def test_shardings_survive_a_step(tiny_config_kwargs):
    dims = (1, 2, 1, 4, 1)
    cfg = LlamaConfig(**tiny_config_kwargs, sharding_axis_dims=dims)
    model, mesh = create_sharded_model(LlamaForCausalLM, cfg)
    q = model.model.layers[0].self_attn.q_proj.kernel[...]
    assert q.sharding.spec == PartitionSpec("fsdp", "tp")
    state, _ = _one_step(tiny_config_kwargs, dims)
    assert state.params["model"]["layers"][0]["self_attn"]["q_proj"]["kernel"].sharding.spec == PartitionSpec("fsdp", "tp")
    mu = state.opt_state[1][0].mu  # clip -> adamw(scale_by_adam)
    assert mu["model"]["layers"][0]["mlp"]["down_proj"]["kernel"].sharding.spec == PartitionSpec("tp", "fsdp")
    assert mu["model"]["embed_tokens"].sharding.spec == PartitionSpec("tp", "fsdp")


def test_gradient_accumulation_equals_big_batch(tiny_config_kwargs):
    dims = (1, 2, 1, 4, 1)
    big, m1 = _one_step(tiny_config_kwargs, dims, grad_accum=1, steps=2, **PLAIN_SGD)
    acc, m4 = _one_step(tiny_config_kwargs, dims, grad_accum=4, steps=2, **PLAIN_SGD)
    np.testing.assert_allclose(m4["loss"], m1["loss"], rtol=1e-5)
    np.testing.assert_allclose(m4["tokens"], m1["tokens"])
    assert_same_sgd_updates(_initial_params(tiny_config_kwargs), acc.params, big.params)


def test_mesh_dims_resolution():
    assert resolve_axis_dims((1, -1, 1, 1, 1), 8) == (1, 8, 1, 1, 1)
    assert resolve_axis_dims((2, -1, 1, 2, 1), 8) == (2, 2, 1, 2, 1)
    with pytest.raises(ConfigError, match="at most one"):
        resolve_axis_dims((-1, -1, 1, 1, 1), 8)
    with pytest.raises(ConfigError, match="divisible"):
        resolve_axis_dims((3, -1, 1, 1, 1), 8)
    with pytest.raises(ConfigError, match="16 devices"):
        resolve_axis_dims((2, 8, 1, 1, 1), 8)


def test_indivisible_dims_are_replicated():
    mesh = create_mesh((1, 2, 1, 4, 1))
    pa = PartitionAxis()
    assert logical_to_spec(("embed", "kv_heads"), (32, 6), pa, mesh) == PartitionSpec("fsdp", None)
    assert logical_to_spec(("vocab", "embed"), (128, 32), pa, mesh) == PartitionSpec("tp", "fsdp")
    assert logical_to_spec(("norm",), (32,), pa, mesh) == PartitionSpec(None)


@pytest.mark.parametrize("dims", [(1, 2, 1, 4, 1), (2, 4, 1, 1, 1), (1, 2, 1, 1, 4)])
def test_chunked_loss_step_matches(tiny_config_kwargs, dims):
    plain, m1 = _one_step(tiny_config_kwargs, dims, steps=2, **PLAIN_SGD)
    chunked, m2 = _one_step(tiny_config_kwargs, dims, steps=2, loss_chunk_size=4, **PLAIN_SGD)
    np.testing.assert_allclose(m2["loss"], m1["loss"], rtol=1e-5)
    assert_same_sgd_updates(_initial_params(tiny_config_kwargs), chunked.params, plain.params)


@pytest.mark.parametrize("dims", [(2, 4, 1, 1, 1), (1, 2, 1, 1, 4)])
def test_chunked_loss_loop_moves_no_tensors(tiny_config_kwargs, dims):
    """Batch or sequence sharded: the loop over loss chunks all-reduces only the scalar loss sums
    (no [hidden, vocab] head gradient, no chunk of logits); the head gradient is reduced after it."""
    import re

    train, state, batch_sharding, mesh = _setup(tiny_config_kwargs, dims, loss_chunk_size=2)
    with jax.set_mesh(mesh):
        hlo = train.lower(state, jax.device_put(_batch(), batch_sharding)).compile().as_text()
    h, v = tiny_config_kwargs["hidden_size"], tiny_config_kwargs["vocab_size"]
    head = re.compile(rf"f32\[({h},{v}|{v},{h})\]")
    bodies = set(re.findall(r"body=%?([\w.\-]+)", hlo))
    assert bodies, "the chunked loss should compile to a loop"
    computation, in_loop, head_outside = None, [], []
    for line in hlo.splitlines():
        if line and not line[0].isspace():
            computation = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
        result = re.split(r" (?:all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)(?:-start)?\(",
                          line)
        if len(result) == 1:
            continue
        shapes = re.findall(r"\w+\[([\d,]*)\]", result[0].split("=", 1)[1])
        if computation in bodies and any(shape for shape in shapes):  # anything but scalars
            in_loop.append(line.strip()[:120])
        elif computation not in bodies and head.search(result[0]):
            head_outside.append(line.strip()[:120])
    assert not in_loop
    assert head_outside  # reduced once, after the loop


def test_active_platform_follows_the_mesh():
    """Per-platform code paths follow the devices of the mesh being traced for (a GPU topology
    compiled on a CPU host traces the GPU graph: bench/aot.py), else the default backend."""
    from scaletrain.parallel.partition import active_platform

    assert active_platform() == jax.default_backend()
    with jax.set_mesh(create_mesh((1, 1, 1, 1, 1), devices=jax.devices()[:1])):
        assert active_platform() == "cpu"
