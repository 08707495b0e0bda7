"""Mixtral and Qwen3-MoE: router losses, parameter and FLOP counts, expert parallelism, a recipe run.

transformers (torch CPU, float32) is the oracle: each family's reference model, in the
conformance suite's configuration (Mixtral on an ``ep`` mesh), serves the auxiliary-loss
and parameter-count checks; the train-step test runs the all-to-all dispatch on three
meshes against one device. Logits, generation, packing, scanned layers, the export round
trip and LoRA are checked for both families in test_families_conformance.py.
"""

from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from scaletrain.arguments import TrainingArguments
from scaletrain.errors import ConfigError
from scaletrain.models.factory import place_model
from scaletrain.models.hf_config import config_from_hf
from scaletrain.models.mixtral import MixtralConfig, MixtralForCausalLM
from scaletrain.objectives import LanguageModelObjective
from scaletrain.parallel import create_mesh
from scaletrain.training.optim import make_optimizer, make_schedule
from scaletrain.training.state import TrainState, create_train_state, state_shardings
from scaletrain.training.steps import make_step_functions, train_step
from conformance_testing import FAMILIES, load_case, token_ids
from hf_testing import TINY, assert_logits_match
from test_sharding import PLAIN_SGD, assert_same_sgd_updates

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = {k: v for k, v in TINY.items() if k != "intermediate_size"}


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def case(request, tmp_path_factory):
    """(family, transformers model, its saved folder, our model loaded from it) in the conformance suite's
    configuration (Mixtral on an ep mesh), built once per family."""
    entry = FAMILIES[request.param]
    loaded = load_case(request.param, request.param, entry.hf, entry.load, tmp_path_factory.mktemp(request.param))
    return request.param, loaded.ref, loaded.folder, loaded.model


def test_logits_and_losses_match_transformers(case) -> None:
    """Logits, the balancing loss and ``loss + router_aux_loss_coef * aux`` equal transformers' on a
    right-padded batch (the padding left out of the loss and of the router statistics)."""
    name, ref, _, model = case
    ids = token_ids(3, 40)
    mask = np.ones_like(ids)
    mask[1, 29:] = 0
    mask[2, 13:] = 0
    with torch.no_grad():
        out = ref(torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask),
                  labels=torch.tensor(np.where(mask == 1, ids, -100), dtype=torch.long), output_router_logits=True)
    graphdef, params = nnx.split(model)

    @jax.jit
    def ours(params, batch):
        logits = nnx.merge(graphdef, params)(batch["input_ids"], segment_ids=batch["segment_ids"])
        return logits, LanguageModelObjective().loss_and_sums(nnx.merge(graphdef, params), batch, {})

    with jax.set_mesh(jax.tree.leaves(params)[0].sharding.mesh):
        logits, (objective, sums) = ours(params, {"input_ids": ids, "segment_ids": mask})
    assert_logits_match(name, np.asarray(logits), out.logits.numpy(), mask)
    np.testing.assert_allclose(sums["aux_loss"] / sums["tokens"], out.aux_loss.item(), rtol=1e-5)
    np.testing.assert_allclose(objective / sums["tokens"], out.loss.item(), rtol=1e-5)
    # each real token is counted once per layer for each of its k experts
    cfg = model.config
    assert float(sums["expert_tokens"].sum()) == mask.sum() * cfg.num_hidden_layers * cfg.num_experts_per_tok


def test_parameter_count_and_active_flops(case) -> None:
    _, ref, _, model = case
    cfg = model.config
    assert cfg.num_params == sum(p.numel() for p in ref.parameters())
    # FLOPs follow the active experts only: E experts cost what k experts do, but for the router
    e, k, n, h = cfg.num_experts, cfg.num_experts_per_tok, cfg.num_hidden_layers, cfg.hidden_size
    key = "num_local_experts" if cfg.model_type == "mixtral" else "num_experts"
    only_active = cfg.model_copy(update={key: k})
    assert cfg.flops_per_token(64) - only_active.flops_per_token(64) == 6 * n * h * (e - k)


