"""Distillation and GKD number for number with TRL 1.16's ``DistillationTrainer`` and ``GKDTrainer``, run here.

A random tiny Llama student (2 layers) and a random teacher of another size (1 layer, the same vocabulary) are
exported to Hugging Face folders and loaded by TRL from them. Each trainer takes one step at learning rate 0 on the
same four prompts and the same completions (ragged: some end in ``</s>``, some run into the length limit); the
first logged step's loss and every figure both log must agree within 1e-4 relative.

- ``DistillationTrainer``: its on-policy sampler is replaced by fixed completions (TRL: its
  ``_generate_single_turn``; ours: a rollout engine returning them, ``rl/distill_rows.fixed_rollout``), so both
  compute the loss, at the sampling temperature, on the same tokens; ``beta`` 0 (forward KL), 0.5, 1 (reverse KL).
- ``GKDTrainer`` with ``lmbda=0``: every step reads the dataset's completions (TRL through a collator of the fixed
  rows, ours from the rows' ``completion`` text); ``beta`` 0, 0.5, 1; its loss at temperature 1 whatever it samples
  at.

The prompts all have three tokens: TRL's forward gives left-padded rows shifted positions (transformers counts
positions from the first column), ours count real tokens, so equal-length prompts keep the comparison to the
objectives.

Tolerance: both sides compute in float32 from the same weights; the divergence is a sum over a 128-word vocabulary
at each of ~14 tokens, computed by two programs with different summation orders: ~1e-6 relative, so 1e-4 with a
1e-6 absolute floor (the truncated share can be 0).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import pytest

from preference_testing import export, first_train_record, one_device_mesh, tiny_llama, word_tokenizer

pytest.importorskip("trl")
pytestmark = pytest.mark.filterwarnings("ignore")

PROMPTS = ["what is two", "the sky colour", "say hello world", "name a fruit"]
# completions as text; "</s>" ends a reply, the others run into MAX_LEN (the last is cut there)
REPLIES = ["five </s>", "blue green red", "hello </s>", "apple stone count to one four"]
MAX_LEN = 4
FIGURES = ("loss", "entropy", "completions/mean_length", "completions/min_length", "completions/max_length",
           "completions/clipped_ratio", "completions/mean_terminated_length", "completions/min_terminated_length",
           "completions/max_terminated_length")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill_trl")
    tok = word_tokenizer(str(root / "tok"))
    student, teacher = str(root / "student"), str(root / "teacher")
    export(tiny_llama(seed=0), student)
    export(tiny_llama(seed=3, layers=1), teacher)
    for folder in (student, teacher):
        tok.save_pretrained(folder)
    ids = {p: tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS}
    assert len({len(v) for v in ids.values()}) == 1  # equal lengths: see the module docstring
    replies = {tuple(ids[p]): tok(r, add_special_tokens=False)["input_ids"] for p, r in zip(PROMPTS, REPLIES)}
    # GKD's dataset completions: the text without </s>, tokenized, then </s> (as ours reads a completion column)
    dataset = {tuple(ids[p]): tok(r.removesuffix(" </s>"), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
               for p, r in zip(PROMPTS, REPLIES)}
    return {"root": root, "tok": tok, "student": student, "teacher": teacher, "replies": replies,
            "dataset": dataset}


def _close(ours, theirs, name):
    assert ours is not None and theirs is not None, name
    assert math.isclose(ours, theirs, rel_tol=1e-4, abs_tol=1e-6), (name, ours, theirs)


def _trl_common(out):
    return dict(output_dir=str(out), per_device_train_batch_size=4, max_steps=1, learning_rate=0.0, logging_steps=1,
                report_to="none", save_strategy="no", use_cpu=True, seed=0, bf16=False, gradient_checkpointing=False)


def _ours_common(out):
    return dict(output_dir=str(out), total_batch_size=4, max_training_steps=1, learning_rate=0.0, log_steps=1,
                progress_bar=False, report_to=[], max_length=16)


class FixedCompletions:
    """A rollout engine that returns each prompt's fixed completion (what TRL's patched sampler returns)."""

    def __init__(self, sampling, replies):
        self.sampling, self.replies = sampling, replies

    def generate(self, state, prompts, *, num_generations=1, seed=0, step=0):
        from scaletrain.generation import Rollout
        from scaletrain.rl.distill_rows import fixed_rollout

        fixed = fixed_rollout(prompts, [self.replies[tuple(p)] for p in prompts], self.sampling.max_completion_length,
                              self.sampling.pad_token_id, self.sampling.stop_token_ids)
        return Rollout(**{k: jnp.asarray(v) for k, v in fixed.arrays().items()},
                       steps=jnp.asarray(self.sampling.max_completion_length))


def _trl_distillation(setup, beta, temperature):
    from datasets import Dataset
    from trl import DistillationConfig, DistillationTrainer

    args = DistillationConfig(**_trl_common(setup["root"] / f"trl_d{beta}"), beta=beta, temperature=temperature,
                              max_completion_length=MAX_LEN)
    trainer = DistillationTrainer(model=setup["student"], teacher_model=setup["teacher"], args=args,
                                  train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS]),
                                  processing_class=setup["tok"])
    replies = setup["replies"]
    trainer._generate_single_turn = lambda prompt_ids, *a, **k: [replies[tuple(p)][:MAX_LEN] for p in prompt_ids]
    trainer.train()
    return trainer.state.log_history[0]


def _ours_distillation(setup, beta, temperature):
    import scaletrain as st
    from scaletrain.rl.distill import DistillationTrainer

    out = setup["root"] / f"ours_d{beta}"
    args = st.DistillationConfig(**_ours_common(out), beta=beta, temperature=temperature,
                                 max_completion_length=MAX_LEN)
    trainer = DistillationTrainer(model=tiny_llama(seed=0, mesh=one_device_mesh()), teacher_model=setup["teacher"],
                                  args=args, train_dataset=[{"prompt": p} for p in PROMPTS],
                                  processing_class=setup["tok"])
    trainer.rollout_engine = FixedCompletions(trainer.rollout_engine.sampling, setup["replies"])
    trainer.train()
    return first_train_record(str(out))


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_distillation_loss_and_metrics_equal_trl_distillation_trainer(setup, beta):
    theirs, ours = _trl_distillation(setup, beta, 0.7), _ours_distillation(setup, beta, 0.7)
    for name in FIGURES:
        _close(ours.get(name), theirs.get(name), name)
    assert ours["loss"] > 0


def _trl_gkd(setup, beta):
    import torch
    from datasets import Dataset
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    tok, replies = setup["tok"], setup["dataset"]

    def collate(rows):  # the fixed rows as TRL's ChatML collator lays them out: prompt, then completion, -100 off it
        prompts = [tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
        completions = [replies[tuple(p)][:MAX_LEN] for p in prompts]
        width = max(len(p) + len(c) for p, c in zip(prompts, completions))
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        mask, labels = torch.zeros_like(ids), torch.full_like(ids, -100)
        for i, (p, c) in enumerate(zip(prompts, completions)):
            ids[i, :len(p) + len(c)] = torch.tensor(p + c)
            mask[i, :len(p) + len(c)] = 1
            labels[i, len(p):len(p) + len(c)] = torch.tensor(c)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels, "prompts": torch.tensor(prompts),
                "prompt_attention_mask": torch.ones(len(rows), len(prompts[0]), dtype=torch.long)}

    args = GKDConfig(**_trl_common(setup["root"] / f"trl_g{beta}"), lmbda=0.0, beta=beta, max_new_tokens=MAX_LEN)
    trainer = GKDTrainer(model=setup["student"], teacher_model=setup["teacher"], args=args, data_collator=collate,
                         train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS]),
                         processing_class=tok)
    trainer.train()
    return trainer.state.log_history[0]


def _ours_gkd(setup, beta):
    import scaletrain as st
    from scaletrain.rl.distill import GKDTrainer

    out = setup["root"] / f"ours_g{beta}"
    args = st.GKDConfig(**_ours_common(out), lmbda=0.0, beta=beta, max_new_tokens=MAX_LEN)
    # the completions as text: tokenized without special tokens, then </s>; the cut ones run past MAX_LEN
    rows = [{"prompt": p, "completion": r.removesuffix(" </s>")} for p, r in zip(PROMPTS, REPLIES)]
    trainer = GKDTrainer(model=tiny_llama(seed=0, mesh=one_device_mesh()), teacher_model=setup["teacher"], args=args,
                         train_dataset=rows, processing_class=setup["tok"])
    trainer.train()
    return first_train_record(str(out))


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_gkd_loss_equals_trl_gkd_trainer_off_policy(setup, beta):
    theirs, ours = _trl_gkd(setup, beta), _ours_gkd(setup, beta)
    _close(ours["loss"], theirs["loss"], "loss")
    assert ours["rollout/on_policy"] == 0.0 and ours["loss"] > 0
