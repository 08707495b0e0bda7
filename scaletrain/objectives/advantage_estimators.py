"""Advantage estimators: a registry of pure JAX functions from per-completion rewards to advantages.

Why a registry of functions: GRPO, RLOO and REINFORCE++ differ only in how a completion's reward
becomes its advantage, so a variant is one decorated function (:func:`advantage_estimator`) and the
options it reads, not a copy of the rollout. Why JAX: the functions run inside the jitted GRPO step
(nothing but the ``[N]`` rewards crosses the host) and, eagerly, on host arrays too.

Every estimator has the signature ``estimator(rewards: f32[N], num_generations: int, options) -> f32[N]``.
The completions of prompt ``i`` are rows ``i * G .. i * G + G - 1`` (G = ``num_generations``).
A reward of NaN (no reward function scored the completion) is left out of every mean and deviation
(TRL's nan-aware sums) and its advantage is 0. Deviations carry Bessel's correction, as
``trl.trainer.utils.nanstd`` (NaN with fewer than two values).

- ``grpo`` (TRL's ``GRPOTrainer``): ``A = r - mean_group``, divided by ``std + 1e-4`` where the
  :data:`REWARD_SCALES` entry named by ``scale_rewards`` divides (``group``: the group's deviation,
  ``batch``: the whole batch's, ``none``: not at all, Dr. GRPO);
- ``rloo`` (TRL's ``RLOOTrainer``): ``A = r - mean of the group's other scored rewards`` (leave one
  out), then with ``normalize_advantages`` ``(A - mean_batch) / (std_batch + 1e-4)``;
- ``reinforce_pp`` (REINFORCE++, as OpenRLHF's ``reinforce_baseline`` / verl's
  ``reinforce_plus_plus_baseline``): ``r - mean_group`` (``group_baseline``, the default; off: ``r``
  itself, OpenRLHF's plain ``reinforce++``), then normalised over the whole batch,
  ``(A - mean_batch) / (std_batch + 1e-4)``. Those projects whiten per token (each token carries its
  sequence's return); with an outcome reward and no discount every token of a completion has the same
  advantage, and here each completion counts once, as TRL's batch normalisation counts them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from scaletrain.errors import ConfigError

Array = jax.Array
EPS = 1e-4
Estimator = Callable[[Array, int, Mapping[str, Any]], Array]


def nanmean(x: Array, axis: int | None = None) -> Array:
    """The mean ignoring NaNs (NaN where every value is NaN)."""
    count = jnp.sum(~jnp.isnan(x), axis=axis)
    return jnp.nansum(x, axis=axis) / count


def nanstd(x: Array, axis: int | None = None) -> Array:
    """The standard deviation ignoring NaNs, with Bessel's correction (NaN with fewer than two values)."""
    count = jnp.sum(~jnp.isnan(x), axis=axis, keepdims=True)
    mean = jnp.nansum(x, axis=axis, keepdims=True) / count
    var = jnp.nansum((x - mean) ** 2, axis=axis, keepdims=True) / count
    var = jnp.where(count > 1, var * count / jnp.maximum(count - 1, 1), jnp.nan)
    out = jnp.sqrt(var)
    return out.reshape(()) if axis is None else jnp.squeeze(out, axis)


# ---- reward scales (GRPO's scale_rewards) --------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RewardScale:
    """How ``scale_rewards`` spreads the rewards: ``std(rewards, G) -> f32[N]`` (what ``frac_reward_zero_std``
    reads, as TRL logs it) and whether the advantage is divided by it."""

    std: Callable[[Array, int], Array]
    divides: bool


def group_std(rewards: Array, g: int) -> Array:
    """Each completion's group deviation."""
    return jnp.repeat(nanstd(rewards.reshape(-1, g), axis=1), g)


def batch_std(rewards: Array, g: int) -> Array:
    """The whole batch's deviation, for every completion."""
    return jnp.broadcast_to(nanstd(rewards), rewards.shape)


#: TRL 1.16's ``scale_rewards`` modes, defined here once (the options validate against these names)
REWARD_SCALES: dict[str, RewardScale] = {
    "group": RewardScale(group_std, divides=True),
    "batch": RewardScale(batch_std, divides=True),
    "none": RewardScale(group_std, divides=False),
}


# ---- the registry ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class EstimatorEntry:
    """A registered estimator: its function and the options it reads, with their defaults."""

    name: str
    fn: Estimator
    defaults: tuple[tuple[str, Any], ...]


_ESTIMATORS: dict[str, EstimatorEntry] = {}


def advantage_estimator(name: str, **defaults: Any) -> Callable[[Estimator], Estimator]:
    """Register ``fn`` as the estimator ``name`` reading ``defaults``' options; a name twice is a programming error."""
    def register(fn: Estimator) -> Estimator:
        if name in _ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        _ESTIMATORS[name] = EstimatorEntry(name, fn, tuple(sorted(defaults.items())))
        return fn
    return register


def estimator_names() -> tuple[str, ...]:
    return tuple(sorted(_ESTIMATORS))


def get_estimator(name: str) -> EstimatorEntry:
    if name not in _ESTIMATORS:
        raise ConfigError(f"advantage estimator {name!r} is not one of {list(estimator_names())}")
    return _ESTIMATORS[name]


