"""Causal-LM cross-entropy, token-weighted so accumulation is exact.

The loss functions return *sums* (loss, correct predictions, target tokens) rather
than means: summing over micro-batches and dividing once gives exactly the mean of
one big batch, whatever the padding in each micro-batch.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

Array = jax.Array


class LossSums(NamedTuple):
    loss: Array  # sum of token cross-entropies (nats)
    z_loss: Array  # sum of log(Z)^2 over target tokens
    correct: Array  # number of targets whose logit is strictly greater than every other logit
    tokens: Array  # number of target tokens


def eval_metrics(total: LossSums, bytes_per_token: float | None = None) -> dict[str, float]:
    """Loss, accuracy and perplexity per target token of summed eval results (and bits per byte
    when the eval text's bytes per token is known: a figure comparable across tokenizers)."""
    n = max(float(total.tokens), 1.0)
    loss = float(total.loss) / n
    out = {
        "eval_loss": loss,
        "eval_accuracy": float(total.correct) / n,
        "eval_perplexity": math.exp(min(loss, 50.0)),
        "eval_tokens": float(total.tokens),
    }
    if bytes_per_token:
        out["eval_bits_per_byte"] = loss / math.log(2) / bytes_per_token
    return out


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


def next_token_targets(input_ids: Array, mask: Array) -> tuple[Array, Array]:
    """Targets and mask aligned with *all* T positions: position t predicts ``input_ids[t + 1]``.

    The last position gets target 0 under mask 0. Scoring every position and masking
    the last, rather than slicing ``logits[:, :-1]``, saves a copy of the whole
    [B, T-1, V] logits (and of its gradient), as transformers' loss does by padding
    the labels.
    """
    targets = jnp.pad(input_ids[:, 1:], ((0, 0), (0, 1)))
    return targets, jnp.pad(mask, ((0, 0), (0, 1)))


def cross_entropy_sums(logits: Array, input_ids: Array, mask: Array) -> LossSums:
    """Sums of next-token cross-entropy for ``logits`` [B, T, V] against ``input_ids`` [B, T].

    ``mask`` [B, T-1] is :func:`target_mask`'s, over positions ``1..T-1``.
    """
    targets, full_mask = next_token_targets(input_ids, mask)
    return token_sums(logits.astype(jnp.float32), targets, full_mask)


def token_sums(logits: Array, targets: Array, mask: Array) -> LossSums:
    """:class:`LossSums` of float32 ``logits`` [..., V] against ``targets`` [...] under ``mask``."""
    return token_sums_and_log_z(logits, targets, mask)[0]


def token_sums_and_log_z(logits: Array, targets: Array, mask: Array) -> tuple[LossSums, Array]:
    """:func:`token_sums` and the per-token ``log Z`` it computed (the fused loss's gradient needs it).

    A target counts as correct only when its logit is *strictly* the largest of its row:
    it is the maximum and no other entry reaches it. A tie is a wrong prediction, so a
    collapsed model with uniform logits scores 0, not 1 (``target >= max`` alone did);
    a row with a NaN scores 0. The "no other entry" test is a boolean ``any`` over the
    row, the cheapest of the exact rules measured (an argmax or a count cost 1.5-4x more
    on [4096, 4096] float32 logits on CPU).
    """
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    vocab = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    rival = jnp.any((logits >= target_logit[..., None]) & (vocab != targets[..., None]), axis=-1)
    correct = ((target_logit >= jnp.max(logits, axis=-1)) & ~rival).astype(jnp.float32)
    sums = LossSums(
        loss=jnp.sum((log_z - target_logit) * mask),
        z_loss=jnp.sum(jnp.square(log_z) * mask),
        correct=jnp.sum(correct * mask),
        tokens=jnp.sum(mask),
    )
    return sums, log_z


def resolve_chunk_size(setting: Any, vocab_size: int, seq_len: int) -> int | None:
    """Positions per chunk of the fused head + loss, or None for whole logits.

    ``auto``: chunks of 512 positions when the vocabulary is large (>= 32k), where
    whole float32 logits dominate activation memory (a 128k vocabulary at 8 x 2048
    tokens is 8 GB); whole logits otherwise, which measured as fast as chunks at a
    vocabulary of 8k on CPU. Chunking costs no extra matmul
    (:mod:`scaletrain.objectives.fused_loss`).
    """
    if setting == "auto":
        return min(512, seq_len) if vocab_size >= 32768 else None
    return setting
