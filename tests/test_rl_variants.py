"""GRPO's variants as registry entries: advantage estimators and loss aggregations under TRL's names, REINFORCE++
against an independent numpy computation, and the estimators inside a jitted step.

The numpy oracles here are written from the definitions (OpenRLHF's ``reinforce_baseline``, TRL's RLOO
and GRPO), not from our JAX code: float64 on the numpy side against float32 ours, 12 to 24 rewards of
order 1, so 1e-5 relative with a 1e-6 floor.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scaletrain.errors import ConfigError
from scaletrain.objectives.advantage_estimators import REWARD_SCALES, AdvantageSpec, estimator_names, get_estimator
from scaletrain.objectives.loss_aggregations import aggregation_names, get_aggregation

G = 4
REWARDS = np.array([1.0, 0.0, 0.5, 2.0, 1.0, np.nan, 3.0, 0.0, 0.7, 0.7, 0.7, 0.7,
                    -1.0, np.nan, np.nan, np.nan, 0.25, 0.5, -0.5, 1.5, 2.0, 2.0, 1.0, 0.0], np.float32)


def _close(ours, theirs):
    np.testing.assert_allclose(np.asarray(ours, np.float64), np.asarray(theirs, np.float64), rtol=1e-5, atol=1e-6)


def _std(x):
    """Bessel-corrected deviation of the non-NaN values (TRL's nanstd)."""
    x = x[~np.isnan(x)]
    return np.std(x, ddof=1) if len(x) > 1 else np.nan


def test_registries_hold_trls_names_and_scale_rewards_modes_once():
    assert aggregation_names() == ("grpo", "bnpo", "dr_grpo", "dapo")
    assert {n: get_aggregation(n).normaliser for n in aggregation_names()} == {
        "grpo": "sequences", "bnpo": "tokens", "dr_grpo": "sequences", "dapo": "tokens"}
    assert set(estimator_names()) >= {"grpo", "rloo", "reinforce_pp"}
    assert tuple(REWARD_SCALES) == ("group", "batch", "none")
    from scaletrain.objectives.grpo_options import GRPOOptions

    assert GRPOOptions(scale_rewards="batch").scale_rewards == "batch"
    with pytest.raises(ValueError, match="'groups' is not one of \\['group', 'batch', 'none'\\]"):
        GRPOOptions(scale_rewards="groups")
    with pytest.raises(ConfigError, match="advantage estimator 'ppo' is not one of"):
        get_estimator("ppo")


def test_reinforce_pp_advantage_equals_numpy_batch_normalisation():
    r = REWARDS.astype(np.float64)
    for baseline in (True, False):
        adv = r.copy()
        if baseline:  # OpenRLHF's reinforce_baseline: less the group's mean of the scored rewards
            for i in range(0, len(r), G):
                group = r[i:i + G]
                adv[i:i + G] = group - np.mean(group[~np.isnan(group)])
        scored = adv[~np.isnan(adv)]
        expected = np.nan_to_num((adv - scored.mean()) / (np.std(scored, ddof=1) + 1e-4), nan=0.0)
        ours = AdvantageSpec.of("reinforce_pp", {"group_baseline": baseline})(jnp.asarray(REWARDS), G)
        _close(ours, expected)
        keep = ~np.isnan(REWARDS)
        _close(np.mean(np.asarray(ours)[keep]), 0.0)  # mean 0 over the scored completions


def test_rloo_advantage_is_leave_one_out_of_the_scored_siblings():
    r = REWARDS.astype(np.float64)
    expected = np.zeros_like(r)
    for i in range(len(r)):
        group = range(i // G * G, i // G * G + G)
        others = [r[j] for j in group if j != i and not np.isnan(r[j])]
        expected[i] = 0.0 if np.isnan(r[i]) or not others else r[i] - np.mean(others)
    _close(AdvantageSpec.of("rloo")(jnp.asarray(REWARDS), G), expected)
    scored = np.where(np.isnan(r), np.nan, expected)
    scored[12] = np.nan  # the only scored completion of its group: 0/0, left out of the batch statistics as TRL
    kept = scored[~np.isnan(scored)]
    normalised = np.nan_to_num((scored - kept.mean()) / (np.std(kept, ddof=1) + 1e-4), nan=0.0)
    _close(AdvantageSpec.of("rloo", {"normalize_advantages": True})(jnp.asarray(REWARDS), G), normalised)
    # RLOO's reward shaping: clamped, then beta * KL taken off, before the leave-one-out baseline
    kl = np.linspace(-1.0, 2.0, len(r)).astype(np.float32)
    spec = AdvantageSpec.of("rloo", reward_clip_range=(0.0, 1.0), kl_coef=0.1)
    shaped = np.clip(REWARDS, 0.0, 1.0) - 0.1 * kl
    _close(spec(jnp.asarray(REWARDS), G, jnp.asarray(kl)), AdvantageSpec.of("rloo")(jnp.asarray(shaped), G))


def test_grpo_estimator_equals_numpy_for_every_scale_rewards():
    r = REWARDS.astype(np.float64)
    for scale in REWARD_SCALES:
        expected = np.zeros_like(r)
        for i in range(0, len(r), G):
            group = r[i:i + G]
            ok = group[~np.isnan(group)]
            std = {"group": _std(group), "batch": _std(r), "none": None}[scale]
            adv = group - ok.mean() if len(ok) else group
            expected[i:i + G] = adv if std is None else adv / (std + 1e-4)
        _close(AdvantageSpec.of("grpo", {"scale_rewards": scale})(jnp.asarray(REWARDS), G),
               np.nan_to_num(expected, nan=0.0))


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_pp"])
def test_estimators_trace_inside_jit_with_the_spec_static(name):
    """What the device step does: the spec is a static argument of a jitted function over device rewards."""
    spec = AdvantageSpec.of(name, reward_clip_range=(-0.5, 2.5), kl_coef=0.05)
    kl = jnp.linspace(0.0, 1.0, len(REWARDS))
    step = jax.jit(lambda s, r, k: s(r, G, k), static_argnums=0)
    traced = step(spec, jnp.asarray(REWARDS), kl)
    assert traced.dtype == jnp.float32 and traced.shape == REWARDS.shape and bool(jnp.all(jnp.isfinite(traced)))
    np.testing.assert_allclose(np.asarray(traced), np.asarray(spec(jnp.asarray(REWARDS), G, kl)), rtol=1e-6,
                               atol=1e-6)
    assert hash(spec) == hash(AdvantageSpec.of(name, reward_clip_range=(-0.5, 2.5), kl_coef=0.05))
