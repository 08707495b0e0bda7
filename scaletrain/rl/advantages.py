"""Group advantages from rewards, and the reward figures, as TRL 1.16's GRPO trainer computes them.

Why on the host, in numpy: rewards come from Python callables, one float (or None) per
completion, and a batch holds a few hundred of them; the advantages then travel to the
device inside the GRPO batch.

The completions of prompt ``i`` are rows ``i * G .. i * G + G - 1`` (G = ``num_generations``).
A reward function's ``None`` is NaN here and is left out of every mean and deviation
(TRL's nan-aware sums); a completion that no function scored gets advantage 0.

- ``scale_rewards="group"``: ``A = (r - mean_group) / (std_group + 1e-4)``;
- ``"batch"``: the group mean, but the deviation of the whole batch;
- ``"none"``: ``A = r - mean_group`` (Dr. GRPO), the group deviation only read for
  ``frac_reward_zero_std``.

Deviations carry Bessel's correction (a single value has none: NaN), as ``trl.trainer.utils.nanstd``.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence

import numpy as np

SCALE_REWARDS = ("group", "batch", "none")
EPS = 1e-4


def nanstd(x: np.ndarray, axis: int | None = None) -> np.ndarray:
    """The standard deviation ignoring NaNs, with Bessel's correction (NaN with fewer than two values)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        mean = np.nanmean(x, axis=axis, keepdims=True)
        var = np.nanmean((x - mean) ** 2, axis=axis, keepdims=True)
    count = np.sum(~np.isnan(x), axis=axis, keepdims=True)
    var = np.where(count > 1, var * count / np.maximum(count - 1, 1), np.nan).astype(x.dtype)
    out = np.sqrt(var)
    return out.squeeze() if axis is None else out.squeeze(axis)


def _nanmean(x: np.ndarray, axis: int | None = None) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(x, axis=axis)


@dataclasses.dataclass
class Advantages:
    """``advantages`` [N] float32 and the figures TRL logs beside them (``reward``, ``reward_std``,
    ``rewards/<name>/mean`` and ``/std``, ``frac_reward_zero_std``)."""

    advantages: np.ndarray
    rewards: np.ndarray  # [N] weighted sums, NaN where no function scored
    metrics: dict[str, float]


def weighted_rewards(rewards_per_func: np.ndarray, weights: Sequence[float]) -> np.ndarray:
    """``sum_f w_f r_f`` per completion ignoring NaN, NaN where every function returned None."""
    r = np.asarray(rewards_per_func, np.float32)
    w = np.asarray(weights, np.float32)
    total = np.nansum(r * w[None, :], axis=1).astype(np.float32)
    return np.where(np.isnan(r).all(axis=1), np.float32(np.nan), total)


def group_advantages(rewards_per_func: np.ndarray, weights: Sequence[float], num_generations: int,
                     scale_rewards: str = "group", names: Sequence[str] | None = None) -> Advantages:
    """The advantages of [N, F] rewards (NaN: skipped) with F functions of ``weights`` (see the module docstring)."""
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards={scale_rewards!r} is not one of {list(SCALE_REWARDS)}")
    r = np.asarray(rewards_per_func, np.float32)
    n, g = r.shape[0], int(num_generations)
    if n % g:
        raise ValueError(f"{n} completions do not make whole groups of num_generations={g}")
    rewards = weighted_rewards(r, weights)
    grouped = rewards.reshape(-1, g)
    mean = np.repeat(_nanmean(grouped, axis=1), g)
    if scale_rewards == "batch":
        std = np.full(n, nanstd(rewards) if n > 1 else 0.0, np.float32)
    else:
        std = np.repeat(nanstd(grouped, axis=1), g) if g > 1 else np.zeros(n, np.float32)
    adv = rewards - mean
    if scale_rewards != "none":
        adv = adv / (std + np.float32(EPS))
    zero_std = np.abs(std) <= 1e-8  # torch.isclose(std, 0) with its default tolerances; NaN is not close
    adv = np.nan_to_num(adv.astype(np.float32), nan=0.0)
    names = list(names) if names is not None else [f"reward_{i}" for i in range(r.shape[1])]
    metrics: dict[str, float] = {}
    for i, name in enumerate(names):
        metrics[f"rewards/{name}/mean"] = float(_nanmean(r[:, i]))
        metrics[f"rewards/{name}/std"] = float(nanstd(r[:, i]))
    metrics["reward"] = float(_nanmean(rewards))
    metrics["reward_std"] = float(nanstd(rewards))
    metrics["frac_reward_zero_std"] = float(np.mean(zero_std.astype(np.float32)))
    return Advantages(adv, rewards, metrics)
