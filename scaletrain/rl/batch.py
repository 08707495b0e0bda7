"""A rollout's rows as the GRPO objective reads them: the loss mask, the prompt columns kept.

Why a module: the objective reads a fixed set of keys (``scaletrain.objectives.grpo``); turning
the rollout engine's arrays into them (``rl.step_programs``, on the device) is plain array work
that the tests check apart from sampling.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def truncated_mask(completion_mask: Any, truncated: Any) -> jax.Array:
    """``completion_mask`` with every truncated completion's row zeroed (``mask_truncated_completions``):
    a completion cut at ``max_completion_length`` has no reward worth learning from. A device function (the
    GRPO step's score program calls it inside its jit); host arrays work too."""
    mask = jnp.asarray(completion_mask)
    return (mask * (~jnp.asarray(truncated).astype(bool))[:, None]).astype(mask.dtype)


def kept_prompt_columns(width: int, longest: int) -> int:
    """How many of a rollout's ``width`` left-padded prompt columns the update reads: the ``longest`` prompt
    rounded up to a multiple of an eighth of the engine's bucket (at least 8 tokens), at most ``width``.

    Why: the engine pads prompts to a power of two so that nearby lengths share one decode program
    (36-token prompts sit in 64 columns), but the update's forward and backward cost grows with every
    column, padding or not (there, 28 of 96 columns per row: a quarter of the step's matmuls). Padding
    is masked and positions count real tokens, so cutting it changes no log-probability; the rounding
    keeps the update's compiled shapes to at most 4 per engine bucket.
    """
    step = max(8, width // 8)
    return min(width, -(-max(longest, 1) // step) * step)


def trim_prompt_padding(prompt_ids: Any, prompt_mask: Any, longest: int) -> tuple[Any, Any]:
    """A rollout's left-padded prompts (host or device arrays) cut to :func:`kept_prompt_columns` for prompts of at
    most ``longest`` real tokens. The caller passes ``longest`` from the prompts it sampled, which every process
    knows, so every process cuts alike without reading the rows."""
    width = prompt_ids.shape[1]
    drop = width - kept_prompt_columns(width, longest)
    return prompt_ids[:, drop:], prompt_mask[:, drop:]
