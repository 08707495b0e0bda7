"""Gated DeltaNet's pieces (models/common/gated_delta_rule.py, linear_attention.py) against transformers' torch
fallbacks (``torch_chunk_gated_delta_rule``, ``torch_recurrent_gated_delta_rule``, ``causal_conv1d_fn``,
``Qwen3_5RMSNormGated``), and the restart at document boundaries that packed rows need.

Tolerances: the same float32 maths summed in other orders; outputs are O(0.3) and differ by at most
~4e-7 (measured), so 1e-5 absolute. Our own two forms (chunked, recurrent) agree to the same bound.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from scaletrain.models.common.gated_delta_rule import (
    causal_conv,
    chunk_gated_delta_rule,
    conv_state_after,
    recurrent_gated_delta_rule,
)
from scaletrain.models.common.linear_attention import GatedRMSNorm

torch = pytest.importorskip("torch")
qwen3_5 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")

ATOL = 1e-5
B, T, HK, HV, DK, DV = 2, 100, 2, 4, 16, 8  # 100: one whole chunk of 64 and a padded one


def _inputs(seed: int = 0, t: int = T) -> tuple[np.ndarray, ...]:
    """Random q, k [B, T, HK, DK], v [B, T, HV, DV], log decays g <= 0 and write strengths beta in (0, 1)."""
    r = np.random.RandomState(seed)
    q, k = (r.randn(B, t, HK, DK).astype(np.float32) for _ in range(2))
    v = r.randn(B, t, HV, DV).astype(np.float32)
    g = (-0.3 * np.abs(r.randn(B, t, HV))).astype(np.float32)
    beta = (1 / (1 + np.exp(-r.randn(B, t, HV)))).astype(np.float32)
    return q, k, v, g, beta


def _torch(*arrays: np.ndarray) -> list[torch.Tensor]:
    return [torch.from_numpy(a) for a in arrays]


def test_chunked_gated_delta_rule_equals_transformers_chunk_rule() -> None:
    """Outputs and final state, from zeros and from a given state, over a length that is not a whole number of
    chunks, with 2 key heads serving 4 value heads."""
    q, k, v, g, beta = _inputs()
    state = np.random.RandomState(1).randn(B, HV, DK, DV).astype(np.float32)
    for initial in (None, state):
        theirs, theirs_state = qwen3_5.torch_chunk_gated_delta_rule(
            *_torch(q, k, v, g, beta), initial_state=None if initial is None else torch.from_numpy(initial),
            output_final_state=True, use_qk_l2norm_in_kernel=True)
        ours, ours_state = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=initial)
        np.testing.assert_allclose(np.asarray(ours), theirs.numpy(), atol=ATOL)
        np.testing.assert_allclose(np.asarray(ours_state), theirs_state.numpy(), atol=ATOL)


def test_recurrent_steps_equal_transformers_recurrent_rule_and_our_chunked_form() -> None:
    """The decoding form, one token at a time from a prefilled state, equals transformers' recurrent rule and
    what the chunked form computes for the same tokens in one call (decoding continues the prefill)."""
    q, k, v, g, beta = _inputs(t=24)
    _, prefilled = chunk_gated_delta_rule(*(x[:, :16] for x in (q, k, v, g, beta)))
    rest = tuple(x[:, 16:] for x in (q, k, v, g, beta))
    state, steps = prefilled, []
    for i in range(8):
        out, state = recurrent_gated_delta_rule(*(x[:, i:i + 1] for x in rest), state)
        steps.append(np.asarray(out))
    theirs, theirs_state = qwen3_5.torch_recurrent_gated_delta_rule(
        *_torch(*rest), initial_state=torch.from_numpy(np.asarray(prefilled)), output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    np.testing.assert_allclose(np.concatenate(steps, axis=1), theirs.numpy(), atol=ATOL)
    np.testing.assert_allclose(np.asarray(state), theirs_state.numpy(), atol=ATOL)
    whole, whole_state = chunk_gated_delta_rule(q, k, v, g, beta)
    np.testing.assert_allclose(np.concatenate(steps, axis=1), np.asarray(whole)[:, 16:], atol=ATOL)
    np.testing.assert_allclose(np.asarray(state), np.asarray(whole_state), atol=ATOL)


def test_packed_documents_restart_the_recurrence_and_the_convolution() -> None:
    """A row of two documents (the boundary at 37, inside the first chunk of 64): the second document's
    outputs and the state it hands on are those of the document alone, whatever the first one holds, and
    the first document's are those of its own prefix."""
    q, k, v, g, beta = _inputs()
    doc = np.concatenate([np.ones((B, 37)), 2 * np.ones((B, T - 37))], axis=1).astype(np.int32)
    packed, packed_state = chunk_gated_delta_rule(q, k, v, g, beta, doc)
    alone, alone_state = chunk_gated_delta_rule(*(x[:, 37:] for x in (q, k, v, g, beta)))
    np.testing.assert_allclose(np.asarray(packed)[:, 37:], np.asarray(alone), atol=ATOL)
    np.testing.assert_allclose(np.asarray(packed_state), np.asarray(alone_state), atol=ATOL)
    prefix, _ = chunk_gated_delta_rule(*(x[:, :37] for x in (q, k, v, g, beta)))
    np.testing.assert_allclose(np.asarray(packed)[:, :37], np.asarray(prefix), atol=ATOL)

    x = np.random.RandomState(2).randn(B, T, 6).astype(np.float32)
    w = np.random.RandomState(3).randn(6, 4).astype(np.float32)
    conv_packed = np.asarray(causal_conv(x, w, doc))
    np.testing.assert_allclose(conv_packed[:, 37:], np.asarray(causal_conv(x[:, 37:], w)), atol=ATOL)
    np.testing.assert_allclose(conv_packed[:, :37], np.asarray(causal_conv(x[:, :37], w)), atol=ATOL)


