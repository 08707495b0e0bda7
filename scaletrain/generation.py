"""Text generation from a causal LM (greedy or sampled).

This first version recomputes the full (fixed-size) buffer each token, so it
compiles once and is exact, at the cost of speed; a KV-cache version keeps the
same signature.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def sample_token(logits: jax.Array, key: jax.Array, temperature: float, top_k: int | None,
                 top_p: float | None) -> jax.Array:
    """Pick one token per row of ``logits`` [B, V]: argmax at temperature 0, else sample."""
    if temperature <= 0.0:
        return jnp.argmax(logits, axis=-1)
    logits = logits.astype(jnp.float32) / temperature
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p is not None:
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        cum = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
        # smallest logit still inside the nucleus
        cutoff_idx = jnp.sum(cum < top_p, axis=-1, keepdims=True)
        cutoff = jnp.take_along_axis(sorted_logits, cutoff_idx, axis=-1)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1)


def generate(
    model: nnx.Module,
    input_ids: Any,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    eos_token_id: int | None = None,
    attention_mask: Any = None,
) -> np.ndarray:
    """Continue each (left-padded) prompt by ``max_new_tokens`` tokens; returns only the new tokens."""
    ids = np.atleast_2d(np.asarray(input_ids, np.int32))
    b, t = ids.shape
    mask = np.ones_like(ids) if attention_mask is None else np.atleast_2d(np.asarray(attention_mask, np.int32))
    total = t + max_new_tokens
    buf = np.zeros((b, total), np.int32)
    buf[:, :t] = ids
    seg = np.ones((b, total), np.int32)
    seg[:, :t] = mask
    graphdef, params = nnx.split(model)

    @jax.jit
    def step(params: Any, buf: jax.Array, seg: jax.Array, index: jax.Array, key: jax.Array) -> jax.Array:
        m = nnx.merge(graphdef, params)
        logits = m(buf, segment_ids=seg)
        last = jax.lax.dynamic_index_in_dim(logits, index - 1, axis=1, keepdims=False)
        return sample_token(last, key, temperature, top_k, top_p)

    key = jax.random.key(seed)
    done = np.zeros(b, bool)
    out = np.zeros((b, max_new_tokens), np.int32)
    buf_j, seg_j = jnp.asarray(buf), jnp.asarray(seg)
    for i in range(max_new_tokens):
        key, sub = jax.random.split(key)
        tok = np.asarray(step(params, buf_j, seg_j, jnp.int32(t + i), sub))
        if eos_token_id is not None:
            tok = np.where(done, eos_token_id, tok)
            done |= tok == eos_token_id
        out[:, i] = tok
        buf_j = buf_j.at[:, t + i].set(tok)
        if eos_token_id is not None and done.all():
            out = out[:, : i + 1]
            break
    return out