@dataclasses.dataclass(frozen=True)
class AdvantageSpec:
    """An estimator chosen with its option values, hashable so it can sit in an objective and a jitted step.

    ``reward_clip_range`` (RLOO's) clamps the weighted rewards first and ``kl_coef`` (RLOO's ``beta``) takes
    ``kl_coef * kl_rows`` (each completion's summed sampler-vs-reference log-ratio) off them, as TRL's
    ``RLOOTrainer`` does, before the estimator reads them; GRPO sets neither."""

    name: str = "grpo"
    options: tuple[tuple[str, Any], ...] = (("scale_rewards", "group"),)
    reward_clip_range: tuple[float, float] | None = None
    kl_coef: float = 0.0

    @classmethod
    def of(cls, name: str, options: Mapping[str, Any] | Any = (), **shaping: Any) -> "AdvantageSpec":
        """The spec of ``name`` with its options read from a mapping or an options object (defaults otherwise)."""
        entry = get_estimator(name)
        read = options.get if isinstance(options, Mapping) else lambda k, d: getattr(options, k, d)
        return cls(name, tuple((k, read(k, d)) for k, d in entry.defaults), **shaping)

    @property
    def spread(self) -> str:
        """The :data:`REWARD_SCALES` entry whose deviation ``frac_reward_zero_std`` reads (group unless GRPO's
        ``scale_rewards`` says otherwise)."""
        return dict(self.options).get("scale_rewards", "group")

    def shaped(self, rewards: Array, kl_rows: Array | None = None) -> Array:
        """The rewards the estimator reads: clamped to ``reward_clip_range``, less ``kl_coef * kl_rows``."""
        r = jnp.asarray(rewards, jnp.float32)
        if self.reward_clip_range is not None:
            r = jnp.clip(r, *self.reward_clip_range)
        if self.kl_coef != 0.0 and kl_rows is not None:
            r = r - self.kl_coef * jnp.asarray(kl_rows, jnp.float32)
        return r

    def __call__(self, rewards: Array, num_generations: int, kl_rows: Array | None = None) -> Array:
        """Advantages f32[N] of rewards f32[N] (NaN: unscored, advantage 0)."""
        r = self.shaped(rewards, kl_rows)
        if r.shape[0] % num_generations:
            raise ValueError(f"{r.shape[0]} completions do not make whole groups of num_generations={num_generations}")
        adv = get_estimator(self.name).fn(r, int(num_generations), dict(self.options))
        return jnp.nan_to_num(adv.astype(jnp.float32), nan=0.0)


    def form(self, rewards: Array, batch: Mapping[str, Any], num_generations: int,
             kl_rows: Array | None = None) -> tuple[dict[str, Array], dict[str, Array]]:
        """``({"advantages": [N]}, {})``: what a rollout's first update adds to its batch, and no figures (PPO's
        :class:`~scaletrain.objectives.ppo_loss.GAESpec` adds per-token advantages and returns, and figures)."""
        return {"advantages": self(rewards, num_generations, kl_rows)}, {}


def batch_normalised(adv: Array) -> Array:
    """``(A - mean) / (std + 1e-4)`` over the scored completions of the whole batch."""
    return (adv - nanmean(adv)) / (nanstd(adv) + EPS)


# ---- the estimators -------------------------------------------------------------------------------------------
@advantage_estimator("grpo", scale_rewards="group")
def grpo_advantages(rewards: Array, num_generations: int, options: Mapping[str, Any]) -> Array:
    """TRL's GRPO: the reward less its group's mean, scaled as ``scale_rewards`` says."""
    g = num_generations
    adv = rewards - jnp.repeat(nanmean(rewards.reshape(-1, g), axis=1), g)
    scale = REWARD_SCALES[options["scale_rewards"]]
    return adv / (scale.std(rewards, g) + EPS) if scale.divides else adv


@advantage_estimator("rloo", normalize_advantages=False)
def rloo_advantages(rewards: Array, num_generations: int, options: Mapping[str, Any]) -> Array:
    """TRL's RLOO: the reward less the mean of its group's other scored rewards (0/0 = NaN, advantage 0, when it
    is the only one), normalised over the batch with ``normalize_advantages``."""
    grouped = rewards.reshape(-1, num_generations)
    scored = jnp.sum(~jnp.isnan(grouped), axis=1, keepdims=True)
    baseline = (jnp.nansum(grouped, axis=1, keepdims=True) - grouped) / (scored - 1)
    adv = rewards - baseline.reshape(-1)
    return batch_normalised(adv) if options["normalize_advantages"] else adv


@advantage_estimator("reinforce_pp", group_baseline=True)
def reinforce_pp_advantages(rewards: Array, num_generations: int, options: Mapping[str, Any]) -> Array:
    """REINFORCE++: the reward (less its group's mean with ``group_baseline``) normalised over the whole batch."""
    g = num_generations
    adv = rewards
    if options["group_baseline"]:
        adv = rewards - jnp.repeat(nanmean(rewards.reshape(-1, g), axis=1), g)
    return batch_normalised(adv)
