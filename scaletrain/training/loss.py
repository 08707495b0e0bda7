"""Causal-LM cross-entropy, token-weighted so accumulation is exact.

The loss functions return *sums* (loss, correct predictions, target tokens) rather
than means: summing over micro-batches and dividing once gives exactly the mean of
one big batch, whatever the padding in each micro-batch.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

Array = jax.Array


class LossSums(NamedTuple):
    loss: Array  # sum of token cross-entropies (nats)
    z_loss: Array  # sum of log(Z)^2 over target tokens
    correct: Array  # number of targets predicted by argmax
    tokens: Array  # number of target tokens


def target_mask(input_ids: Array, segment_ids: Array | None, loss_mask: Array | None) -> Array:
    """Float mask over positions ``1..T-1``: the token there is a target of the previous one.

    A token is a target when it is in the same (non-pad) segment as the token before
    it, and, if a ``loss_mask`` is given (e.g. assistant tokens in SFT), when that
    mask is set on it.
    """
    if segment_ids is None:
        segment_ids = jnp.ones_like(input_ids)
    mask = (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, 1:] != 0)
    if loss_mask is not None:
        mask = mask & (loss_mask[:, 1:] != 0)
    return mask.astype(jnp.float32)


def cross_entropy_sums(logits: Array, input_ids: Array, mask: Array) -> LossSums:
    """Sums of next-token cross-entropy for ``logits`` [B, T, V] against ``input_ids`` [B, T]."""
    logits = logits[:, :-1].astype(jnp.float32)
    targets = input_ids[:, 1:]
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    nll = log_z - target_logit
    correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    return LossSums(
        loss=jnp.sum(nll * mask),
        z_loss=jnp.sum(jnp.square(log_z) * mask),
        correct=jnp.sum(correct * mask),
        tokens=jnp.sum(mask),
    )
