"""Distillation runs beyond the TRL comparison (tests/test_distill_trl.py): a LoRA student with a bf16 teacher,
GKD's ``seq_kd`` (the teacher samples the off-policy rows), and the refusals (a teacher of another vocabulary,
no teacher at all), each with one line naming ``objective.teacher``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from preference_testing import export, first_train_record, one_device_mesh, tiny_llama, word_tokenizer

PROMPTS = ["what is two plus three", "the sky colour", "say hello", "name a fruit"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    tok = word_tokenizer(str(root / "tok"))
    teacher = str(root / "teacher")
    export(tiny_llama(seed=3, layers=1), teacher)
    return {"root": root, "tok": tok, "teacher": teacher}


def _args(out, cls_name, **kw):
    import scaletrain as st

    return getattr(st, cls_name)(output_dir=str(out), total_batch_size=4, learning_rate=3e-2, log_steps=1,
                                 progress_bar=False, report_to=[], max_length=16, **kw)


def test_lora_student_with_a_bf16_teacher_trains_only_the_adapters_and_the_teacher_stays_bf16(folders):
    from scaletrain.rl.distill import DistillationTrainer

    args = _args(folders["root"] / "lora", "DistillationConfig", max_training_steps=2, max_completion_length=4,
                 teacher_dtype="bfloat16", lora={"rank": 4, "alpha": 8.0})
    trainer = DistillationTrainer(model=tiny_llama(seed=0, mesh=one_device_mesh()), teacher_model=folders["teacher"],
                                  args=args, train_dataset=[{"prompt": p} for p in PROMPTS],
                                  processing_class=folders["tok"])
    start = trainer.model_state
    teacher = start.frozen_models["teacher"].params
    assert {x.dtype for x in jax.tree.leaves(teacher)} == {jnp.dtype(jnp.bfloat16)}
    before = jax.tree.map(np.asarray, jax.device_get((start.params, start.frozen, teacher)))
    out = trainer.train()
    after = jax.tree.map(np.asarray, jax.device_get((out.state.params, out.state.frozen,
                                                     out.state.frozen_models["teacher"].params)))
    record = first_train_record(args.output_dir)
    assert np.isfinite(record["loss"]) and record["rollout/on_policy"] == 1.0
    changed = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before[0]), jax.tree.leaves(after[0]))]
    assert any(changed)  # the adapters learn
    for i in (1, 2):  # the student's base and the teacher do not
        assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before[i]), jax.tree.leaves(after[i])))
    assert trainer.summary["teacher"]["teacher"] == folders["teacher"]


def test_gkd_seq_kd_trains_on_completions_the_teacher_samples(folders):
    from scaletrain.rl.distill import GKDTrainer

    args = _args(folders["root"] / "seq_kd", "GKDConfig", max_training_steps=1, lmbda=0.0, seq_kd=True,
                 max_new_tokens=4)
    trainer = GKDTrainer(model=tiny_llama(seed=0, mesh=one_device_mesh()), teacher_model=folders["teacher"],
                         args=args, train_dataset=[{"prompt": p} for p in PROMPTS], processing_class=folders["tok"])
    rows = [list(trainer.prompt_rows[i].prompt_ids) for i in range(4)]
    teacher_state = trainer._teacher_sampler(trainer.model_state)
    expected = trainer.rollout_engine.generate(teacher_state, rows, num_generations=1, seed=args.seed, step=1)
    trainer.train()
    record = first_train_record(args.output_dir)
    assert record["rollout/on_policy"] == 0.0 and np.isfinite(record["loss"])
    assert record["completions/mean_length"] == pytest.approx(float(np.mean(np.asarray(expected.lengths))))


def test_a_teacher_of_another_vocabulary_or_none_is_refused_naming_objective_teacher(folders):
    from scaletrain.errors import ConfigError
    from scaletrain.models import LlamaConfig, LlamaForCausalLM, create_sharded_model
    from scaletrain.rl.distill import DistillationTrainer

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    other, _ = create_sharded_model(LlamaForCausalLM, config, seed=1, mesh=one_device_mesh())
    small = str(folders["root"] / "vocab64")
    export(other, small)
    for teacher, message in ((small, "objective.teacher=.*has vocab_size 64, the policy 128.*cross-tokenizer "
                                     "distillation is not offered yet"),
                             (None, "objective.teacher is not set")):
        args = _args(folders["root"] / f"refused_{teacher is None}", "DistillationConfig", max_training_steps=1,
                     max_completion_length=4, **({"teacher": teacher} if teacher else {}))
        with pytest.raises(ConfigError, match=message) as err:
            DistillationTrainer(model=tiny_llama(seed=0, mesh=one_device_mesh()), args=args,
                                train_dataset=[{"prompt": p} for p in PROMPTS], processing_class=folders["tok"])
        assert "\n" not in str(err.value)
