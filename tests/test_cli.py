"""The command line: recipes, overrides, user errors, and a short real run."""

import glob
import json
import os
import subprocess
import sys
import time

import pytest
import yaml

from scaletrain.errors import ConfigError
from scaletrain.recipe import Recipe, apply_overrides

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args, cwd=None, timeout=600):
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-m", "scaletrain", *args], capture_output=True, text=True,
                          cwd=cwd or ROOT, env=env, timeout=timeout)


def test_overrides_are_dotted_yaml_values():
    out = apply_overrides({"training": {"learning_rate": 1.0}},
                          ["training.learning_rate=0.5", "mesh.axis_dims=[1,2,1,4,1]", "model.tie_word_embeddings=true"])
    assert out == {"training": {"learning_rate": 0.5}, "mesh": {"axis_dims": [1, 2, 1, 4, 1]},
                   "model": {"tie_word_embeddings": True}}
    with pytest.raises(ConfigError, match="section.key=value"):
        apply_overrides({}, ["nonsense"])


def test_recipe_errors_name_file_and_key(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"training": {"learning_rate": "fast", "max_stepz": 3},
                                    "model": {"hidden_sise": 3}}))
    with pytest.raises(ConfigError) as err:
        Recipe.load(str(path))
    msg = str(err.value)
    assert str(path) in msg
    assert "training.learning_rate" in msg and "training.max_stepz: unknown key; did you mean 'max_steps'" in msg
    assert "hidden_sise" in msg
    with pytest.raises(ConfigError, match="recipe file not found"):
        Recipe.load(str(tmp_path / "missing.yaml"))


@pytest.mark.parametrize("recipe,section,override,message", [
    ("shakespeare.yaml", "model", {"sliding_window": 0}, "model.sliding_window: must be at least 1 (got 0)"),
    ("shakespeare.yaml", "model", {"hidden_size": 0}, "model.hidden_size: must be at least 1 (got 0)"),
    ("shakespeare.yaml", "model", {"num_key_value_heads": -2}, "model.num_key_value_heads: must be at least 1 (got -2)"),
    ("shakespeare.yaml", "model", {"rms_norm_eps": 0}, "model.rms_norm_eps: must be > 0 (got 0)"),
    ("gemma3.yaml", "model", {"sliding_window_pattern": 0}, "model.sliding_window_pattern: must be at least 1"),
    ("gemma3.yaml", "model", {"final_logit_softcapping": 0}, "model.final_logit_softcapping: must be > 0 (got 0)"),
    ("shakespeare.yaml", "training", {"learning_rate": -0.001},
     "training.learning_rate: must be >= 0 and finite (got -0.001)"),
    ("shakespeare.yaml", "training", {"beta2": 1.0}, "training.beta2: must be in [0, 1) (got 1.0)"),
    ("shakespeare.yaml", "training", {"weight_decay": -0.1}, "training.weight_decay: must be >= 0 and finite"),
    ("shakespeare.yaml", "training", {"clip_grad": -1.0}, "training.clip_grad: must be >= 0 (0 or null: no clipping)"),
    ("shakespeare.yaml", "training", {"loss_chunk_size": 0}, "training.loss_chunk_size: must be at least 1"),
])
def test_values_that_cannot_work_are_refused_by_name(tmp_path, recipe, section, override, message):
    """A window of 0 tokens lets each token see only itself and a negative learning rate or weight
    decay climbs the loss: both trained without a word. A size of 0 fails far from its cause. Each
    is refused when the recipe loads, naming the file and the field."""
    data = yaml.safe_load(open(os.path.join(ROOT, "examples", recipe)))
    data[section] = {**data.get(section, {}), **override}
    path = tmp_path / recipe
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as err:
        Recipe.load(str(path))
    assert str(path) in str(err.value) and message in str(err.value)


@pytest.mark.parametrize("name", sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "examples", "*.yaml"))))
def test_every_example_recipe_loads_with_its_keys_checked(name):
    """A recipe in examples/ that no longer loads (a renamed option, a typo in a key) would only fail when a user
    runs it: the slow examples (SmolLM2 distillation, reward models, agentic runs) are not trained in the suite,
    so each is at least loaded here, which checks every key and value the recipe sets."""
    Recipe.load(os.path.join(ROOT, "examples", name))


def test_example_recipe_is_valid():
    recipe = Recipe.load(os.path.join(ROOT, "examples", "shakespeare.yaml"))
    assert recipe.model.config_overrides["hidden_size"] == 256
    again = Recipe.from_dict(yaml.safe_load(recipe.to_yaml()))
    assert again == recipe


def test_cli_user_error_is_one_message_and_exit_2(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("training:\n  total_batch_size: lots\n")
    res = _run("train", str(path))
    assert res.returncode == 2
    assert "training.total_batch_size" in res.stderr
    assert "Traceback" not in res.stderr
    res = _run("train", str(tmp_path / "nope.yaml"))
    assert res.returncode == 2 and "nope.yaml" in res.stderr


def test_import_is_fast_and_lazy():
    code = "import time,sys; t=time.perf_counter(); import scaletrain; print(time.perf_counter()-t, 'jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT).stdout.split()
    assert out[1] == "False"
    assert float(out[0]) < 1.0


@pytest.mark.slow
def test_train_cli_end_to_end(tmp_path):
    """A few steps of the main job's recipe on 2 plays: metrics, summary, sample."""
    out = tmp_path / "run"
    res = _run(
        "train", os.path.join(ROOT, "examples", "shakespeare.yaml"),
        f"training.output_dir={out}", "training.max_training_steps=6", "training.log_steps=2",
        "training.evaluation_steps=null", "training.max_evaluation_steps=2", "data.max_documents=3",
        "data.eval_fraction=0.1", "model.num_hidden_layers=1", "model.hidden_size=64",
        "model.intermediate_size=128", "sample.max_new_tokens=8", "training.progress_bar=false",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    for key in ("final_step", "final_train_loss", "final_eval_loss", "final_eval_bits_per_byte",
                "tokens_per_s", "mfu", "params_sha256"):
        assert summary[key] is not None, key
    assert summary["final_step"] == 6
    assert summary["sample"].startswith("ROMEO.")
    assert (out / "recipe.yaml").exists() and (out / "metrics.jsonl").exists()
    assert "--- sample ---" in res.stdout