def test_causal_conv_equals_transformers_depthwise_conv1d_and_its_decode_window() -> None:
    """The short convolution (silu after) equals transformers' ``causal_conv1d_fn``; continued one token at a
    time from the window :func:`conv_state_after` keeps, it gives the same outputs."""
    r = np.random.RandomState(4)
    x, w = r.randn(B, 30, 12).astype(np.float32), r.randn(12, 4).astype(np.float32)
    theirs = qwen3_5.causal_conv1d_fn(torch.from_numpy(x).transpose(1, 2), torch.from_numpy(w), None,
                                      activation="silu").transpose(1, 2).numpy()
    np.testing.assert_allclose(np.asarray(causal_conv(x, w)), theirs, atol=ATOL)
    window = conv_state_after(x[:, :20], None, None, 4)
    for t in range(20, 30):
        out = causal_conv(x[:, t:t + 1], w, None, window)
        np.testing.assert_allclose(np.asarray(out)[:, 0], theirs[:, t], atol=ATOL)
        window = conv_state_after(x[:, t:t + 1], None, window, 4)


def test_gated_rmsnorm_equals_transformers() -> None:
    """``weight * rms_norm(x) * silu(gate)`` with transformers' casts, on a weight away from one."""
    r = np.random.RandomState(5)
    x, gate = r.randn(3, 7, DV).astype(np.float32), r.randn(3, 7, DV).astype(np.float32)
    weight = (1 + 0.1 * r.randn(DV)).astype(np.float32)
    norm = GatedRMSNorm(DV, 1e-6, jnp.float32, jnp.float32)
    norm.weight[...] = jnp.asarray(weight)
    theirs = qwen3_5.Qwen3_5RMSNormGated(DV, eps=1e-6)
    with torch.no_grad():
        theirs.weight.copy_(torch.from_numpy(weight))
        want = theirs(torch.from_numpy(x), torch.from_numpy(gate)).numpy()
    np.testing.assert_allclose(np.asarray(norm(x, gate)), want, atol=ATOL)
