"""Chunked per-token log-probabilities equal whole-logits autodiff: values, metrics and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from scaletrain.objectives.chunked_logps import token_stats

N, T, H, V = 3, 11, 8, 40


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    hidden = jnp.asarray(rng.normal(size=(N, T, H)), jnp.float32)
    kernel = jnp.asarray(rng.normal(size=(H, V)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, V, (N, T)))
    weights = jnp.asarray(rng.normal(size=(N, T)), jnp.float32)  # a per-token cotangent, as a row loss gives
    return hidden, kernel, targets, weights


def _plain(hidden, kernel, targets, softcap):
    logits = hidden @ kernel
    if softcap is not None:
        logits = jnp.tanh(logits / softcap) * softcap
    log_z = jax.nn.logsumexp(logits, axis=-1)
    logp = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0] - log_z
    entropy = log_z - jnp.sum(jax.nn.softmax(logits, axis=-1) * logits, axis=-1)
    top1 = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    return logp, jnp.mean(logits, axis=-1), entropy, top1


@pytest.mark.parametrize("chunk", [1, 4, 11, 64])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_values_metrics_and_gradients_equal_autodiff(chunk, tied, softcap):
    """Any chunking (padded last chunk, one chunk, a chunk above T), separate or tied head, soft-capped or not.

    Tolerances: float32 sums over V = 40 terms of logits up to ~10 in a different order: rtol 1e-5, and
    2e-5 absolute for the entropy, a difference of such sums (log Z - E[logit]) that can be near 0."""
    hidden, kernel, targets, weights = _inputs()

    def chunked(hd, k):
        stats = token_stats(hd, k.T if tied else k, targets, jnp.float32, chunk, transposed=tied, softcap=softcap)
        return jnp.sum(stats.logp * weights), stats

    def plain(hd, k):
        stats = _plain(hd, k, targets, softcap)
        return jnp.sum(stats[0] * weights), stats

    (va, sa), ga = jax.value_and_grad(plain, argnums=(0, 1), has_aux=True)(hidden, kernel)
    (vb, sb), gb = jax.jit(jax.value_and_grad(chunked, argnums=(0, 1), has_aux=True))(hidden, kernel)
    np.testing.assert_allclose(vb, va, rtol=1e-5)
    for x, y in zip(sb, sa):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=2e-5)
    for x, y in zip(gb, ga):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)


def test_metrics_carry_no_gradient():
    """The logit statistics are metrics: differentiating through them gives zero, not a wrong gradient."""
    hidden, kernel, targets, _ = _inputs(1)
    grad = jax.grad(lambda hd: jnp.sum(token_stats(hd, kernel, targets, jnp.float32, 4).entropy))(hidden)
    np.testing.assert_array_equal(grad, jnp.zeros_like(hidden))


def test_sequence_stats_chunked_equal_whole_logits():
    """A model's per-row figures and their gradient are the same with whole logits and chunk by chunk
    (forced with a zero byte limit). Float32 sums in another order: rtol 1e-5, and 2e-5 absolute (entropy)."""
    from scaletrain.objectives.logps import sequence_stats
    from tests.preference_testing import tiny_llama

    model = tiny_llama(seed=0, layers=1)
    rng = np.random.default_rng(3)
    ids = jnp.asarray(rng.integers(1, 128, (4, 12)))
    seg = jnp.asarray((np.arange(12)[None] < np.array([[12], [9], [5], [11]])).astype(np.int32))
    loss_mask = jnp.asarray((np.arange(12)[None] >= 4).astype(np.int32)) * seg

    def run(limit):
        def f(m):
            stats = sequence_stats(m, ids, seg, loss_mask, whole_logits_bytes=limit)
            return jnp.sum(stats["logps"] * jnp.arange(1.0, 5.0)) - 0.3 * jnp.sum(stats["seq_logps"]), stats
        return nnx.value_and_grad(f, has_aux=True)(model)

    (va, sa), ga = run(1 << 40)
    (vb, sb), gb = run(0)
    np.testing.assert_allclose(vb, va, rtol=1e-5)
    for key in sa:
        np.testing.assert_allclose(sb[key], sa[key], rtol=1e-5, atol=2e-5, err_msg=key)
    assert float(jnp.max(jnp.abs(jax.tree.leaves(ga)[0]))) > 0
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6), gb, ga)
