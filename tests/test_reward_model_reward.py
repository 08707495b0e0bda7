"""A reward model as a GRPO reward (``reward_funcs: [{model: DIR}]``): its scores are transformers', and a GRPO
step runs with it beside a Python reward, weighed by ``reward_weights``.

Scores: the same texts scored by transformers' ``AutoModelForSequenceClassification`` as TRL's ``GRPOTrainer``
feeds it (prompt + completion, right-padded, no special tokens) within 1e-4 relative (float32 both sides, one
dot product of a final hidden state apart).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from grpo_testing import tiny_grpo_recipe
from preference_testing import RAGGED_PAIRS, hf_reward_model

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def reward_folder(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("rm") / "rm")
    hf_reward_model(folder, seed=1)
    return folder


def test_reward_model_scores_equal_transformers_sequence_classifier_on_the_same_texts(reward_folder):
    import transformers

    from scaletrain.rl.rewards import load_rewards

    prompts = [p for p, _, _ in RAGGED_PAIRS]
    completions = [c for _, c, _ in RAGGED_PAIRS]
    (func,), _ = load_rewards([{"model": reward_folder}])
    ours = np.array(func.fn(prompts, completions))
    tokenizer = transformers.AutoTokenizer.from_pretrained(reward_folder)
    inputs = tokenizer(text=[p + c for p, c in zip(prompts, completions)], return_tensors="pt", padding=True,
                       padding_side="right", add_special_tokens=False)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(reward_folder).eval()
    with torch.no_grad():
        theirs = model(**inputs).logits[:, 0].numpy()
    assert func.name == "rm" and np.ptp(theirs) > 0.1
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-5)


def test_a_causal_lm_folder_as_reward_model_is_refused_in_one_line(tmp_path):
    from hf_testing import hf_model
    from scaletrain.errors import ConfigError
    from scaletrain.rl.rewards import load_rewards

    hf_model("llama").save_pretrained(tmp_path / "lm")
    with pytest.raises(ConfigError, match=r"reward_funcs\[0\]\.model=.*LlamaForCausalLM without a score head"):
        load_rewards([{"model": str(tmp_path / "lm")}])


def test_one_grpo_step_runs_with_a_reward_model_beside_a_python_reward_which_a_resume_checks(reward_folder, tmp_path):
    """One step with a reward model beside a Python reward; the reward model is a frozen model: its folder and a
    digest of its weights are in the checkpoint, and a resume after its weights changed is refused, naming
    ``reward_funcs[0].model`` (as a changed reference is)."""
    import shutil

    from scaletrain.errors import CheckpointError
    from scaletrain.recipe import Recipe
    from scaletrain.run import run_training

    shutil.copytree(reward_folder, tmp_path / "tok", ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
    rm = str(tmp_path / "rm")
    shutil.copytree(reward_folder, rm)
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p, _, _ in RAGGED_PAIRS[:2]))
    out = tmp_path / "run"

    def recipe(steps):
        return Recipe.from_dict(tiny_grpo_recipe(
            str(tmp_path), {"output_dir": str(out), "total_batch_size": 8, "max_training_steps": steps,
                            "save_at_end": True, "resume_if_possible": True},
            {"reward_funcs": [{"model": rm}, "format_regex"], "reward_weights": [1.0, 0.5]}))

    run_training(recipe(1))
    records = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    record = next(r for r in records if r["split"] == "train")
    assert np.isfinite(record["rewards/rm/mean"]) and record["rewards/rm/mean"] != 0
    assert record["reward"] == pytest.approx(record["rewards/rm/mean"] + 0.5 * record["rewards/format_regex/mean"],
                                             abs=1e-5)
    record = json.loads((out / "summary.json").read_text())["reward_funcs[0].model"]
    assert record["reward_funcs[0].model"] == rm and len(record["reward_funcs[0].model_sha256"]) == 64
    hf_reward_model(rm, seed=2)  # the same folder, other weights
    with pytest.raises(CheckpointError, match=r"trained against the reward_funcs\[0\]\.model .*differs.*resume "
                                              r"with the same objective\.reward_funcs\[0\]\.model"):
        run_training(recipe(2))


def test_a_reward_model_of_another_tokenizer_is_refused_in_one_line(reward_folder, tmp_path):
    from preference_testing import word_tokenizer
    from scaletrain.errors import ConfigError
    from scaletrain.rl.rewards import load_rewards

    other = word_tokenizer(str(tmp_path / "other"), bos=True)  # one token more
    with pytest.raises(ConfigError, match=r"reward_funcs\[0\]\.model=.*its tokenizer \(\d+ tokens\) is not the "
                                          r"policy's"):
        load_rewards([{"model": reward_folder}], tokenizer=other)
