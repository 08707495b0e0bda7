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


def test_guards_agree_on_a_finite_update(tiny_config_kwargs):
    _, cond, _, m1 = _run(tiny_config_kwargs, (1, 1, 1, 1, 1), "cond", poison=False)
    before, where, _, m2 = _run(tiny_config_kwargs, (1, 1, 1, 1, 1), "where", poison=False)
    assert m1["nonfinite"] == m2["nonfinite"] == 0.0
    jax.tree.map(np.testing.assert_array_equal, cond, where)
    assert not np.array_equal(cond[0]["lm_head"]["kernel"], before[0]["lm_head"]["kernel"])
