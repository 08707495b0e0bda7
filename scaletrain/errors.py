"""User-facing errors.

Why a small hierarchy: the CLI catches :class:`ScaletrainError` and prints one message
that names the field or file and says what to do, without a traceback. Anything else
is a bug and keeps its traceback.
"""

from __future__ import annotations


class ScaletrainError(Exception):
    """A mistake the user can fix (bad config, missing file, empty data, ...)."""


class ConfigError(ScaletrainError):
    """A recipe or argument is missing, unknown or has the wrong type or value."""


class DataError(ScaletrainError):
    """A corpus, dataset or tokenizer is missing, empty or unusable."""


class CheckpointError(ScaletrainError):
    """A checkpoint is missing, incomplete or incompatible with the run."""
