"""Preference objectives through the step: exact accumulation, the LoRA adapters-off reference, KTO's formula,
precomputed reference log-probabilities, and configuration errors that name their field."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

import scaletrain as st
from preference_testing import first_train_record, fixed_rows, host, one_device_mesh, pair_row, stack_rows, tiny_llama
from scaletrain.errors import ConfigError
from scaletrain.objectives import Objective
from scaletrain.objectives.dpo import DPOObjective
from scaletrain.objectives.kto import KTOObjective
from scaletrain.objectives.logps import row_logps
from scaletrain.objectives.orpo import CPOObjective
from scaletrain.peft.lora import LoRAParam, apply_lora
from scaletrain.peft.lora_config import LoRAConfig
from scaletrain.training.state import FrozenModel, create_train_state, state_shardings
from scaletrain.training.steps import make_step_functions, objective_fn

L = 12


def _pairs(n: int = 8, seed: int = 0) -> list[dict]:
    """Ragged pairs (prompt 2..4 tokens, completions 1..6), the last row empty (a padded eval row)."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        p = list(rng.integers(3, 120, rng.integers(2, 5)))
        sides = []
        for _ in range(2):
            c = list(rng.integers(3, 120, rng.integers(1, 7)))
            sides.append((p + c, [0] * len(p) + [1] * len(c)))
        rows.append(pair_row(*sides, L))
    for key in rows[-1]:
        rows[-1][key] = np.zeros_like(rows[-1][key])
    return rows


def _frozen(model) -> FrozenModel:
    graphdef, params = nnx.split(model)
    return FrozenModel(params=jax.tree.map(jnp.copy, nnx.to_pure_dict(params)), graphdef=graphdef)


def _run_steps(state, mesh, objective, batch, accumulation):
    tx = optax.sgd(0.5)
    train, evaluate = make_step_functions(tx, state_shardings(state), NamedSharding(mesh, PartitionSpec()),
                                          NamedSharding(mesh, PartitionSpec()), objective, accumulation,
                                          guard_nonfinite=False)
    with jax.set_mesh(mesh):
        sums = host(evaluate(state, batch))
        new, metrics = train(state, batch)
    return host(new.params), host(metrics), sums


@pytest.mark.parametrize("objective", [DPOObjective(loss_type=("sigmoid", "ipo"), loss_weights=(0.5, 2.0)),
                                       CPOObjective(loss_type="simpo", cpo_alpha=0.7)],
                         ids=["dpo-weighted", "simpo-with-nll"])
def test_two_micro_batches_equal_one_batch(objective):
    """Sums over micro-batches divided once: the update and every figure equal the whole batch's (SimPO's NLL is a
    mean over the batch's tokens beside a mean over pairs: its micro-batches read the batch's token count)."""
    assert isinstance(objective, Objective)
    mesh = one_device_mesh()
    batch = stack_rows(_pairs())
    results = []
    for accumulation in (1, 2):
        state = create_train_state(tiny_llama(seed=0, mesh=mesh, layers=1), optax.sgd(0.5), mesh)
        if objective.frozen_models:
            state = state.replace(frozen_models={"reference": _frozen(tiny_llama(seed=3, mesh=mesh, layers=1))})
        results.append(_run_steps(state, mesh, objective, batch, accumulation))
    (p1, m1, s1), (p2, m2, s2) = results
    assert m1["loss"] > 0 and float(s1[objective.normaliser]) == 7.0  # the empty row counts for nothing
    # float32 sums over 7 rows in another order: ~1e-6 relative; the parameters moved by 0.5 x gradient
    for key in m1:
        np.testing.assert_allclose(m2[key], m1[key], rtol=2e-5, atol=1e-6, err_msg=key)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), p2, p1)


def test_lora_adapters_off_reference_equals_a_frozen_copy_of_the_base():
    """The adapters-off reference is the base: gradients and figures equal those read from an explicit copy."""
    mesh = one_device_mesh()
    base = tiny_llama(seed=0, mesh=mesh, layers=1)
    copy = _frozen(base)
    model = apply_lora(base, LoRAConfig(rank=4, alpha=8.0))
    graphdef, lora, rest = nnx.split(model, LoRAParam, ...)  # adapters moved off zero: the policy is not the base
    lora = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(1), x.shape, x.dtype), lora)
    model = nnx.merge(graphdef, lora, rest)
    state = create_train_state(model, optax.sgd(0.1), mesh)
    batch = jax.tree.map(jnp.asarray, stack_rows(_pairs()))
    with jax.set_mesh(mesh):
        with_copy = state.replace(frozen_models={"reference": copy})
        off = jax.jit(lambda st_, b: jax.grad(objective_fn(st_, DPOObjective(reference_source="adapters_off")),
                                              has_aux=True)(st_.params, b))(state, batch)
        explicit = jax.jit(lambda st_, b: jax.grad(objective_fn(st_, DPOObjective()), has_aux=True)(st_.params, b))(
            with_copy, batch)
    (g_off, s_off), (g_copy, s_copy) = host(off), host(explicit)
    assert abs(float(s_off["rewards_margins"])) > 1e-4  # the policy differs from its reference
    # the same function of the same numbers, compiled as two programs: equal to float32 rounding
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), g_off, g_copy)
    for key in s_off:
        np.testing.assert_allclose(s_off[key], s_copy[key], rtol=1e-5, atol=1e-6, err_msg=key)


