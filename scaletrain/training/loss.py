"""Causal-LM cross-entropy, token-weighted so accumulation is exact.

The loss functions return *sums* (loss, correct predictions, target tokens) rather
than means: summing over micro-batches and dividing once gives exactly the mean of
one big batch, whatever the padding in each micro-batch.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from scaletrain.models.cpu_dots import matmul

Array = jax.Array


class LossSums(NamedTuple):
    loss: Array  # sum of token cross-entropies (nats)
    z_loss: Array  # sum of log(Z)^2 over target tokens
    correct: Array  # number of targets whose logit is the maximum (argmax up to ties)
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
    """:class:`LossSums` of float32 ``logits`` [..., V] against ``targets`` [...] under ``mask``.

    A target counts as correct when its logit is the row's maximum (argmax up to
    exact ties): compared with the max that ``logsumexp`` computes anyway, this
    saves an argmax pass over the [tokens, vocab] logits (~2% of a CPU step).
    """
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    correct = (target_logit >= jnp.max(logits, axis=-1)).astype(jnp.float32)
    return LossSums(
        loss=jnp.sum((log_z - target_logit) * mask),
        z_loss=jnp.sum(jnp.square(log_z) * mask),
        correct=jnp.sum(correct * mask),
        tokens=jnp.sum(mask),
    )


def chunked_cross_entropy_sums(hidden: Array, kernel: Array, input_ids: Array, mask: Array, dtype: Any,
                               chunk_size: int, precision: Any = None, transposed: bool = False) -> LossSums:
    """The same sums as :func:`cross_entropy_sums`, without ``[B, T, V]`` float32 logits.

    The sequence is cut into chunks of ``chunk_size`` positions; each chunk's logits
    are computed, reduced and dropped inside a ``lax.scan``, and rematerialised in
    the backward pass (``jax.checkpoint``). Peak memory for the logits falls from
    ``B*T*V`` to ``B*chunk_size*V`` floats at the cost of one extra head matmul.
    ``kernel`` is [hidden, vocab], or [vocab, hidden] (a tied embedding) if ``transposed``.
    """
    b, t, h = hidden.shape
    chunks = -(-t // chunk_size)
    pad = chunks * chunk_size - t
    targets, full_mask = next_token_targets(input_ids, mask)
    hs = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))) if pad else hidden
    ts = jnp.pad(targets, ((0, 0), (0, pad)))
    ms = jnp.pad(full_mask, ((0, 0), (0, pad)))
    hs = jnp.moveaxis(hs.reshape(b, chunks, chunk_size, h), 1, 0)
    ts = jnp.moveaxis(ts.reshape(b, chunks, chunk_size), 1, 0)
    ms = jnp.moveaxis(ms.reshape(b, chunks, chunk_size), 1, 0)
    w = kernel.astype(dtype)

    @jax.checkpoint
    def one(h_c: Array, t_c: Array, m_c: Array) -> LossSums:
        logits = matmul(h_c.astype(dtype), w, rhs_transposed=transposed, precision=precision).astype(jnp.float32)
        return token_sums(logits, t_c, m_c)

    def body(carry: LossSums, xs: tuple[Array, Array, Array]) -> tuple[LossSums, None]:
        return LossSums(*(a + b for a, b in zip(carry, one(*xs)))), None

    zeros = LossSums(*(jnp.zeros((), jnp.float32) for _ in LossSums._fields))
    sums, _ = jax.lax.scan(body, zeros, (hs, ts, ms))
    return sums


def resolve_chunk_size(setting: Any, vocab_size: int, seq_len: int) -> int | None:
    """``auto``: chunk when the vocabulary is large (>= 32k), else compute logits whole."""
    if setting == "auto":
        return 512 if vocab_size >= 32768 and seq_len > 512 else None
    return setting
