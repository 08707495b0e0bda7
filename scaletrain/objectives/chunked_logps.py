"""Per-token log-probabilities of the next token, with logit statistics, chunk by chunk over the sequence.

Why: preference objectives (DPO, ORPO, CPO/SimPO, KTO) score whole completions from per-token
``log p(target)``; computed from whole float32 logits ``[N, T, V]`` with plain autodiff, a
large vocabulary makes the head the step's biggest buffer and its many passes over that
buffer (log-sum-exp, softmax, entropy, argmax, the gather's scatter in the backward) the
step's slowest part. Here each chunk of positions (all rows) gets its logits from the same
CPU dot kernels as the LM objective's fused loss, every per-token figure is reduced while
the chunk is in cache, and only ``[N, T]`` figures are kept.

The gradient of ``log p(target)`` with respect to the logits is ``onehot(target) - softmax``,
scaled by the incoming per-token cotangent, which the forward cannot know yet (a DPO row's
weight depends on the whole row's log-probability). So the backward recomputes each chunk's
logits (one more head matmul than the LM loss's fused gradient, instead of holding
``[N, T, V]``) and uses the ``log Z`` the forward stored. The logit statistics (vocabulary-mean
logit, entropy, target is the first argmax) are metrics: they carry no gradient.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from scaletrain.models.kernels.cpu_dots import dot
from scaletrain.objectives.fused_loss import (Axes, ChunkLayout, chunk_logits, finish_head_grad, head_grad,
                                               head_grad_carry)

Array = jax.Array


class TokenStats(NamedTuple):
    """Per-position figures [N, T]: position t scores ``targets[:, t]`` (the next token)."""

    logp: Array  # log p(target); the only differentiable figure
    mean_logit: Array  # the logits' mean over the vocabulary
    entropy: Array  # the predictive distribution's entropy (nats)
    top1: Array  # 1.0 where the target is the first argmax of the logits


def token_stats(hidden: Array, kernel: Array, targets: Array, dtype: Any, chunk_size: int, precision: Any = None,
                transposed: bool = False, batch_axes: Any = None, sequence_axes: Any = None,
                softcap: float | None = None) -> TokenStats:
    """:class:`TokenStats` of the head ``kernel`` ([H, V], or [V, H] if ``transposed``) on ``hidden`` [N, T, H].

    ``targets`` [N, T] is the token each position is scored against. Chunks, sharding axes and
    ``softcap`` are as in :func:`~scaletrain.objectives.fused_loss.fused_head_loss`.
    """
    layout = ChunkLayout.of(hidden.shape[0], hidden.shape[1], chunk_size, batch_axes, sequence_axes)
    split, join = layout.split, layout.join
    logp, metrics = _chunked(split(hidden.astype(dtype)), kernel.astype(dtype), split(targets), precision, transposed,
                             layout.axes, None if softcap is None else float(softcap))
    return TokenStats(join(logp), *(join(lax.stop_gradient(m)) for m in metrics))


def _chunk_figures(h: Array, w: Array, t: Array, precision: Any, transposed: bool,
                   softcap: float | None) -> tuple[Array, Array, tuple[Array, Array, Array]]:
    """``(logp, log Z, (mean logit, entropy, top1))`` of one chunk, each [N, P, chunk]."""
    return logit_figures(chunk_logits(h, w, precision, transposed, softcap)[0], t)


def logit_figures(logits: Array, t: Array) -> tuple[Array, Array, tuple[Array, Array, Array]]:
    """``(log p(t), log Z, (mean logit, entropy, top1))`` of float32 ``logits`` [..., V] against targets ``t``,
    in two passes over the logits (the max; the exponentials' sums) plus the top-1 test."""
    # one pass for the max, one for the exponentials' sums: log Z and E[logit] share the exponentials
    peak = jnp.max(logits, axis=-1)
    e = jnp.exp(logits - peak[..., None])
    mass, weighted = jnp.sum(e, axis=-1), jnp.sum(e * logits, axis=-1)
    log_z = peak + jnp.log(mass)
    target = jnp.take_along_axis(logits, t[..., None], axis=-1)[..., 0]
    # "the target is the first argmax" without an argmax (several times slower on CPU): it is the maximum
    # and no entry before it reaches it
    vocab = lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    earlier = jnp.any((logits >= target[..., None]) & (vocab < t[..., None]), axis=-1)
    top1 = ((target >= peak) & ~earlier).astype(jnp.float32)
    return target - log_z, log_z, (jnp.mean(logits, axis=-1), log_z - weighted / mass, top1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _chunked(hs: Array, w: Array, ts: Array, precision: Any, transposed: bool, axes: Axes,
             softcap: float | None) -> tuple[Array, tuple[Array, Array, Array]]:
    return _chunked_fwd(hs, w, ts, precision, transposed, axes, softcap)[0]


def _chunked_fwd(hs: Array, w: Array, ts: Array, precision: Any, transposed: bool, axes: Axes,
                 softcap: float | None) -> tuple[tuple[Array, tuple[Array, Array, Array]], tuple[Array, ...]]:
    def body(_: None, xs: tuple[Array, Array]) -> tuple[None, tuple[Array, Array, tuple[Array, Array, Array]]]:
        h, t = xs
        return None, _chunk_figures(h, w, t, precision, transposed, softcap)

    _, (logp, log_z, metrics) = lax.scan(body, None, (hs, ts))
    return (logp, metrics), (hs, w, ts, log_z)


def _chunked_bwd(precision: Any, transposed: bool, axes: Axes, softcap: float | None, res: tuple[Array, ...],
                 cotangents: tuple[Array, Any]) -> tuple[Array, Array, None]:
    hs, w, ts, log_zs = res
    gs = cotangents[0]  # the metrics' cotangents are ignored: token_stats stops their gradient
    vocab = w.shape[0] if transposed else w.shape[1]

    def body(dw: Array, xs: tuple[Array, Array, Array, Array]) -> tuple[Array, Array]:
        h, t, log_z, g = xs
        logits, dcap = chunk_logits(h, w, precision, transposed, softcap)
        # d logp / d logits = onehot(t) - softmax, times the cotangent
        onehot = lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1) == t[..., None]
        dlogits = jnp.where(onehot, g[..., None], 0.0) - jnp.exp(logits - log_z[..., None]) * g[..., None]
        dlogits = (dlogits if dcap is None else dlogits * dcap).astype(w.dtype)
        dh = dot(dlogits, w, rhs_transposed=not transposed, precision=precision)
        return dw + head_grad(h, dlogits, axes, precision), dh.astype(h.dtype)

    dw, dhs = lax.scan(body, head_grad_carry(hs.shape[-1], vocab, axes), (hs, ts, log_zs, gs.astype(jnp.float32)))
    return dhs, finish_head_grad(dw, axes, transposed, w.dtype), None


_chunked.defvjp(_chunked_fwd, _chunked_bwd)
