"""The gated delta rule (Gated DeltaNet's token mixer) and its short causal convolution, as pure functions.

Why pure functions apart from the layer: training runs the *chunked* form (a few matmuls per chunk of
64 tokens and one ``lax.scan`` over chunks), decoding the *recurrent* form (one state update per
token), and both must agree with transformers' torch fallbacks (``torch_chunk_gated_delta_rule``,
``torch_recurrent_gated_delta_rule``) number for number; the bench times them on their own.

The recurrence, per value head, with state ``S`` [Dk, Dv]::

    S_t = exp(g_t) * S_{t-1} + k_t ⊗ beta_t * (v_t - exp(g_t) * S_{t-1}^T k_t)        o_t = S_t^T q_t

Packed rows hold several documents: ``doc`` [B, T] numbers them (any ids that change where a
document starts), and the recurrence and the convolution restart at each change, so a document's
outputs never depend on the one before it. In the chunked form the restart is three masks: pairs of
positions in different documents do not interact, a position reads the state carried into its chunk
only if no document started in between, and only the chunk's last document writes the state it hands on.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

Array = jax.Array


def l2norm(x: Array, eps: float = 1e-6) -> Array:
    """``x / sqrt(sum(x²) + eps)`` over the last axis (the FLA library's and transformers' form)."""
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def document_index(doc: Array) -> Array:
    """[B, T] int32: how many document starts precede each position (the row's first token is no start,
    so a state carried into the row continues it)."""
    starts = jnp.concatenate([jnp.zeros_like(doc[:, :1], bool), doc[:, 1:] != doc[:, :-1]], axis=1)
    return jnp.cumsum(starts.astype(jnp.int32), axis=1)


def _heads_first(q: Array, k: Array, v: Array, g: Array, beta: Array) -> tuple[Array, ...]:
    """float32 [B, H, T, ...] copies, q and k repeated to the value heads, l2-normed, q scaled by Dk^-1/2."""
    rep = v.shape[2] // k.shape[2]
    q, k = (jnp.repeat(x, rep, axis=2) if rep > 1 else x for x in (q, k))
    q, k, v = (jnp.swapaxes(x.astype(jnp.float32), 1, 2) for x in (q, k, v))
    g, beta = (jnp.swapaxes(x.astype(jnp.float32), 1, 2) for x in (g, beta))
    q, k = l2norm(q), l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def chunk_gated_delta_rule(q: Array, k: Array, v: Array, g: Array, beta: Array, doc: Array | None = None,
                           initial_state: Array | None = None, chunk_size: int = 64) -> tuple[Array, Array]:
    """Outputs [B, T, Hv, Dv] (``v``'s dtype) and the final state [B, Hv, Dk, Dv] (float32).

    ``q``, ``k`` [B, T, Hk, Dk]; ``v`` [B, T, Hv, Dv] (each q/k head serves Hv/Hk consecutive value heads);
    ``g`` [B, T, Hv] the log decay (≤ 0); ``beta`` [B, T, Hv] the write strength; ``doc`` [B, T] document ids
    (None: one document per row); ``initial_state`` continues the row's first document (None: zeros).
    """
    b, t, _, dk = k.shape
    h, dv, dtype = v.shape[2], v.shape[3], v.dtype
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)
    idx = document_index(jnp.zeros((b, t), jnp.int32) if doc is None else doc)
    c = chunk_size
    pad = (-t) % c
    if pad:  # a padded tail continues the last document and writes nothing (k = beta = 0, no decay)
        q, k, v = (jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0))) for x in (q, k, v))
        g, beta = (jnp.pad(x, ((0, 0), (0, 0), (0, pad))) for x in (g, beta))
        idx = jnp.pad(idx, ((0, 0), (0, pad)), mode="edge")
    n = (t + pad) // c
    chunks = lambda x: x.reshape(b, h, n, c, *x.shape[3:])  # noqa: E731
    q, k, v, g, beta = (chunks(x) for x in (q, k, v, g, beta))
    idx = idx.reshape(b, 1, n, c)
    # the document before each chunk: the state carried into the chunk belongs to it
    before = jnp.concatenate([idx[:, :, :1, :1], idx[:, :, :-1, -1:]], axis=2)
    from_state = (idx == before).astype(jnp.float32)  # [B, 1, N, C]
    to_end = (idx == idx[..., -1:]).astype(jnp.float32)
    same = (idx[..., :, None] == idx[..., None, :]) & jnp.tril(jnp.ones((c, c), bool))
    cum = jnp.cumsum(g, axis=-1)  # [B, H, N, C]
    decay = jnp.exp(jnp.where(same, cum[..., :, None] - cum[..., None, :], -jnp.inf))  # [B, H, N, C, C]
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    strictly_lower = jnp.tril(jnp.ones((c, c), bool), -1)
    ut = jnp.where(strictly_lower, jnp.einsum("...id,...jd->...ij", k_beta, k) * decay, 0.0) + jnp.eye(c)
    solve = lambda rhs: lax.linalg.triangular_solve(ut, rhs, left_side=True, lower=True,  # noqa: E731
                                                    unit_diagonal=True)
    new_values = solve(v_beta)
    k_cumdecay = solve(k_beta * (jnp.exp(cum) * from_state)[..., None])
    intra = jnp.einsum("...id,...jd->...ij", q, k) * decay
    q_state = q * (jnp.exp(cum) * from_state)[..., None]
    k_state = k * (jnp.exp(cum[..., -1:] - cum) * to_end)[..., None]
    chunk_decay = jnp.exp(cum[..., -1]) * from_state[..., -1]  # [B, H, N]

    def step(state: Array, xs: tuple[Array, ...]) -> tuple[Array, Array]:
        nv, kc, qs, ks, attn, cd = xs
        v_new = nv - kc @ state
        out = qs @ state + attn @ v_new
        return state * cd[..., None, None] + jnp.swapaxes(ks, -1, -2) @ v_new, out

    state = jnp.zeros((b, h, dk, dv), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)
    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (new_values, k_cumdecay, q_state, k_state, intra, chunk_decay))
    state, out = lax.scan(step, state, xs)  # out [N, B, H, C, Dv]
    out = jnp.moveaxis(out, 0, 2).reshape(b, h, n * c, dv)[:, :, :t]
    return jnp.swapaxes(out, 1, 2).astype(dtype), state


def recurrent_gated_delta_rule(q: Array, k: Array, v: Array, g: Array, beta: Array,
                               state: Array) -> tuple[Array, Array]:
    """The decoding form: outputs [B, T, Hv, Dv] (``v``'s dtype) and the new state, one update per token
    (T is 1 when decoding); same arguments as :func:`chunk_gated_delta_rule`, one document."""
    dtype = v.dtype
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)

    def step(s: Array, xs: tuple[Array, ...]) -> tuple[Array, Array]:
        qt, kt, vt, gt, bt = xs  # [B, H, D] and [B, H]
        s = s * jnp.exp(gt)[..., None, None]
        delta = (vt - jnp.einsum("bhkv,bhk->bhv", s, kt)) * bt[..., None]
        s = s + kt[..., :, None] * delta[..., None, :]
        return s, jnp.einsum("bhkv,bhk->bhv", s, qt)

    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (q, k, v, g, beta))
    state, out = lax.scan(step, state.astype(jnp.float32), xs)  # out [T, B, H, Dv]
    return jnp.moveaxis(out, 0, 1).astype(dtype), state


def causal_conv(x: Array, weight: Array, doc: Array | None = None, state: Array | None = None) -> Array:
    """Depthwise causal convolution of ``x`` [B, T, C] with ``weight`` [C, K] (no bias), silu after.

    Position ``t`` sums ``weight[:, K-1-s] * x[t-s]`` for ``s < K`` over earlier positions of its own
    document (``doc``, as in :func:`chunk_gated_delta_rule`); ``state`` [B, K-1, C] holds the inputs
    before the row (a decode cache's), read as the first document's.
    """
    kernel = weight.shape[1]
    b, t, _ = x.shape
    idx = document_index(jnp.zeros((b, t), jnp.int32) if doc is None else doc)
    if state is None:
        state = jnp.zeros((b, kernel - 1, x.shape[2]), x.dtype)
    full = jnp.concatenate([state.astype(x.dtype), x], axis=1)  # [B, K-1+T, C]
    full_idx = jnp.concatenate([jnp.zeros((b, kernel - 1), jnp.int32), idx], axis=1)
    out = jnp.zeros(x.shape, jnp.float32)
    for s in range(kernel):
        shifted = lax.dynamic_slice_in_dim(full, kernel - 1 - s, t, axis=1)
        keep = lax.dynamic_slice_in_dim(full_idx, kernel - 1 - s, t, axis=1) == idx
        out = out + jnp.where(keep[..., None], shifted.astype(jnp.float32), 0.0) * weight[:, kernel - 1 - s]
    return jax.nn.silu(out).astype(x.dtype)


def conv_state_after(x: Array, doc: Array | None, state: Array | None, kernel: int) -> Array:
    """The last K-1 inputs [B, K-1, C] a decode cache keeps after ``x`` [B, T, C]: those of the row's last
    document (earlier documents' and padding's are zeros, as transformers zeroes padded inputs)."""
    b, t, ch = x.shape
    idx = document_index(jnp.zeros((b, t), jnp.int32) if doc is None else doc)
    if state is None:
        state = jnp.zeros((b, kernel - 1, ch), x.dtype)
    full = jnp.concatenate([state.astype(x.dtype), x], axis=1)[:, -(kernel - 1):]
    full_idx = jnp.concatenate([jnp.zeros((b, kernel - 1), jnp.int32), idx], axis=1)[:, -(kernel - 1):]
    return jnp.where((full_idx == idx[:, -1:])[..., None], full, 0)
