"""What the flash-attention tests share: a model's loss and gradients against the einsum path's."""

from __future__ import annotations

import jax
import numpy as np


def assert_same_loss_and_grads(got: tuple[float, dict], want: tuple[float, dict]) -> None:
    """``(loss, gradient dict)`` of the kernel path equal to the einsum path's, in float32.

    The kernel computes the same arithmetic up to the online softmax's summation order (and,
    over sp, the sum of key/value gradients across devices): float32 rounding only, so 1e-5 on
    the loss; each gradient to 1e-4 relative, with an absolute floor of 4e-6 of its largest
    entry for entries that cancel to near zero. Why 4e-6: a weight's gradient sums one term per
    token (N = 192 to 256 in these tests), and a sum whose terms cancel keeps their rounding,
    about sqrt(N) x 1.2e-7 (float32's epsilon) ~ 2e-6 of the largest term; measured: 1.2e-6 of
    the largest entry in one of 32768 entries (Gemma 3's stacked layers, where XLA fuses the
    cond's branches apart from the unrolled layers).
    """
    (loss, grads), (ref_loss, ref_grads) = got, want
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=4e-6 * float(np.abs(b).max()),
                                   err_msg=jax.tree_util.keystr(path))