@pytest.mark.parametrize("key, value, raw", [
    ("router_jitter_noise", 0.1, {"model_type": "mixtral"}),
    ("decoder_sparse_step", 2, {"model_type": "qwen3_moe"}),
    ("mlp_only_layers", [0], {"model_type": "qwen3_moe"}),
    ("shared_expert_intermediate_size", 64, {"model_type": "qwen3_moe"}),
])
def test_unsupported_options_name_their_key(key, value, raw) -> None:
    with pytest.raises(ConfigError, match=key):
        config_from_hf({**raw, **BASE, key: value}, "moe/config.json")


# ---------------------------------------------------------------------------------
# expert parallelism: one train step on ep meshes equals one device
# ---------------------------------------------------------------------------------
STEP_MODEL = dict(vocab_size=128, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, num_local_experts=8, num_experts_per_tok=2,
                  router_aux_loss_coef=0.05, router_z_loss_coef=0.01)


def _step_batch() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 128, (8, 16)).astype(np.int32)
    seg = np.ones((8, 16), np.int32)
    for r in range(8):  # ragged padding: the router statistics must leave it out
        seg[r, 16 - (r % 5):] = 0
    return {"input_ids": ids, "segment_ids": seg}


def _train_one_step(initial, dims, devices=None):
    """One plain-SGD step of the model whose parameters are ``initial`` (host arrays), placed on the mesh ``dims``."""
    graphdef, params = initial
    mesh = create_mesh(dims, devices=devices)
    model, mesh = place_model(nnx.merge(graphdef, params), mesh)
    args = TrainingArguments(total_batch_size=8, max_length=16, max_training_steps=10, warmup_steps=0, **PLAIN_SGD)
    tx = make_optimizer(args, make_schedule(args, 10))
    state = create_train_state(model, tx, mesh)
    batch_sharding = NamedSharding(mesh, PartitionSpec(("dp", "fsdp"), "sp"))
    train, _ = make_step_functions(tx, state_shardings(state), batch_sharding, NamedSharding(mesh, PartitionSpec()),
                                   LanguageModelObjective(), guard_nonfinite=False)
    with jax.set_mesh(mesh):
        state, metrics = train(state, jax.device_put(_step_batch(), batch_sharding))
    return state, jax.device_get(metrics)


@pytest.fixture(scope="module")
def one_device_step():
    """The initial parameters and the one-device step. The parameters are drawn with numpy into the
    abstract model's shapes: an initialiser would be compiled (or run op by op) for seconds."""
    graphdef, shapes = nnx.split(nnx.eval_shape(lambda: MixtralForCausalLM(MixtralConfig(**STEP_MODEL),
                                                                           rngs=nnx.Rngs(3))))
    rng = np.random.default_rng(3)
    initial = (graphdef, jax.tree.map(lambda s: (0.2 * rng.standard_normal(s.shape)).astype(s.dtype), shapes))
    return initial, *_train_one_step(initial, (1, 1, 1, 1, 1), devices=jax.devices()[:1])


@pytest.mark.parametrize("dims", [(1, 4, 2, 1, 1), (1, 1, 4, 2, 1), (1, 1, 8, 1, 1)])
def test_ep_step_matches_one_device(one_device_step, dims) -> None:
    initial, ref_state, ref = one_device_step
    state, metrics = _train_one_step(initial, dims)
    experts = state.params["model"]["layers"][0]["block_sparse_moe"]["experts"]["w1"]
    assert experts.sharding.spec[0] == "ep"  # the experts are split, not replicated
    for key in ("loss", "moe/aux_loss", "moe/router_z_loss"):
        np.testing.assert_allclose(metrics[key], ref[key], rtol=1e-5, err_msg=key)
    counts = [metrics[f"moe/expert_{e}_tokens"] for e in range(8)]
    assert counts == [ref[f"moe/expert_{e}_tokens"] for e in range(8)]
    assert sum(counts) == _step_batch()["segment_ids"].sum() * 2  # each real token's top-2
    assert_same_sgd_updates(nnx.to_pure_dict(initial[1]), state.params, ref_state.params)


