"""``PPOTrainer``: PPO with a learned value, as one more entry of GRPO's registries, not a trainer copy.

Why a subclass that adds only a head: PPO samples, scores and loops through
:class:`~scaletrain.rl.trainer.GRPOTrainer` (its rollout, reward functions, checkpoints and resume); what
differs is declared elsewhere: the options (``objectives/ppo_options.py``, TRL's last ``PPOConfig`` names),
the objective and its GAE (``objectives/ppo.py``, ``objectives/ppo_loss.py``), which the registries build
from ``objective.type: ppo``. Because the objective reads ``values``, the rollout's scoring forward keeps the
old log-probabilities and the value head's values (``rl/step_programs.py``), and the rollout's first update
forms per-token advantages and returns from the scores.

The value head is ``score`` (``[hidden, 1]``, HF's ``score.weight``) on the policy's own trunk
(``models/common/score_head.attach_value_head``): a parameter of the policy module, so the one optimizer
trains it with the policy, checkpoints save it and resume restores it. It starts from N(0, (1/(hidden+1))²)
(OpenRLHF's critic) or, with ``value_model: DIR``, from that reward model's ``score.weight`` (TRL's
``PPOTrainer`` started its value model from a reward model).
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from scaletrain.errors import ConfigError
from scaletrain.models.common.score_head import SCORE_TENSOR, attach_value_head
from scaletrain.models.factory import place_model
from scaletrain.models.hf import _weight_files, open_weights
from scaletrain.objectives.registry import register_trainer
from scaletrain.rl.config import PPOConfig, RLConfig
from scaletrain.rl.trainer import GRPOTrainer


def score_kernel_of(folder: str, hidden_size: int, where: str) -> Any:
    """A reward-model folder's ``score.weight`` [1, hidden] as our kernel [hidden, 1]; ConfigError naming
    ``where`` when the folder has none or its size differs from the policy's hidden size."""
    files = _weight_files(folder)
    if SCORE_TENSOR not in files:
        raise ConfigError(f"{where}={folder!r} has no {SCORE_TENSOR}: give a reward model's folder (a "
                          f"*ForSequenceClassification with num_labels=1), or drop {where} for a fresh head")
    with open_weights(files[SCORE_TENSOR]) as f:
        weight = np.asarray(f.get_tensor(SCORE_TENSOR), np.float32)
    if weight.shape != (1, hidden_size):
        raise ConfigError(f"{where}={folder!r}: its {SCORE_TENSOR} is {list(weight.shape)}, the policy's value head "
                          f"is [1, {hidden_size}]: give a reward model of the policy's hidden size")
    return weight.T


class PPOTrainer(GRPOTrainer):
    """PPO with a value head (see the module docstring). Arguments as :class:`GRPOTrainer`'s, with a
    :class:`~scaletrain.rl.config.PPOConfig` (or ``objective: {type: ppo}`` in a recipe)."""

    objective_type: ClassVar[str] = "ppo"
    config_class: ClassVar[type[RLConfig]] = PPOConfig

    def configure_model(self) -> Any:
        """The policy with its value head, then GRPO's model setup (the state, the KL reference)."""
        if self.arguments.lora is not None:
            raise ConfigError("training.lora with objective.type=ppo: the value head would be frozen with the base; "
                              "PPO with LoRA is not offered yet, train fully or drop training.lora")
        if self._given_model is None:
            raise ConfigError("PPOTrainer needs model= (a module or a model folder); a given model_state has no "
                              "value head")
        model, _ = place_model(self._given_model)
        if getattr(model, "score", None) is None:
            folder = self.options.value_model
            kernel = None if folder is None else score_kernel_of(folder, model.config.hidden_size,
                                                                 "objective.value_model")
            model = attach_value_head(model, kernel, seed=self.arguments.seed)
        self._given_model = model
        return super().configure_model()


register_trainer(PPOTrainer, "ppo")
