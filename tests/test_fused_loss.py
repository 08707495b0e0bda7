"""The fused head + loss equals whole-logits cross-entropy and its autodiff gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scaletrain.objectives.fused_loss import fused_head_loss
from scaletrain.objectives.loss import cross_entropy_sums

B, T, H, V = 2, 11, 8, 40


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    hidden = jnp.asarray(rng.normal(size=(B, T, H)), jnp.float32)
    kernel = jnp.asarray(rng.normal(size=(H, V)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, V, (B, T)))
    mask = jnp.asarray(rng.integers(0, 2, (B, T - 1)), jnp.float32)
    return hidden, kernel, ids, mask


def _plain(hidden, kernel, ids, mask, z_weight):
    s = cross_entropy_sums(hidden @ kernel, ids, mask)
    return s.loss + z_weight * s.z_loss, s


@pytest.mark.parametrize("chunk", [1, 3, 4, 11, 64])
@pytest.mark.parametrize("tied", [False, True])
def test_values_and_gradients_equal_autodiff(chunk, tied):
    """Any chunking (padded last chunk, one chunk, a chunk above T), separate or tied head, with z-loss."""
    hidden, kernel, ids, mask = _inputs()

    def fused(hd, k):
        return fused_head_loss(hd, k.T if tied else k, ids, mask, jnp.float32, chunk, 0.1, transposed=tied)

    (va, sa), ga = jax.value_and_grad(lambda hd, k: _plain(hd, k, ids, mask, 0.1), argnums=(0, 1),
                                      has_aux=True)(hidden, kernel)
    (vb, sb), gb = jax.jit(jax.value_and_grad(fused, argnums=(0, 1), has_aux=True))(hidden, kernel)
    np.testing.assert_allclose(vb, va, rtol=1e-6)
    for x, y in zip(sb, sa):
        np.testing.assert_allclose(x, y, rtol=1e-6)
    for x, y in zip(gb, ga):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)


def test_forward_only_gives_the_same_sums():
    """Outside differentiation (evaluation) no gradient is computed, and the sums are the same."""
    hidden, kernel, ids, mask = _inputs(1)
    value, sums = jax.jit(lambda: fused_head_loss(hidden, kernel, ids, mask, jnp.float32, 4, 0.0))()
    ref_value, ref = _plain(hidden, kernel, ids, mask, 0.0)
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    np.testing.assert_allclose(sums.correct, ref.correct)
    np.testing.assert_allclose(sums.tokens, jnp.sum(mask))


def test_cotangent_scales_the_gradient():
    """The objective is linear in the stored gradient: d(c * f) = c * df, as the train step's 1/tokens needs."""
    hidden, kernel, ids, mask = _inputs(2)
    g1 = jax.grad(lambda hd: fused_head_loss(hd, kernel, ids, mask, jnp.float32, 4)[0])(hidden)
    g3 = jax.grad(lambda hd: 3.0 * fused_head_loss(hd, kernel, ids, mask, jnp.float32, 4)[0])(hidden)
    np.testing.assert_allclose(g3, 3.0 * g1, rtol=1e-6)


def test_bfloat16_compute_keeps_float32_master_gradient():
    """bf16 compute: gradients come back in the master dtype and agree with bf16 autodiff."""
    hidden, kernel, ids, mask = _inputs(3)

    def fused(hd, k):
        return fused_head_loss(hd, k, ids, mask, jnp.bfloat16, 4)[0]

    def plain(hd, k):
        logits = (hd.astype(jnp.bfloat16) @ k.astype(jnp.bfloat16)).astype(jnp.float32)
        return cross_entropy_sums(logits, ids, mask).loss

    ga = jax.grad(plain, argnums=(0, 1))(hidden, kernel)
    gb = jax.grad(fused, argnums=(0, 1))(hidden, kernel)
    for x, y in zip(gb, ga):
        assert x.dtype == jnp.float32
        np.testing.assert_allclose(x, y, rtol=0.05, atol=0.05)
