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
