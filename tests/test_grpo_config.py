"""GRPO's configuration: the recipe's ``objective: {type: grpo}`` with the ``prompt`` data kind, one message per
bad field, and ``GRPOConfig`` with TRL's and EasyDeL's names (``epsilon`` is the clip, as in TRL)."""

from __future__ import annotations

import pytest

import scaletrain as st
from scaletrain.errors import ConfigError


def _recipe(objective, kind="prompt"):
    return st.Recipe.from_dict({"data": {"kind": kind, "source": "prompts.jsonl"}, "objective": objective})


def test_recipe_selects_grpo_and_its_trainer():
    from scaletrain.run import objective_trainer

    recipe = _recipe({"type": "grpo", "num_generations": 4, "loss_type": "dr_grpo", "beta": 0.04,
                      "reward_funcs": ["exact_answer", "scaletrain.rl.rewards:format_regex"],
                      "reward_weights": [1.0, 0.5]})
    cls, kwargs = objective_trainer(recipe)
    assert cls is st.GRPOTrainer
    assert kwargs["objective"].loss.loss_type == "dr_grpo" and kwargs["num_generations"] == 4
    assert kwargs["reward_weights"] == [1.0, 0.5]


@pytest.mark.parametrize("objective,kind,field", [
    ({"type": "grpo", "loss_type": "ppo"}, "prompt", "objective.loss_type"),
    ({"type": "grpo", "scale_rewards": "row"}, "prompt", "objective.scale_rewards"),
    ({"type": "grpo", "num_generations": 1}, "prompt", "objective.num_generations"),
    ({"type": "grpo", "importance_sampling_level": "word"}, "prompt", "objective.importance_sampling_level"),
    ({"type": "grpo", "reference": "/some/folder"}, "prompt", "objective"),  # reference without beta
    ({"type": "grpo"}, "chat", "data.kind"),
    ({"type": "lm"}, "prompt", "data.kind"),
])
def test_bad_grpo_recipes_name_their_field(objective, kind, field):
    with pytest.raises(ConfigError) as err:
        _recipe(objective, kind)
    assert field in str(err.value), str(err.value)


def test_grpo_config_takes_trl_and_easydel_names():
    cfg = st.GRPOConfig(epsilon=0.3, epsilon_high=0.28, adam_epsilon=1e-6, num_return_sequences=4, beta=0.1,
                        max_steps=3, logging_steps=1, loss_type="grpo", scale_rewards=False)
    assert (cfg.grpo.epsilon, cfg.epsilon, cfg.grpo.num_generations, cfg.grpo.beta) == (0.3, 1e-6, 4, 0.1)
    assert (cfg.max_training_steps, cfg.log_steps, cfg.grpo.scale_rewards) == (3, 1, "none")
    assert st.GRPOConfig().grpo.loss_type == "dapo"  # TRL 1.16's default
    with pytest.raises(ConfigError, match="loss_type"):
        st.GRPOConfig(loss_type="ppo")


