"""Cross-entropy: token weighting, masks, shifted targets, when to chunk (the chunked form: test_fused_loss.py)."""

import jax
import jax.numpy as jnp
import numpy as np

from scaletrain.objectives.loss import cross_entropy_sums, resolve_chunk_size, target_mask


def test_target_mask_respects_segments_and_loss_mask():
    ids = jnp.array([[5, 6, 7, 8, 9, 0]])
    seg = jnp.array([[1, 1, 2, 2, 2, 0]])
    lm = jnp.array([[1, 1, 1, 0, 1, 0]])
    # targets are positions 1..5: 6 (same seg), 7 (new doc: no), 8 (yes, but loss_mask 0), 9 (yes), pad (no)
    np.testing.assert_array_equal(target_mask(ids, seg, lm), [[1, 0, 0, 1, 0]])
    np.testing.assert_array_equal(target_mask(ids, seg, None), [[1, 0, 1, 1, 0]])


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


def test_auto_chunks_only_large_vocabularies():
    assert resolve_chunk_size("auto", 8192, 2048) is None
    assert resolve_chunk_size("auto", 128256, 2048) == 512
    assert resolve_chunk_size("auto", 32768, 256) == 256  # never longer than the sequence
    assert resolve_chunk_size(64, 8192, 256) == 64 and resolve_chunk_size(None, 128256, 2048) is None