def test_expert_moments_are_split_like_their_experts(one_device_step) -> None:
    """Adam's moments of the expert kernels take the kernels' sharding (experts over ep, hidden over fsdp)."""
    graphdef, params = one_device_step[0]
    model, mesh = place_model(nnx.merge(graphdef, params), create_mesh((1, 4, 2, 1, 1)))
    args = TrainingArguments(total_batch_size=8, max_length=16, max_training_steps=10, warmup_steps=0)
    state = create_train_state(model, make_optimizer(args, make_schedule(args, 10)), mesh)
    kernel_spec = state.params["model"]["layers"][0]["block_sparse_moe"]["experts"]["w2"].sharding.spec
    assert kernel_spec == PartitionSpec("ep", None, "fsdp")  # [E, mlp, embed]
    moments = [leaf.sharding.spec for path, leaf in jax.tree_util.tree_flatten_with_path(state.opt_state)[0]
               if "experts" in jax.tree_util.keystr(path) and jax.tree_util.keystr(path).endswith("['w2']")]
    assert moments == [kernel_spec, kernel_spec]  # Adam's mu and nu


class _TraceCountingMixtral(MixtralForCausalLM):
    """Mixtral counting the traces of its forward (the real one, called through)."""

    traces = 0


def _counting(name: str):
    def forward(self, *args, **kwargs):
        type(self).traces += 1
        return getattr(super(_TraceCountingMixtral, self), name)(*args, **kwargs)

    return forward


# the forward the objectives read (objectives/model_outputs.py)
_FORWARD = "hidden_states_and_aux"
setattr(_TraceCountingMixtral, _FORWARD, _counting(_FORWARD))


def test_accumulating_step_traces_the_forward_once() -> None:
    """With gradient accumulation the sums' zeros are shaped from the parameters and the router
    statistics' known shapes, not from another trace of the forward: one trace per compile."""
    graphdef, params = nnx.split(nnx.eval_shape(lambda: _TraceCountingMixtral(MixtralConfig(**STEP_MODEL),
                                                                              rngs=nnx.Rngs(0))))
    tx = optax.sgd(0.1)
    state = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=params,
                       opt_state=jax.eval_shape(tx.init, params), rng=jax.ShapeDtypeStruct((2,), jnp.uint32),
                       graphdef=graphdef)
    batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in _step_batch().items()}
    _TraceCountingMixtral.traces = 0
    metrics = jax.eval_shape(functools.partial(train_step, tx=tx, objective=LanguageModelObjective(),
                                                gradient_accumulation_steps=2), state, batch)[1]
    assert _TraceCountingMixtral.traces == 1
    assert {f"moe/expert_{e}_tokens" for e in range(8)} <= set(metrics)  # the router sums are accumulated


def test_mixtral_recipe_trains_and_logs_routing(tmp_path) -> None:
    """examples/mixtral.yaml, shrunk, with remat and the chunked loss: the loss falls and metrics.jsonl
    counts each expert's tokens."""
    from scaletrain.recipe import Recipe
    from scaletrain.run import run_training

    out = tmp_path / "run"
    recipe = Recipe.load(os.path.join(ROOT, "examples", "mixtral.yaml"), [
        f"training.output_dir={out}", "training.max_training_steps=12", "training.log_steps=1",
        "training.total_batch_size=8", "training.max_length=64", "training.warmup_steps=2",
        "training.evaluation_steps=null", "training.progress_bar=false", "training.save_at_end=false",
        "data.max_documents=2",
        "data.eval_fraction=0.0", "model.num_hidden_layers=1", "model.hidden_size=64", "model.intermediate_size=64",
        "model.num_local_experts=4", "model.gradient_checkpointing=full", "training.loss_chunk_size=16",
        "sample.max_new_tokens=0", "mesh.axis_dims=[1,-1,2,1,1]",
    ])
    run_training(recipe)
    records = [json.loads(line) for line in open(out / "metrics.jsonl") if '"split": "train"' in line]
    assert len(records) == 12
    assert records[-1]["loss"] < records[0]["loss"] - 0.5  # 8.31 -> 7.41 when written
    for r in records:
        counts = [r[f"moe/expert_{e}_tokens"] for e in range(4)]
        # each real token (at least every target token, at most every slot) counts for its top-2 experts
        assert 2 * r["target_tokens"] <= sum(counts) <= 2 * 8 * 64
        assert r["moe/aux_loss"] > 0 and r["moe/max_expert_load"] >= 1.0
