"""Per-token log-probabilities and entropies of completions that follow a left-padded prompt.

Why: GRPO scores every completion token (its ratio and KL are per token), where the
preference objectives sum them per row (:mod:`~scaletrain.objectives.logps`). A row is laid
out as the rollout engine returns it: the prompt left-padded to P columns, then the
completion (C columns, right-padded), so the logits predicting the completion are those of
positions ``P - 1 .. P + C - 2`` and only those are computed.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from scaletrain.generation.sampling import inverse_temperature

Array = jax.Array


def completion_token_stats(model: Any, input_ids: Array, segment_ids: Array, positions: Array,
                           completion_width: int, temperature: float = 1.0) -> tuple[Array, Array]:
    """``(log_probs, entropies)`` [N, C] of the last ``completion_width`` tokens of each row under
    ``softmax(logits / temperature)`` (float32), the distribution TRL's GRPO trainer scores with.

    ``temperature`` 0 or None (greedy sampling) scores at 1. Values under padding are computed
    but meaningless: callers mask them.
    """
    hidden = completion_hidden(model, input_ids, segment_ids, positions, completion_width)
    return stats_of_hidden(model, hidden, input_ids[:, input_ids.shape[1] - completion_width:], temperature)


def completion_hidden(model: Any, input_ids: Array, segment_ids: Array, positions: Array,
                      completion_width: int) -> Array:
    """[N, C, hidden]: the final hidden states that predict the last ``completion_width`` tokens (positions
    ``P - 1 .. P + C - 2``), where a value head reads each completion token's state too."""
    p = input_ids.shape[1] - completion_width
    hidden = model.hidden_states(input_ids, positions=positions, segment_ids=segment_ids)
    return hidden[:, p - 1:-1]


def stats_of_hidden(model: Any, hidden: Array, target: Array, temperature: float = 1.0) -> tuple[Array, Array]:
    """``(log_probs, entropies)`` [N, C] of ``target`` [N, C] under the logits of ``hidden`` (see above)."""
    logits = model.compute_logits(hidden).astype(jnp.float32)
    inv_t = inverse_temperature(temperature)
    if inv_t != 1.0:
        logits = logits * inv_t  # as the rollout engine scales them: the same bits
    log_z = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, target.astype(jnp.int32)[..., None], axis=-1)[..., 0] - log_z
    probs = jnp.exp(logits - log_z[..., None])
    entropy = log_z - jnp.sum(probs * logits, axis=-1)
    return picked, jax.lax.stop_gradient(entropy)


def completion_token_stats_and_values(model: Any, input_ids: Array, segment_ids: Array, positions: Array,
                                      completion_width: int, temperature: float = 1.0) -> tuple[Array, Array, Array]:
    """``(log_probs, entropies, values)`` [N, C] from one forward: the values are the model's value head
    (``score``, a ``[hidden, 1]`` linear, :func:`~scaletrain.models.common.score_head.attach_value_head`) on
    the hidden state before each completion token, as TRL's ``PPOTrainer`` read ``values[:, P - 1:-1]``."""
    hidden = completion_hidden(model, input_ids, segment_ids, positions, completion_width)
    logps, entropy = stats_of_hidden(model, hidden, input_ids[:, input_ids.shape[1] - completion_width:],
                                     temperature)
    return logps, entropy, model.score(hidden)[..., 0].astype(jnp.float32)
