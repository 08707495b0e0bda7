"""What a train step optimises: the :class:`Objective` seam and its implementations (``lm``; the preference
objectives ``dpo``, ``orpo``, ``cpo``/``simpo``, ``kto``; the recipe's names in ``registry``)."""

from scaletrain.objectives.base import Objective, ObjectiveBase, check_batch, select_frozen
from scaletrain.objectives.lm import LanguageModelObjective

__all__ = ["LanguageModelObjective", "Objective", "ObjectiveBase", "check_batch", "select_frozen"]
