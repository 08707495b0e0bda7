"""The objective seam: the step accumulates and normalises any objective, never differentiates its frozen
models, and evaluation reduces through it. Proved with a small objective of the test's own, normalised per
sequence and reading a frozen reference model, as preference and RL objectives will."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

import scaletrain as st
from scaletrain.errors import ConfigError, DataError
from scaletrain.models import LlamaConfig, LlamaForCausalLM, create_sharded_model
from scaletrain.objectives import LanguageModelObjective, Objective, ObjectiveBase
from scaletrain.objectives.loss import target_mask
from scaletrain.parallel import create_mesh
from scaletrain.training.state import FrozenModel, create_train_state, state_shardings
from scaletrain.training.steps import make_step_functions

LR = 0.1


def _sequence_logprob(model: Any, batch: dict) -> tuple[jax.Array, jax.Array]:
    """Each row's summed log-probability of its targets, and whether the row has any target."""
    ids = batch["input_ids"]
    mask = target_mask(ids, batch.get("segment_ids"), None)
    logp = jax.nn.log_softmax(model(ids, segment_ids=batch.get("segment_ids")).astype(jnp.float32))[:, :-1]
    picked = jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
    return jnp.sum(picked * mask, axis=-1), (jnp.sum(mask, axis=-1) > 0).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class SequenceGap(ObjectiveBase):
    """Per sequence: the squared gap between the policy's and the reference's summed log-probability (the
    members it does not use, such as ``batch_totals``, keep ``ObjectiveBase``'s defaults)."""

    name: ClassVar[str] = "sequence_gap"
    batch_keys: ClassVar[tuple[str, ...]] = ("input_ids",)
    frozen_models: ClassVar[tuple[str, ...]] = ("reference",)
    normaliser: ClassVar[str] = "sequences"

    def loss_and_sums(self, model, batch, frozen):
        policy, rows = _sequence_logprob(model, batch)
        reference, _ = _sequence_logprob(frozen["reference"], batch)
        gap = (policy - reference) * rows
        loss = jnp.sum(jnp.square(gap))
        return loss, {"loss": loss, "sequences": jnp.sum(rows), "gap": jnp.sum(gap)}

    def zero_sums(self, model):
        return {k: jnp.zeros((), jnp.float32) for k in ("loss", "sequences", "gap")}

    def step_metrics(self, sums, denom):
        return {"loss": sums["loss"] / denom, "gap/mean": sums["gap"] / denom}

    def eval_metrics(self, totals, bytes_per_token=None):
        n = max(float(totals["sequences"]), 1.0)
        return {"eval_loss": float(totals["loss"]) / n, "eval_sequences": float(totals["sequences"])}


def _config(kw):
    return LlamaConfig(**kw, sharding_axis_dims=(1, 1, 1, 1, 1))


def _state_with_reference(kw, tx):
    """A policy (seed 0) and, as its frozen reference, another model of the same config (seed 5)."""
    mesh = create_mesh((1, 1, 1, 1, 1), devices=jax.devices()[:1])
    model, mesh = create_sharded_model(LlamaForCausalLM, _config(kw), mesh=mesh, seed=0)
    reference, _ = create_sharded_model(LlamaForCausalLM, _config(kw), mesh=mesh, seed=5)
    graphdef, params = nnx.split(reference)
    state = create_train_state(model, tx, mesh)
    return state.replace(frozen_models={"reference": FrozenModel(params=params, graphdef=graphdef)}), mesh


def _batch():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 128, (8, 16)).astype(np.int32)
    segments = np.ones_like(ids)
    segments[2, 9:] = 0
    segments[5, :] = 0  # a padding row: no sequence, nothing to normalise by
    segments[6, 8:] = 2  # two sequences packed in one row count as one row here
    return {"input_ids": ids, "segment_ids": segments}


def _steps(state, mesh, tx, objective, accumulation):
    batch_sharding = NamedSharding(mesh, PartitionSpec())
    return make_step_functions(tx, state_shardings(state), batch_sharding, NamedSharding(mesh, PartitionSpec()),
                               objective, accumulation, guard_nonfinite=False), batch_sharding


def test_it_is_an_objective():
    assert isinstance(SequenceGap(), Objective) and isinstance(LanguageModelObjective(), Objective)