def test_the_smollm2_example_recipe_validates_and_its_prompts_are_reproducible():
    """examples/grpo_smollm2.yaml: a grpo recipe whose batch num_generations divides, whose rewards load and
    pay what the docs say; its prompts are what scripts/make_grpo_prompts.py writes, with correct answers."""
    import importlib.util
    import json
    import pathlib
    import re

    from scaletrain.rl.rewards import load_rewards
    from scaletrain.rl.trainer import check_batch_size
    from scaletrain.run import objective_trainer

    repo = pathlib.Path(__file__).resolve().parents[1]
    recipe = st.Recipe.load(str(repo / "examples" / "grpo_smollm2.yaml"))
    cls, kwargs = objective_trainer(recipe)
    assert cls is st.GRPOTrainer and recipe.data.kind == "prompt" and recipe.training.lora is not None
    assert check_batch_size(recipe.training.total_batch_size, kwargs["num_generations"]) == 4
    funcs, weights = load_rewards(kwargs["reward_funcs"], kwargs["reward_weights"])
    assert [f.name for f in funcs] == ["exact_answer", "format_regex"] and list(weights) == [1.0, 0.5]
    completions = ["42", " The answer is 42.", "41"]
    scores = [f.fn(["q"] * 3, completions, answer=["42"] * 3) for f in funcs]
    assert scores == [[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]]
    spec = importlib.util.spec_from_file_location("make_grpo_prompts", repo / "scripts" / "make_grpo_prompts.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    rng = script.random.Random(0)
    lines = (repo / "examples" / "grpo" / "prompts.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in lines] == [script.make_row(rng, i) for i in range(len(lines))]
    for row in map(json.loads, lines):
        a, op, b = re.search(r"(\d+) (plus|minus|times|and) (\d+)", row["prompt"][-1]["content"]).groups()
        expected = {"plus": int(a) + int(b), "and": int(a) + int(b), "minus": int(a) - int(b),
                    "times": int(a) * int(b)}[op]
        assert row["answer"] == str(expected)


def test_plot_adds_the_reward_panel_for_a_grpo_run(tmp_path):
    """``scaletrain plot``: a run whose records carry ``reward`` gets a fourth panel (a 2000-pixel-wide figure at
    100 dpi instead of 1500); rewards come every other step here, as with num_iterations=2."""
    import json

    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    from scaletrain.plot import plot_run

    for name, with_reward in (("grpo", True), ("lm", False)):
        run = tmp_path / name
        run.mkdir()
        records = [{"split": "train", "step": s, "loss": 1.0 / s, "learning_rate": 1e-4, "tokens_per_s": 100.0,
                    **({"reward": 0.1 * s} if with_reward and s % 2 else {})} for s in range(1, 9)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        width = imread(plot_run(str(run))).shape[1]
        assert width == (2000 if with_reward else 1500), (name, width)


def test_grpo_temperature_zero_is_refused_with_the_reason():
    """At temperature 0 every completion of a group is the greedy one: equal rewards, zero advantages, a zero
    gradient at every step. The recipe and GRPOConfig refuse it, naming the field and saying why."""
    with pytest.raises(ConfigError) as err:
        _recipe({"type": "grpo", "temperature": 0})
    assert "objective.temperature: 0 samples greedily" in str(err.value)
    assert "every advantage is 0 and nothing trains" in str(err.value)
    with pytest.raises(ConfigError, match="temperature: 0 samples greedily"):
        st.GRPOConfig(temperature=0.0)
    assert _recipe({"type": "grpo", "temperature": 0.1}).objective.options["temperature"] == 0.1


def test_trl_vllm_options_say_rollouts_run_on_the_training_weights(caplog):
    """TRL's vLLM switches are not unknown keys: asking for vLLM (``use_vllm: true``) or for its guided decoding is
    refused with the reason (the run would not do it); the settings that only tune vLLM, inert in TRL too while
    vLLM is off, are dropped with one warning, so a TRL config with them runs as it would in TRL without vLLM."""
    import logging

    from scaletrain.objectives import grpo_options
    from scaletrain.objectives.registry import validate_options

    with pytest.raises(ConfigError) as err:
        _recipe({"type": "grpo", "use_vllm": True, "vllm_mode": "colocate"})
    lines = str(err.value).splitlines()
    assert [x for x in lines if x.startswith("objective.")] == [
        "objective.use_vllm: rollouts here sample from the training weights on the training mesh (no vLLM engine or "
        "server, no weight sync), so vLLM is neither needed nor used: drop use_vllm (and the vllm_* settings)"]
    with pytest.raises(ConfigError, match="objective.vllm_structured_outputs_regex: .* no guided decoding"):
        _recipe({"type": "grpo", "vllm_structured_outputs_regex": r"\d+"})
    with pytest.raises(ConfigError, match="GRPOConfig.use_vllm: rollouts here sample from the training weights"):
        st.GRPOConfig(use_vllm=True)
    with pytest.raises(ConfigError, match="objective.vllm_gpu_memory: unknown key"):  # not one of TRL's names
        _recipe({"type": "grpo", "vllm_gpu_memory": 0.5})
    grpo_options._warned.clear()  # once a process: a recipe is parsed more than once in a run
    with caplog.at_level(logging.WARNING, logger="scaletrain"):
        for _ in range(2):
            options = validate_options("grpo", {"use_vllm": False, "vllm_mode": "colocate",
                                                "vllm_gpu_memory_utilization": 0.3, "num_generations": 4})
    assert options == validate_options("grpo", {"num_generations": 4})
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == ["objective: use_vllm, vllm_gpu_memory_utilization, vllm_mode: rollouts here sample from the "
                      "training weights on the training mesh (no vLLM engine or server, no weight sync); these "
                      "options have no effect and can be dropped"]
    assert st.GRPOConfig(use_vllm=False, vllm_mode="server", num_generations=4).grpo.num_generations == 4


def test_the_example_plot_command_draws_the_reward_and_panels_say_what_the_loss_is(tmp_path):
    """The plot command in examples/grpo_smollm2.yaml's comment runs as written (``--metric reward``) and writes its
    PNG; a figure the run never logged is one line naming the figures it did log, exit 2; the loss panel says nats
    per token only for a token-level loss (a GRPO loss is a policy-gradient surrogate)."""
    import json
    import os
    import pathlib
    import re
    import shlex
    import subprocess
    import sys

    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    from scaletrain.plot import loss_title

    repo = pathlib.Path(__file__).resolve().parents[1]
    comment = (repo / "examples" / "grpo_smollm2.yaml").read_text()
    command = shlex.split(re.search(r"^# Plot:\s+(scaletrain plot .*)$", comment, re.M).group(1))
    run = tmp_path / "runs" / "grpo_smollm2"
    run.mkdir(parents=True)
    records = [{"split": "train", "step": s, "loss": 0.01 * s, "learning_rate": 3e-4, "tokens_per_s": 100.0,
                **({"reward": 0.1 * s, "rewards/exact_answer/mean": 0.05 * s} if s % 2 else {})} for s in range(1, 9)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    env = {**os.environ, "PYTHONPATH": str(repo)}

    def scaletrain(*args):
        return subprocess.run([sys.executable, "-m", "scaletrain", *args], capture_output=True, text=True,
                              cwd=tmp_path, env=env, timeout=300)

    done = scaletrain(*command[1:])
    assert done.returncode == 0, done.stderr
    assert imread(str(run / "reward.png")).shape[:2] == (400, 800)  # one panel, 8 x 4 inches at 100 dpi
    done = scaletrain("plot", "runs/grpo_smollm2", "--metric", "rewards/exact_answer/mean")
    assert done.returncode == 0 and (run / "rewards_exact_answer_mean.png").is_file(), done.stderr
    done = scaletrain("plot", "runs/grpo_smollm2", "--metric", "rewards")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].endswith(
        "--metric 'rewards': runs/grpo_smollm2/metrics.jsonl logs no such figure; it logs learning_rate, loss, reward, "
        "rewards/exact_answer/mean, tokens_per_s")
    assert loss_title(records) == "loss (GRPO objective, not a likelihood)"
    assert loss_title([{"step": 1, "loss": 2.0, "perplexity": 7.4}]) == "loss (nats/token)"
    assert loss_title([{"step": 1, "loss": 0.69, "rewards/margins": 0.0}]) == "loss"


def test_grpo_config_reads_and_sets_its_options_flat_as_trl_and_dpo_config_do():
    from pydantic import ValidationError

    cfg = st.GRPOConfig(num_generations=4, beta=0.1, epsilon=0.3)
    dpo = st.DPOConfig(beta=0.2)
    assert (cfg.num_generations, cfg.beta, cfg.loss_type, dpo.beta) == (4, 0.1, "dapo", 0.2)  # as TRL's
    cfg.num_generations, cfg.learning_rate = 8, 1e-3
    assert cfg.grpo.num_generations == 8 and cfg == st.GRPOConfig(num_generations=8, beta=0.1, epsilon=0.3,
                                                                   learning_rate=1e-3)
    assert (cfg.epsilon, cfg.grpo.epsilon) == (1e-8, 0.3)  # the one name the two mean differently: Adam's, the clip
    with pytest.raises(ValidationError, match="'ppo' is not one of"):
        cfg.loss_type = "ppo"
    assert cfg.loss_type == "dapo"


@pytest.mark.parametrize("trainer", ["DPOTrainer", "KTOTrainer", "GRPOTrainer"])
def test_a_trainer_argument_given_under_two_names_is_refused_naming_both(trainer):
    with pytest.raises(ConfigError, match=r"give 'args' or 'arguments', not both \(the same argument under two"):
        getattr(st, trainer)(model=None, args=st.TrainingArguments(), arguments=st.TrainingArguments())


def test_grpo_config_round_trips_through_its_dump():
    cfg = st.GRPOConfig(num_generations=4, beta=0.1, epsilon=0.3, adam_epsilon=1e-6)
    back = st.GRPOConfig.model_validate(cfg.model_dump())
    assert back == cfg and (back.grpo.epsilon, back.epsilon) == (0.3, 1e-6)  # the clip stays the clip
