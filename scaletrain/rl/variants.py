"""GRPO's variants as trainers: ``RLOOTrainer`` (TRL 1.16's names) and ``ReinforcePPTrainer``.

Why subclasses that only name their registry entry: a variant samples, scores and updates through
:class:`~scaletrain.rl.trainer.GRPOTrainer`'s rollout and loop; what differs is its options model and
objective (``objectives/rl_variant_options.py``: the advantage estimator and, for RLOO, the loss), which
the objective registry builds from ``objective_type``. A recipe's ``objective.type: rloo`` /
``reinforce_pp`` runs the same classes (registered here with ``register_trainer``).
"""

from __future__ import annotations

from typing import ClassVar

from scaletrain.objectives.registry import register_trainer
from scaletrain.rl.config import ReinforcePPConfig, RLConfig, RLOOConfig
from scaletrain.rl.trainer import GRPOTrainer


class RLOOTrainer(GRPOTrainer):
    """TRL's ``RLOOTrainer``: leave-one-out advantages, ``beta`` as a KL penalty on the reward, the clipped loss per
    completion. Arguments as :class:`GRPOTrainer`'s, with an :class:`~scaletrain.rl.config.RLOOConfig`."""

    objective_type: ClassVar[str] = "rloo"
    config_class: ClassVar[type[RLConfig]] = RLOOConfig


class ReinforcePPTrainer(GRPOTrainer):
    """REINFORCE++: GRPO's loss over batch-normalised advantages. Arguments as :class:`GRPOTrainer`'s, with a
    :class:`~scaletrain.rl.config.ReinforcePPConfig`."""

    objective_type: ClassVar[str] = "reinforce_pp"
    config_class: ClassVar[type[RLConfig]] = ReinforcePPConfig


register_trainer(RLOOTrainer, "rloo")
register_trainer(ReinforcePPTrainer, "reinforce_pp")