def test_accumulation_equals_one_batch_and_the_reference_is_not_differentiated(tiny_config_kwargs):
    tx = optax.sgd(LR)
    results = []
    for accumulation in (1, 4):
        state, mesh = _state_with_reference(tiny_config_kwargs, tx)
        before = jax.device_get((state.params, state.frozen_models))
        (train, evaluate), bs = _steps(state, mesh, tx, SequenceGap(), accumulation)
        with jax.set_mesh(mesh):
            batch = jax.device_put(_batch(), bs)
            sums = jax.device_get(evaluate(state, batch))
            new, metrics = train(state, batch)
        results.append((jax.device_get(new.params), jax.device_get(metrics), sums))
        # the reference went through the step unchanged, and the optimizer never saw it
        jax.tree.map(np.testing.assert_array_equal, jax.device_get(new.frozen_models), before[1])
    (one, m1, s1), (four, m4, s4) = results
    assert s1["sequences"] == s4["sequences"] == 7.0 and m1["loss"] > 0
    # float32 sums in another order; a gap is a difference of two log-probabilities near -40, so its
    # rounding is absolute (~1e-5), not relative to the gap
    for key in s1:
        np.testing.assert_allclose(s4[key], s1[key], rtol=1e-5, atol=1e-4)
    for key in ("loss", "gap/mean"):
        np.testing.assert_allclose(m4[key], m1[key], rtol=1e-5, atol=1e-4)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), four, one)

    # the update is the gradient of the per-sequence mean with the reference held constant
    policy_params, frozen = before
    graphdef = nnx.split(nnx.eval_shape(lambda: LlamaForCausalLM(_config(tiny_config_kwargs), rngs=nnx.Rngs(0))))[0]

    def mean_loss(params, reference):
        loss, sums = SequenceGap().loss_and_sums(nnx.merge(graphdef, params), _batch(),
                                                 {"reference": reference.model})
        return loss / sums["sequences"]

    grads = jax.jit(jax.grad(mean_loss))(policy_params, frozen["reference"])  # one program, not op by op
    want = jax.tree.map(lambda p, g: p - LR * g, policy_params, grads)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), one, want)


def test_missing_reference_or_batch_key_is_named(tiny_config_kwargs):
    tx = optax.sgd(LR)
    state, mesh = _state_with_reference(tiny_config_kwargs, tx)
    (train, _), bs = _steps(state.replace(frozen_models={}), mesh, tx, SequenceGap(), 1)
    with jax.set_mesh(mesh), pytest.raises(ConfigError, match="reads the frozen model 'reference'"):
        train(state.replace(frozen_models={}), jax.device_put(_batch(), bs))
    (train, _), bs = _steps(state, mesh, tx, LanguageModelObjective(), 1)
    with jax.set_mesh(mesh), pytest.raises(DataError, match="objective 'lm' needs the batch key 'input_ids'"):
        train(state, jax.device_put({"segment_ids": _batch()["segment_ids"]}, bs))


def test_the_trainer_trains_and_evaluates_through_the_objective(tmp_path, tiny_config_kwargs):
    """Trainer(objective=...) with a state that holds the reference: the steps, the logged metrics and the
    evaluation are the objective's (eval_sequences counts the 16 eval rows)."""
    rng = np.random.default_rng(0)
    rows = [{"input_ids": rng.integers(0, 128, rng.integers(8, 16))} for _ in range(48)]
    args = st.TrainingArguments(output_dir=str(tmp_path), total_batch_size=8, max_length=16, num_train_epochs=None,
                                max_training_steps=4, learning_rate=1e-3, warmup_steps=0, log_steps=2,
                                evaluation_steps=100, progress_bar=False, save_at_end=False)
    state, _ = _state_with_reference(tiny_config_kwargs, optax.sgd(LR))
    trainer = st.Trainer(args, model_state=state, dataset_train=rows[:32], dataset_eval=rows[32:],
                         objective=SequenceGap())
    trainer.train()
    results = trainer.evaluate()
    assert set(results) == {"eval_loss", "eval_sequences"} and results["eval_sequences"] == 16.0
    streamed = list(trainer.eval())
    assert streamed[-1]["eval_loss"] == pytest.approx(results["eval_loss"], rel=1e-6)
    train_records = [r for r in map(json.loads, open(tmp_path / "metrics.jsonl")) if r.get("split") == "train"]
    assert [r["step"] for r in train_records] == [2, 4]
    assert all("gap/mean" in r and "accuracy" not in r for r in train_records)


class _AuxContractLlama(LlamaForCausalLM):
    """A Llama whose ``hidden_states_and_aux`` counts its calls."""

    calls = 0

    def hidden_states_and_aux(self, input_ids, positions=None, segment_ids=None, attention_mask=None):
        type(self).calls += 1
        return super().hidden_states_and_aux(input_ids, positions, segment_ids, attention_mask)


def test_the_lm_objective_reads_the_models_hidden_states_and_aux(tiny_config_kwargs):
    """The LM objective reads the model through ``hidden_states_and_aux`` (objectives/model_outputs.py), once
    per forward, and its sums equal those of the decoder's own forward."""
    config = LlamaConfig(**{**tiny_config_kwargs, "num_hidden_layers": 1})
    batch = _batch()
    with_aux = _AuxContractLlama(config, rngs=nnx.Rngs(0))
    plain = nnx.merge(nnx.split(LlamaForCausalLM(config, rngs=nnx.Rngs(1)))[0], nnx.split(with_aux)[1])
    objective = LanguageModelObjective()
    sums = nnx.jit(lambda model: objective.loss_and_sums(model, batch, {}))
    _AuxContractLlama.calls = 0
    got = sums(with_aux)
    assert _AuxContractLlama.calls == 1
    jax.tree.map(np.testing.assert_array_equal, got, sums(plain))
    assert set(objective.zero_sums(with_aux)) == {"loss", "z_loss", "correct", "tokens"}
