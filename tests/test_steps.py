"""The train step's non-finite guard: a skipped update leaves params and optimizer state as they were."""

import jax
import numpy as np
import pytest

import scaletrain.training.steps as steps
from test_sharding import _batch, _setup


def _run(kw, dims, guard, poison):
    steps.GUARD = guard
    try:
        devices = jax.devices()[:1] if dims == (1, 1, 1, 1, 1) else None
        train, state, batch_sharding, mesh = _setup(kw, dims, devices)
        if poison:  # one NaN weight makes the loss and every gradient NaN
            emb = state.params["model"]["embed_tokens"]
            state = state.replace(params={**state.params, "model": {
                **state.params["model"], "embed_tokens": emb.at[0, 0].set(np.nan)}})
        before = jax.device_get((state.params, state.opt_state))
        with jax.set_mesh(mesh):
            new, metrics = train(state, jax.device_put(_batch(), batch_sharding))
        return before, jax.device_get((new.params, new.opt_state)), int(new.step), jax.device_get(metrics)
    finally:
        steps.GUARD = "auto"


@pytest.mark.parametrize("guard", ["cond", "where"])
@pytest.mark.parametrize("dims", [(1, 1, 1, 1, 1), (1, 2, 1, 4, 1)])
def test_nonfinite_update_is_skipped(tiny_config_kwargs, guard, dims):
    before, after, step, metrics = _run(tiny_config_kwargs, dims, guard, poison=True)
    assert metrics["nonfinite"] == 1.0 and step == 1
    jax.tree.map(np.testing.assert_array_equal, after, before)  # NaN compares equal to NaN here


#: one AdamW step moves an element by lr * g / (|g| + eps), about lr (1e-2 here, test_sharding._setup) wherever |g|
#: is well above eps; where |g| is near eps, the gradient's last-bit rounding (another fusion of the same sum) moves
#: that step by a fraction of lr: measured 5.1e-6 at most (the loop emitters), so 1e-3 * lr. A real difference
#: (another mask, another segment, a skipped update) moves elements by O(lr) and the loss by far more than 1e-6.
ADAM_ROUNDING = 1e-5


def test_guards_agree_on_a_finite_update(tiny_config_kwargs):
    _, cond, _, m1 = _run(tiny_config_kwargs, (1, 1, 1, 1, 1), "cond", poison=False)
    before, where, _, m2 = _run(tiny_config_kwargs, (1, 1, 1, 1, 1), "where", poison=False)
    assert m1["nonfinite"] == m2["nonfinite"] == 0.0
    # two programs (lax.cond, jnp.where): the same arithmetic, which XLA's CPU loop emitters (the suite's cheap
    # compile, tests/xla_testing.py) may fuse in another order; ADAM_ROUNDING bounds what that moves after one step
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=ADAM_ROUNDING), cond, where)
    assert not np.array_equal(cond[0]["lm_head"]["kernel"], before[0]["lm_head"]["kernel"])


@pytest.mark.parametrize("dims", [(1, 1, 1, 1, 1), (1, 2, 1, 1, 4)])
def test_token_only_batch_is_one_segment_per_row(tiny_config_kwargs, dims):
    """A batch of ``input_ids`` alone (what the loader gives for rows that are each one unpadded
    sequence) trains exactly as segment ids of ones and positions 0..T-1, also with the
    sequence split over devices (the causal mask is then made per shard)."""
    devices = jax.devices()[:1] if dims == (1, 1, 1, 1, 1) else None
    ids = _batch()["input_ids"]
    full = {"input_ids": ids, "segment_ids": np.ones_like(ids),
            "positions": np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape).copy()}
    results = []
    for batch in (full, {"input_ids": ids}):
        train, state, batch_sharding, mesh = _setup(tiny_config_kwargs, dims, devices)
        with jax.set_mesh(mesh):
            new, metrics = train(state, jax.device_put(batch, batch_sharding))
        results.append((jax.device_get(new.params), jax.device_get(metrics)))
    (want_params, want), (got_params, got) = results
    assert got["tokens"] == want["tokens"] == ids.size - ids.shape[0]
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-6)
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-5, atol=ADAM_ROUNDING), got_params, want_params)
