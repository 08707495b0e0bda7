"""Advantages from rewards, and the reward figures, as TRL 1.16's GRPO and RLOO trainers compute them.

Why here, on host arrays: rewards come from Python callables, one float (or None) per completion and
function; they are weighted into one reward per completion (``[N]``) on the host, and the objective's
estimator (``objectives/advantage_estimators.py``, pure JAX, the same function the device step runs)
makes them advantages. The figures TRL logs beside them (``reward``, ``reward_std``,
``rewards/<name>/mean`` and ``/std``, ``frac_reward_zero_std``) are read off the same arrays.

A reward function's ``None`` is NaN here and is left out of every mean and deviation (TRL's nan-aware
sums); a completion that no function scored gets advantage 0.

These host-side figures run the estimators' JAX functions on the host's CPU device
(:func:`on_host`): on a GPU the default device would take each of their dozen small eager ops as a
kernel launch and a transfer (measured on an H200: 12 ms of a 90 ms GRPO step).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from scaletrain.objectives.advantage_estimators import REWARD_SCALES, AdvantageSpec, nanmean, nanstd


@dataclasses.dataclass
class Advantages:
    """``advantages`` [N] float32 and the figures TRL logs beside them (``reward``, ``reward_std``,
    ``rewards/<name>/mean`` and ``/std``, ``frac_reward_zero_std``)."""

    advantages: np.ndarray
    rewards: np.ndarray  # [N] weighted sums, NaN where no function scored
    metrics: dict[str, float]


@contextlib.contextmanager
def on_host() -> Iterator[None]:
    """Eager JAX math in the block runs on this host's CPU device, whatever the default backend is."""
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        yield


def weighted_rewards(rewards_per_func: np.ndarray, weights: Sequence[float]) -> np.ndarray:
    """``sum_f w_f r_f`` per completion ignoring NaN, NaN where every function returned None."""
    r = np.asarray(rewards_per_func, np.float32)
    w = np.asarray(weights, np.float32)
    total = np.nansum(r * w[None, :], axis=1).astype(np.float32)
    return np.where(np.isnan(r).all(axis=1), np.float32(np.nan), total)


def reward_figures(rewards_per_func: np.ndarray, rewards: np.ndarray, shaped: np.ndarray, num_generations: int,
                   spread: str, names: Sequence[str] | None = None) -> dict[str, float]:
    """TRL's reward figures: per function, of the weighted ``rewards``, and the share of completions whose
    ``spread`` deviation (:data:`REWARD_SCALES`) of the ``shaped`` rewards the estimator read is 0."""
    with on_host():
        return _reward_figures(rewards_per_func, rewards, shaped, num_generations, spread, names)


def _reward_figures(rewards_per_func: np.ndarray, rewards: np.ndarray, shaped: np.ndarray, num_generations: int,
                    spread: str, names: Sequence[str] | None) -> dict[str, float]:
    r = np.asarray(rewards_per_func, np.float32)
    names = list(names) if names is not None else [f"reward_{i}" for i in range(r.shape[1])]
    metrics: dict[str, float] = {}
    for i, name in enumerate(names):
        metrics[f"rewards/{name}/mean"] = float(nanmean(jnp.asarray(r[:, i])))
        metrics[f"rewards/{name}/std"] = float(nanstd(jnp.asarray(r[:, i])))
    metrics["reward"] = float(nanmean(jnp.asarray(rewards)))
    metrics["reward_std"] = float(nanstd(jnp.asarray(rewards)))
    std = np.asarray(REWARD_SCALES[spread].std(jnp.asarray(shaped), int(num_generations)))
    # torch.isclose(std, 0) with its default tolerances; NaN is not close
    metrics["frac_reward_zero_std"] = float(np.mean((np.abs(std) <= 1e-8).astype(np.float32)))
    return metrics


def advantages_of(rewards_per_func: np.ndarray, weights: Sequence[float], num_generations: int,
                  spec: AdvantageSpec, names: Sequence[str] | None = None,
                  kl_rows: np.ndarray | None = None) -> Advantages:
    """The advantages of [N, F] rewards (NaN: skipped) with F functions of ``weights`` by ``spec``'s estimator;
    ``kl_rows`` [N]: each completion's summed sampler-vs-reference log-ratio, for an estimator that takes the KL
    off the reward (RLOO's ``beta``)."""
    r = np.asarray(rewards_per_func, np.float32)
    n, g = r.shape[0], int(num_generations)
    if n % g:
        raise ValueError(f"{n} completions do not make whole groups of num_generations={g}")
    rewards = weighted_rewards(r, weights)
    with on_host():
        kl = None if kl_rows is None else jnp.asarray(kl_rows)
        shaped = spec.shaped(jnp.asarray(rewards), kl)
        adv = np.asarray(spec(jnp.asarray(rewards), g, kl), np.float32)
    return Advantages(adv, rewards, reward_figures(r, rewards, np.asarray(shaped), g, spec.spread, names))


def group_advantages(rewards_per_func: np.ndarray, weights: Sequence[float], num_generations: int,
                     scale_rewards: str = "group", names: Sequence[str] | None = None) -> Advantages:
    """GRPO's advantages (``scale_rewards``: a :data:`REWARD_SCALES` name) of [N, F] rewards
    (:func:`advantages_of`)."""
    if scale_rewards not in REWARD_SCALES:
        raise ValueError(f"scale_rewards={scale_rewards!r} is not one of {list(REWARD_SCALES)}")
    return advantages_of(rewards_per_func, weights, num_generations,
                         AdvantageSpec.of("grpo", {"scale_rewards": scale_rewards}), names)
