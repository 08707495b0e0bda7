"""Cross-entropy: token weighting, masks, and the chunked form equals the plain one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scaletrain.training.loss import chunked_cross_entropy_sums, cross_entropy_sums, target_mask


def test_target_mask_respects_segments_and_loss_mask():
    ids = jnp.array([[5, 6, 7, 8, 9, 0]])
    seg = jnp.array([[1, 1, 2, 2, 2, 0]])
    lm = jnp.array([[1, 1, 1, 0, 1, 0]])
    # targets are positions 1..5: 6 (same seg), 7 (new doc: no), 8 (yes, but loss_mask 0), 9 (yes), pad (no)
    np.testing.assert_array_equal(target_mask(ids, seg, lm), [[1, 0, 0, 1, 0]])
    np.testing.assert_array_equal(target_mask(ids, seg, None), [[1, 0, 1, 1, 0]])


@pytest.mark.parametrize("chunk", [1, 3, 8, 64])
def test_chunked_equals_plain_with_gradients(chunk):
    rng = np.random.default_rng(0)
    b, t, h, v = 2, 11, 8, 40
    hidden = jnp.asarray(rng.normal(size=(b, t, h)), jnp.float32)
    kernel = jnp.asarray(rng.normal(size=(h, v)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, v, (b, t)))
    mask = jnp.asarray(rng.integers(0, 2, (b, t - 1)), jnp.float32)

    def plain(hd, k):
        s = cross_entropy_sums(hd @ k, ids, mask)
        return s.loss + 0.1 * s.z_loss, s

    def chunked(hd, k):
        s = chunked_cross_entropy_sums(hd, k, ids, mask, jnp.float32, chunk)
        return s.loss + 0.1 * s.z_loss, s

    (va, sa), ga = jax.value_and_grad(plain, argnums=(0, 1), has_aux=True)(hidden, kernel)
    (vb, sb), gb = jax.value_and_grad(chunked, argnums=(0, 1), has_aux=True)(hidden, kernel)
    for x, y in zip(sa, sb):
        np.testing.assert_allclose(x, y, rtol=1e-5)
    for x, y in zip(ga, gb):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)


def test_tied_kernel_as_transposed_rhs():
    """A tied head passes the [vocab, hidden] embedding itself: same sums and gradients."""
    rng = np.random.default_rng(2)
    b, t, h, v = 2, 9, 8, 40
    hidden = jnp.asarray(rng.normal(size=(b, t, h)), jnp.float32)
    emb = jnp.asarray(rng.normal(size=(v, h)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, v, (b, t)))
    mask = jnp.ones((b, t - 1), jnp.float32)

    def loss(transposed):
        def f(hd, w):
            k = w if transposed else w.T
            return chunked_cross_entropy_sums(hd, k, ids, mask, jnp.float32, 4, transposed=transposed).loss
        return jax.value_and_grad(f, argnums=(0, 1))(hidden, emb)

    (va, ga), (vb, gb) = loss(False), loss(True)
    np.testing.assert_allclose(va, vb, rtol=1e-6)
    for x, y in zip(ga, gb):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def test_sums_match_a_sliced_reference():
    """Scoring every position and masking the last equals slicing logits[:, :-1]."""
    import optax

    rng = np.random.default_rng(3)
    b, t, v = 3, 7, 11
    logits = jnp.asarray(rng.normal(size=(b, t, v)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, v, (b, t)))
    mask = jnp.asarray(rng.integers(0, 2, (b, t - 1)), jnp.float32)
    s = cross_entropy_sums(logits, ids, mask)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:])
    np.testing.assert_allclose(s.loss, jnp.sum(ce * mask), rtol=1e-6)
    np.testing.assert_allclose(s.tokens, jnp.sum(mask))
    right = jnp.argmax(logits[:, :-1], -1) == ids[:, 1:]
    np.testing.assert_allclose(s.correct, jnp.sum(right * mask))
