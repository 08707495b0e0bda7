"""A rollout, scored, as the GRPO objective's batch (host side of the step).

Why a module: the objective reads a fixed set of keys (``scaletrain.objectives.grpo``); turning
the rollout engine's arrays, the advantages and the stored log-probabilities into them is
plain array work that the tests can check apart from sampling.
"""

from __future__ import annotations

import numpy as np


def truncated_mask(completion_mask: np.ndarray, truncated: np.ndarray) -> np.ndarray:
    """``completion_mask`` with every truncated completion's row zeroed (``mask_truncated_completions``):
    a completion cut at ``max_completion_length`` has no reward worth learning from."""
    keep = ~np.asarray(truncated, bool)
    return (np.asarray(completion_mask) * keep[:, None]).astype(np.asarray(completion_mask).dtype)
