"""Task types a model class can be registered for (EasyDeL RayDistributedTrainer's ``TaskType``)."""

from __future__ import annotations

import enum


class TaskType(str, enum.Enum):
    """What a module's head computes. Only ``CAUSAL_LM`` is implemented today."""

    CAUSAL_LM = "causal-language-model"
    SEQUENCE_CLASSIFICATION = "sequence-classification"
    BASE_MODULE = "base-module"

    def __str__(self) -> str:
        return self.value
