"""RLOO and REINFORCE++ as users reach them: ``objective.type: rloo`` / ``reinforce_pp`` through ``scaletrain train``,
``RLOOConfig`` / ``RLOOTrainer`` in Python, and GRPO options a variant does not read refused by name.

The runs are the shared tiny GRPO recipe (tests/grpo_testing.py), two steps each, in this process: they show the
variant's objective, estimator and trainer are wired (its figures logged, its name recorded in the checkpoint,
RLOO's default ``beta`` reading a reference), not that a reward rises (test_grpo_trainer.py shows that for the
loop they share).
"""

from __future__ import annotations

import json
import math

import pytest
import yaml

from grpo_testing import tiny_grpo_recipe
from preference_testing import word_tokenizer

PROMPTS = ["what is two plus three", "the sky colour", "say hello", "name a fruit"]
# a reward with spread inside each group (a random policy's completions repeat words now and then)
REWARD = """
def distinct_words(prompts, completions, **columns):
    return [float(len(set(c.split()))) for c in completions]
"""


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl_variants")
    word_tokenizer(str(root / "tok"))
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    (root / "variant_rewards.py").write_text(REWARD)
    return root


def _train_records(output_dir) -> list[dict]:
    with open(output_dir / "metrics.jsonl") as f:
        return [r for r in map(json.loads, f) if r.get("split") == "train"]


@pytest.mark.parametrize("kind,options,figure", [
    ("rloo", {"normalize_advantages": True}, "clip_ratio/high_max"),
    ("reinforce_pp", {"group_baseline": True, "beta": 0.04}, "clip_ratio/region_mean"),
])
def test_rloo_and_reinforce_pp_recipes_take_steps_through_scaletrain_train(work, kind, options, figure, monkeypatch):
    from scaletrain.cli import main
    from scaletrain.training.checkpoint import read_meta

    monkeypatch.syspath_prepend(str(work))
    recipe = tiny_grpo_recipe(str(work), {"total_batch_size": 8, "max_training_steps": 2, "save_steps": 2},
                              {"type": kind, "reward_funcs": ["variant_rewards:distinct_words"], **options})
    path = work / f"{kind}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    out = work / f"{kind}-run"
    assert main(["train", str(path), f"training.output_dir={out}"]) == 0
    records = _train_records(out)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert all(math.isfinite(r[k]) for k in ("loss", "reward", "kl", "entropy", figure)), r
    assert records[0]["frac_reward_zero_std"] < 1 and records[0]["grad_norm"] > 0  # the rewards teach something
    assert records[1]["kl"] != 0  # the second rollout's policy moved away from the reference
    meta = read_meta(str(out / "checkpoints" / "2"))
    assert meta["objective"]["name"] == kind and meta["reference"] is not None  # beta > 0: a reference is read
    assert all(meta["objective"][k] == v for k, v in options.items())


def test_rloo_config_and_trainer_take_trls_names(tmp_path):
    import scaletrain as st
    from test_grpo_trainer import _tiny

    tok = word_tokenizer(str(tmp_path / "tok"))
    args = st.RLOOConfig(output_dir=str(tmp_path / "run"), total_batch_size=8, num_generations=4,
                         max_completion_length=6, max_steps=2, logging_steps=1, beta=0.0, normalize_advantages=True,
                         reward_clip_range=(0.0, 1.0), learning_rate=3e-2, report_to="none", max_length=32,
                         progress_bar=False, save_at_end=False)
    assert (args.rloo.normalize_advantages, args.rloo.reward_clip_range, args.rloo.beta) == (True, (0.0, 1.0), 0.0)
    assert st.RLOOConfig().rloo.num_generations == 2 and st.RLOOConfig().rloo.beta == 0.05  # TRL 1.16's defaults
    trainer = st.RLOOTrainer(model=_tiny(len(tok)), reward_funcs=[lambda prompts, completions, **kw: [
        float(len(c.split())) for c in completions]], args=args, train_dataset=[{"prompt": p} for p in PROMPTS],
        processing_class=tok)
    assert trainer.objective.name == "rloo" and trainer.objective.advantages.name == "rloo"
    assert trainer.objective.advantages.reward_clip_range == (0.0, 1.0)
    # the recipe run above trains through this same class (run.objective_trainer picks RLOOTrainer for type: rloo)


@pytest.mark.parametrize("kind,key", [("rloo", "loss_type"), ("rloo", "scale_rewards"), ("rloo", "delta"),
                                      ("reinforce_pp", "scale_rewards")])
def test_a_grpo_option_a_variant_does_not_read_is_refused_by_name(kind, key):
    from scaletrain.errors import ConfigError
    from scaletrain.objectives.registry import build_objective

    value = {"loss_type": "grpo", "scale_rewards": "batch", "delta": 2.0}[key]
    with pytest.raises(ConfigError, match=f"objective.{key}: .*drop {key}"):
        build_objective(kind, {key: value})
    build_objective(kind, {})  # the defaults build
