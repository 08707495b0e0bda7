"""The log-probabilities the trainer's forward gives a rollout's completion tokens.

Why it lives beside the engine: the engine's log-probabilities are only worth something if
they equal what the training forward (no cache, whole rows, the training attention path)
computes for the same tokens, and this is that forward, laid out as a rollout returns its
rows: the left-padded prompt, then the completion and its right padding. An objective that
scores rollouts (GRPO's old and reference log-probs) can call it as it is.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from scaletrain.generation.sampling import inverse_temperature

Array = jax.Array


def rollout_rows(prompt_ids: Array, prompt_mask: Array, completion_ids: Array,
                 completion_mask: Array) -> tuple[Array, Array, Array]:
    """``(input_ids, segment_ids, positions)`` [B, P + N] of prompts followed by their completions:
    segment 1 on real tokens, 0 on padding (left of the prompt, right of the completion), positions
    counting real tokens, as the decode loop numbered them."""
    ids = jnp.concatenate([prompt_ids, completion_ids], axis=1).astype(jnp.int32)
    seg = jnp.concatenate([prompt_mask, completion_mask], axis=1).astype(jnp.int32)
    positions = jnp.maximum(jnp.cumsum(seg, axis=1) - 1, 0).astype(jnp.int32)
    return ids, seg, positions


def completion_log_probs(model: Any, prompt_ids: Array, prompt_mask: Array, completion_ids: Array,
                         completion_mask: Array, temperature: float = 1.0) -> Array:
    """``log softmax(logits / temperature)`` of each completion token [B, N] by the training forward
    (float32; 0 under a mask of 0). ``temperature`` 0 (greedy) scores at 1, as the engine does."""
    ids, seg, positions = rollout_rows(prompt_ids, prompt_mask, completion_ids, completion_mask)
    p = prompt_ids.shape[1]
    hidden = model.hidden_states(ids, positions=positions, segment_ids=seg)
    logits = model.compute_logits(hidden[:, p - 1:-1]).astype(jnp.float32)  # the logits predicting each token
    scaled = logits * inverse_temperature(temperature)
    picked = jnp.take_along_axis(scaled, completion_ids[..., None].astype(jnp.int32), axis=-1)[..., 0]
    # the engine's formula (``pick_tokens``), not log_softmax's (x - max) - log sum: the same bits
    return jnp.where(completion_mask != 0, picked - jax.nn.logsumexp(scaled, axis=-1), 0.0)
