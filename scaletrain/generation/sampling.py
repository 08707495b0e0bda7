"""Choosing each next token, and the log-probability of the choice under the model at temperature T.

Why here, apart from the decode loop: the rule for which distribution a token is drawn from
(temperature, then top-k, then top-p, as transformers applies them) and the rule for its
log-probability are what a reinforcement-learning objective relies on, and both must be read
in one place. The log-probability is that of the *unfiltered* distribution ``softmax(logits /
T)`` (T = 1 when greedy), the one TRL's GRPO trainer scores completions with
(``selective_log_softmax(logits / temperature)``): the trainer's forward over the same tokens
gives the same numbers, so the ratio of new to old policy starts at one. top-k and top-p only
decide which tokens can be drawn.

Randomness is a pure function of ``(seed, step, row, position)``: a run that resumes at training
step ``step`` samples exactly the completions an uninterrupted one would, and a row's tokens do
not depend on how many rows (or padding rows) share its batch.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def sampling_problem(max_new_tokens: int, temperature: Any, top_k: int | None,
                     top_p: Any | None) -> tuple[str, str] | None:
    """The first sampling argument that cannot work, as (its name, what is wrong), or None.

    Checked before anything compiles: ``top_k=0`` or ``top_p=0`` would keep no token and a
    negative temperature would prefer the least likely ones. Traced values pass unchecked."""
    def known(x: Any) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    if max_new_tokens < 0:
        return "max_new_tokens", f"must be >= 0, got {max_new_tokens}"
    if known(temperature) and not (temperature >= 0 and math.isfinite(temperature)):
        return "temperature", f"must be >= 0 and finite (0: greedy), got {temperature}"
    if top_k is not None and top_k < 1:
        return "top_k", f"must be at least 1 (or unset: no top-k), got {top_k}"
    if top_p is not None and known(top_p) and not 0 < top_p <= 1:
        return "top_p", f"must be in (0, 1] (or unset: no top-p), got {top_p}"
    return None


def filter_logits(logits: jax.Array, temperature: Any, top_k: int | None, top_p: Any | None) -> jax.Array:
    """``logits`` [..., V] divided by ``temperature`` with the tokens top-k and top-p drop set to -inf.

    As transformers does it: divide by the temperature, keep the ``top_k`` largest logits,
    then the smallest set of tokens whose probability reaches ``top_p``.
    """
    logits = logits.astype(jnp.float32) / temperature
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p is not None:
        sorted_logits = -jnp.sort(-logits, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        keep = jnp.sum(mass_before < top_p, axis=-1, keepdims=True)  # >= 1: the first has 0 before it
        cutoff = jnp.take_along_axis(sorted_logits, keep - 1, axis=-1)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return logits


def sample_token(
    logits: jax.Array, key: jax.Array, temperature: Any, top_k: int | None, top_p: Any | None
) -> jax.Array:
    """Sample one token per row of ``logits`` [B, V] with one key for the whole batch.

    ``temperature`` and ``top_p`` may be traced values; whether to sample at all is
    decided by the caller (a Python ``temperature <= 0`` means greedy).
    """
    keys = jax.random.split(key, logits.shape[0])
    return categorical(keys, filter_logits(logits, temperature, top_k, top_p))


#: tokens per block of :func:`categorical`'s two-level search
BLOCK = 256


def first_argmax(x: jax.Array) -> jax.Array:
    """``argmax`` over the last axis (the first index of the largest value), as two plain reductions.

    Why not ``jnp.argmax``: XLA's CPU backend runs its (value, index) pair reduction some 10x
    slower than a max and a min over [16, 49152] logits, and greedy decoding does one per step.
    """
    top = jnp.max(x, axis=-1, keepdims=True)
    index = jnp.min(jnp.where(x == top, jnp.arange(x.shape[-1], dtype=jnp.int32), x.shape[-1]), axis=-1)
    return jnp.minimum(index, x.shape[-1] - 1)


def _below(total: jax.Array) -> jax.Array:
    """The largest float32 below ``total`` (> 0): a draw clamped under it always lands on a token."""
    return jnp.nextafter(total, jnp.zeros_like(total))


def categorical(keys: jax.Array, logits: jax.Array) -> jax.Array:
    """One draw per row of ``softmax(logits)`` [B, V] (``-inf``: never drawn), with key ``keys[i]`` for row i.

    Inverse-CDF sampling with one uniform number per row, searched in two levels: the row's
    probability mass in blocks of :data:`BLOCK` tokens, the block the number falls in, then the
    token inside it. Why not ``jax.random.categorical`` (Gumbel-max): that draws V random numbers
    per row and step (threefry on the CPU: ~10 ms for 16 x 49152), ten times what the search
    costs. Each level clamps the number below its total, so rounding can never pick a token of
    zero probability.
    """
    b, v = logits.shape
    nb = -(-v // BLOCK)
    logits = logits.astype(jnp.float32)
    w = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
    w = jnp.pad(w, ((0, 0), (0, nb * BLOCK - v))).reshape(b, nb, BLOCK)
    mass = jnp.cumsum(jnp.sum(w, axis=-1), axis=-1)  # [B, nb]
    u = jax.vmap(jax.random.uniform)(keys) * mass[:, -1]
    u = jnp.minimum(u, _below(mass[:, -1]))
    block = jnp.minimum(jnp.sum(mass <= u[:, None], axis=-1), nb - 1)
    inside = jnp.cumsum(jnp.take_along_axis(w, block[:, None, None], axis=1)[:, 0], axis=-1)  # [B, BLOCK]
    before = jnp.where(block > 0, jnp.take_along_axis(mass, jnp.maximum(block - 1, 0)[:, None], axis=1)[:, 0], 0.0)
    rest = jnp.clip(u - before, 0.0, _below(inside[:, -1]))
    token = block * BLOCK + jnp.minimum(jnp.sum(inside <= rest[:, None], axis=-1), BLOCK - 1)
    return token.astype(jnp.int32)


def row_keys(seed: jax.Array, step: jax.Array, rows: jax.Array) -> jax.Array:
    """One key per row [B] from ``(seed, step, row)``: the rollout's randomness before positions. ``seed``: one
    for every row, or one per row [B] (a multi-turn row's turn seed; equal seeds give the same keys either way);
    ``rows``: the id each row's draws are keyed by (its request index, or the row it continues)."""
    seed = jnp.asarray(seed)
    if seed.ndim == 0:
        base = jax.random.fold_in(jax.random.key(seed), step)
        return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(base, rows)
    return jax.vmap(lambda s, r: jax.random.fold_in(jax.random.fold_in(jax.random.key(s), step), r))(seed, rows)


def inverse_temperature(temperature: float | None) -> np.float32:
    """``1 / temperature`` as a float32 division of float32 operands (1 for greedy: None or <= 0).

    Log-probabilities are scaled by this factor, in the rollout and in the trainer's scoring
    alike, rather than divided by the temperature: XLA may turn a division by a compile-time
    constant (the trainer's) into a multiplication by its reciprocal but must divide by a
    runtime value (the engine's), and the two differ in the last bit. One host-computed
    factor, multiplied in both programs, gives both the same bits.
    """
    if temperature is None or float(temperature) <= 0.0:
        return np.float32(1.0)
    return np.float32(1.0) / np.float32(temperature)


def pick_tokens(logits: jax.Array, keys: jax.Array, position: jax.Array, *, greedy: bool, temperature: jax.Array,
                inv_temperature: jax.Array, top_k: int | None, top_p: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """The next token of each row of ``logits`` [B, V] and its log-probability, both [B].

    Greedy: the argmax and its log-probability at temperature 1. Sampled: each row draws
    with its own key folded with ``position`` from the filtered ``logits / temperature``; the
    log-probability is under ``softmax(logits * inv_temperature)`` (:func:`inverse_temperature`),
    unfiltered (see the module docstring).
    """
    logits = logits.astype(jnp.float32)
    if greedy:
        tokens = first_argmax(logits)
        scaled = logits
    else:
        scaled = logits * inv_temperature
        position = jnp.asarray(position)  # one for all rows, or [B]: each row's own (continuous batching)
        keys = jax.vmap(jax.random.fold_in, in_axes=(0, 0 if position.ndim else None))(keys, position)
        tokens = categorical(keys, filter_logits(logits, temperature, top_k, top_p))
    picked = jnp.take_along_axis(scaled, tokens[:, None], axis=-1)[:, 0]
    return tokens, picked - jax.nn.logsumexp(scaled, axis=-1)
