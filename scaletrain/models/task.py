"""The tasks a model class is registered for: plain strings, what a module's head computes.

``causal-language-model`` is what the trainer trains; ``base-module`` is a decoder without a
head (``LlamaModel``); ``custom`` marks a user's own class, which the trainer trains like a causal
LM. Why strings: the registry is the core's, and a string is what recipes and saved configs hold;
EasyDeL's ``TaskType`` enum (:mod:`scaletrain.compat.easydel.enums`) has these values, so its
members are accepted wherever a task is.
"""

from __future__ import annotations

import enum
from typing import Any

CAUSAL_LM = "causal-language-model"
SEQUENCE_CLASSIFICATION = "sequence-classification"
BASE_MODULE = "base-module"
CUSTOM = "custom"
#: every task a module class can be registered for
TASKS = (CAUSAL_LM, SEQUENCE_CLASSIFICATION, BASE_MODULE, CUSTOM)


def task_name(value: Any) -> str:
    """``value`` (a task string or a str enum member with a task's value) as the plain string; ValueError otherwise."""
    name = value.value if isinstance(value, enum.Enum) else value
    if name not in TASKS:
        raise ValueError(f"unknown task {value!r}; known: {list(TASKS)}")
    return str(name)