def test_lora_dpo_trainer_holds_no_second_copy(tmp_path):
    args = st.DPOConfig(output_dir=str(tmp_path), total_batch_size=8, max_length=L, max_training_steps=1,
                        lora=LoRAConfig(rank=4), progress_bar=False, report_to=())
    trainer = st.DPOTrainer(model=tiny_llama(seed=0, layers=1), args=args, train_dataset=fixed_rows(_pairs()))
    assert trainer.objective.reference_source == "adapters_off"
    assert trainer.model_state.frozen_models == {}  # the base in state.frozen is the reference
    trainer.release_run_lock()


def test_kto_follows_its_formula():
    """KTO's loss and figures from the policy's and reference's row log-probabilities, computed here in numpy."""
    mesh = one_device_mesh()
    policy, reference = tiny_llama(seed=0, mesh=mesh, layers=1), tiny_llama(seed=4, mesh=mesh, layers=1)
    pairs = stack_rows(_pairs(seed=2))
    rows = {"input_ids": pairs["chosen_input_ids"], "segment_ids": pairs["chosen_segment_ids"],
            "loss_mask": pairs["chosen_loss_mask"], "label": np.array([1, 0, 0, 1, 1, 0, 1, 0], np.int32),
            "kl_input_ids": pairs["rejected_input_ids"], "kl_segment_ids": pairs["rejected_segment_ids"],
            "kl_loss_mask": pairs["rejected_loss_mask"]}
    beta, wd, wu = 0.5, 1.5, 0.7
    objective = KTOObjective(beta=beta, desirable_weight=wd, undesirable_weight=wu)
    with jax.set_mesh(mesh):
        sums = jax.jit(lambda p, r, b: objective.loss_and_sums(p, b, {"reference": r})[1])(policy, reference, rows)
        logp = {}
        for name, m in (("pi", policy), ("ref", reference)):
            for pre in ("", "kl_"):
                cols = (jnp.asarray(rows[f"{pre}{k}"]) for k in ("input_ids", "segment_ids", "loss_mask"))
                logp[f"{name}{pre}"] = np.asarray(jax.jit(row_logps)(m, *cols))
    real = np.arange(8) < 7
    kl = max(np.mean((logp["pikl_"] - logp["refkl_"])[real]), 0.0)
    ratio = logp["pi"] - logp["ref"]
    good, bad = real & (rows["label"] == 1), real & (rows["label"] == 0)
    per_row = np.where(good, wd * (1 - 1 / (1 + np.exp(-beta * (ratio - kl)))),
                       wu * (1 - 1 / (1 + np.exp(-beta * (kl - ratio)))))
    metrics = host(objective.step_metrics(sums, jnp.maximum(sums["rows"], 1.0)))
    # float32 in both computations of the same sums: ~1e-6 relative
    np.testing.assert_allclose(metrics["loss"], per_row[real].mean(), rtol=1e-5)
    np.testing.assert_allclose(metrics["kl"], kl, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(metrics["rewards/chosen"], beta * ratio[good].mean(), rtol=1e-5)
    np.testing.assert_allclose(metrics["rewards/rejected"], beta * ratio[bad].mean(), rtol=1e-5)
    np.testing.assert_allclose(metrics["logps/chosen"], logp["pi"][good].mean(), rtol=1e-5)


def _dpo_run(out, reference, precompute):
    args = st.DPOConfig(output_dir=str(out), total_batch_size=8, max_length=L, learning_rate=0.0,
                        max_training_steps=1, log_steps=1, progress_bar=False, report_to=(),
                        shuffle_train_dataset=False, precompute_ref_log_probs=precompute, save_at_end=False)
    trainer = st.DPOTrainer(model=tiny_llama(seed=0, layers=1), ref_model=reference, args=args,
                            train_dataset=fixed_rows(_pairs()), eval_dataset=fixed_rows(_pairs(6, seed=5)))
    trainer.train()
    return trainer, first_train_record(str(out))


def test_precomputed_reference_log_probs_equal_the_live_reference_and_are_reused(tmp_path, caplog):
    live_trainer, live = _dpo_run(tmp_path / "live", tiny_llama(seed=9, layers=1), False)
    trainer, pre = _dpo_run(tmp_path / "pre", tiny_llama(seed=9, layers=1), True)
    assert trainer.objective.reference_source == "precomputed" and trainer.model_state.frozen_models == {}
    assert live_trainer.summary["reference"]["reference"] == "ref_model (given)"  # recorded with its digest
    assert live_trainer.summary["reference"]["reference_sha256"] == trainer.summary["reference"]["reference_sha256"]
    for key in ("loss", "rewards/chosen", "rewards/margins", "logps/rejected"):
        np.testing.assert_allclose(pre[key], live[key], rtol=1e-5, atol=1e-7, err_msg=key)
    # evaluation reports TRL's figures with TRL's eval_ prefix; its six rows fill a batch of 8 with two empty rows
    evals = [trainer.last_eval[1], live_trainer.last_eval[1]]
    assert {"eval_loss", "eval_rewards/accuracies", "eval_logps/chosen", "eval_logits/rejected"} <= set(evals[0])
    for key in evals[1]:
        np.testing.assert_allclose(evals[0][key], evals[1][key], rtol=1e-5, atol=1e-7, err_msg=key)
    stored = tmp_path / "pre" / "reference_logps" / "train.npz"
    stamp = stored.stat().st_mtime_ns
    with caplog.at_level("INFO", logger="scaletrain"):  # the pass runs when the trainer is built: no step needed
        again = st.DPOTrainer(model=tiny_llama(seed=0, layers=1), ref_model=tiny_llama(seed=9, layers=1),
                              args=trainer.arguments, train_dataset=fixed_rows(_pairs()))
        again.release_run_lock()
    assert stored.stat().st_mtime_ns == stamp and "reusing the reference's log-probabilities" in caplog.text


@pytest.mark.parametrize("section,field", [
    ({"type": "dpo", "beta": 0}, "objective.beta"),
    ({"type": "dpo", "loss_type": ["sigmoid", "nope"]}, "objective.loss_type"),
    ({"type": "dpo", "loss_type": ["sigmoid", "ipo"], "loss_weights": [1.0]}, "objective.loss_weights"),
    ({"type": "dpo", "loss_type": "robust", "label_smoothing": 0.6}, "objective.label_smoothing"),
    ({"type": "simpo", "cpo_alpha": -1}, "objective.cpo_alpha"),
    ({"type": "kto", "desirable_weigth": 1.0}, "objective.desirable_weigth"),
    ({"type": "orpo", "reference": "/some/folder"}, "objective.reference"),
    ({"type": "a2c"}, "objective.type"),
])
def test_bad_objective_configs_name_their_field(section, field):
    with pytest.raises(ConfigError) as err:
        st.Recipe.from_dict({"objective": section})
    lines = str(err.value).splitlines()
    assert len(lines) == 2 and lines[1].startswith(field), lines  # the title, then one problem naming the field


def test_python_configs_take_trl_names_and_refuse_bad_ones():
    cfg = st.DPOConfig(beta=0.2, loss_type="ipo", max_steps=3, logging_steps=1)
    assert (cfg.beta, cfg.loss_type, cfg.max_training_steps, cfg.log_steps) == (0.2, ["ipo"], 3, 1)
    with pytest.raises(ConfigError, match="beta"):
        st.DPOConfig(beta=-1.0)
    with pytest.raises(ConfigError, match="loss_type"):
        st.DPOTrainer(model=tiny_llama(seed=0, layers=1), args=st.DPOConfig(loss_type="aot"), train_dataset=_pairs())
    with pytest.raises(ConfigError, match="ref_model"):
        st.ORPOTrainer(model=tiny_llama(seed=0, layers=1), ref_model=tiny_llama(seed=1, layers=1), args=st.ORPOConfig(),
                       train_dataset=_pairs())
    assert json.loads(json.dumps(st.CPOConfig(loss_type="simpo").model_dump()))["loss_type"] == "simpo"


@pytest.mark.parametrize("objective,kind,preparation", [
    ("dpo", "preference", "trl_dpo"), ("orpo", "preference", "trl_orpo"), ("cpo", "preference", "trl_orpo"),
    ("simpo", "preference", "trl_orpo"), ("kto", "unpaired_preference", "trl_dpo"),
])
def test_each_objective_prepares_and_cuts_rows_as_its_trl_trainer_unless_the_recipe_says_otherwise(
        objective, kind, preparation):
    recipe = st.Recipe.from_dict({"objective": {"type": objective}, "data": {"kind": kind}})
    assert (recipe.data.preparation, recipe.training.truncation_mode) == (preparation, "keep_start")
    assert st.Recipe.from_dict(recipe.to_dict()) == recipe  # recipe.yaml records the values, and reads back the same
    chosen = {"truncation_mode": "keep_end"}
    data = {"kind": kind, **({"preparation": "trl_dpo"} if kind == "preference" else {})}
    recipe = st.Recipe.from_dict({"objective": {"type": objective}, "data": data, "training": chosen})
    assert (recipe.data.preparation, recipe.training.truncation_mode) == ("trl_dpo", "keep_end")
    sft = st.Recipe.from_dict({"data": {"kind": "chat"}})  # other kinds keep the training default
    assert sft.training.truncation_mode == "keep_end" and sft.data.preparation is None
