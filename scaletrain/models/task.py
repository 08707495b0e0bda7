"""Task types a model class can be registered for (EasyDeL RayDistributedTrainer's ``TaskType``)."""

from __future__ import annotations

import enum


class TaskType(str, enum.Enum):
    """What a module's head computes.

    ``CAUSAL_LM`` is what the trainer trains; ``BASE_MODULE`` is a decoder without a head
    (``LlamaModel``); ``CUSTOM`` marks a user's own class (EasyDeL's RayDistributedTrainer documentation's custom-model
    example), which the trainer trains like a causal LM.
    """

    CAUSAL_LM = "causal-language-model"
    SEQUENCE_CLASSIFICATION = "sequence-classification"
    BASE_MODULE = "base-module"
    CUSTOM = "custom"

    def __str__(self) -> str:
        return self.value
