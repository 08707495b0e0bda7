"""GRPO's per-token terms, as TRL 1.16's ``GRPOTrainer._compute_loss`` defines them, on arrays.

Why apart from the objective: these are the formulas the TRL parity test checks one by one
(the ratio, its clipping, the k3 KL, the importance-sampling correction), and they do not
depend on where the log-probabilities came from. :class:`~scaletrain.objectives.grpo.GRPOObjective`
computes the log-probabilities with the model, calls :func:`per_token_terms`, and turns the
result into sums.

With ``logps``, ``old`` (the policy that sampled, or ``logps`` itself held constant) and
``ref`` per completion token, and ``A`` the completion's advantage:

- ``log_ratio = logps - old``; at ``importance_sampling_level="token"`` the weight is
  ``exp(log_ratio)`` per token, at ``"sequence"`` (GSPO) ``exp`` of its masked mean over the
  completion, one per row;
- ``loss_t = -min(w A, clip(w, 1 - epsilon, 1 + epsilon_high) A)`` (``delta``: ``w`` is also
  capped at ``delta``, two-sided clipping);
- times the importance-sampling ratio of sampler vs trainer when given (``vllm_importance_sampling_correction``);
- plus ``beta * kl_t``, ``kl_t = exp(ref - logps) - (ref - logps) - 1`` (k3), multiplied by
  ``w`` when ``use_bias_correction_kl``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from scaletrain.objectives.loss_aggregations import aggregation_names, get_aggregation

Array = jax.Array



def _token_log_weight(log_ratio: Array, mask: Array) -> Array:
    """One weight per token: its own log-ratio."""
    return log_ratio


def _sequence_log_weight(log_ratio: Array, mask: Array) -> Array:
    """One weight per completion (GSPO): the masked mean of its log-ratios, [N, 1]."""
    return (jnp.sum(log_ratio * mask, axis=-1) / jnp.maximum(jnp.sum(mask, axis=-1), 1.0))[:, None]


#: TRL's ``importance_sampling_level`` names -> the log-weight of each token (or completion)
IMPORTANCE_SAMPLING_LEVELS = {"token": _token_log_weight, "sequence": _sequence_log_weight}


@dataclasses.dataclass(frozen=True)
class ISMode:
    """A ``vllm_importance_sampling_mode``: one ratio per completion (``sequence_*``) or per token, and whether a
    ratio outside the range is dropped (``*_mask``: set to 0) or clamped into it (``*_truncate``)."""

    per_sequence: bool
    drops: bool


IS_MODES = {"token_truncate": ISMode(False, False), "token_mask": ISMode(False, True),
            "sequence_truncate": ISMode(True, False), "sequence_mask": ISMode(True, True)}


@dataclasses.dataclass(frozen=True)
class GRPOLossConfig:
    """The loss's options under TRL 1.16's names and defaults (``GRPOConfig``)."""

    loss_type: str = "dapo"
    importance_sampling_level: str = "token"
    epsilon: float = 0.2
    epsilon_high: float | None = None  # None: epsilon
    delta: float | None = None
    beta: float = 0.0
    use_bias_correction_kl: bool = True
    max_completion_length: int = 512  # dr_grpo's constant normaliser

    def __post_init__(self) -> None:
        if self.loss_type not in aggregation_names():
            raise ValueError(f"loss_type={self.loss_type!r} is not one of {list(aggregation_names())}")
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            raise ValueError(f"importance_sampling_level={self.importance_sampling_level!r} is not one of "
                             f"{list(IMPORTANCE_SAMPLING_LEVELS)}")

    @property
    def epsilon_low(self) -> float:
        return self.epsilon

    @property
    def epsilon_up(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


@dataclasses.dataclass
class TokenTerms:
    """What :func:`per_token_terms` returns: ``loss`` [N, C] (before masking), ``kl`` [N, C] (None when
    ``beta`` is 0), the weight ``coef`` ([N, C] or [N, 1]) and its clipped flags, shaped like it."""

    loss: Array
    kl: Array | None
    coef: Array
    low_clipped: Array
    high_clipped: Array


def per_token_terms(cfg: GRPOLossConfig, logps: Array, old: Array, advantages: Array, mask: Array,
                    ref: Array | None = None, is_ratio: Array | None = None) -> TokenTerms:
    """The per-token loss of completions [N, C] (see the module docstring); ``advantages`` [N]."""
    adv = advantages[:, None]
    log_ratio = logps - old
    coef = jnp.exp(IMPORTANCE_SAMPLING_LEVELS[cfg.importance_sampling_level](log_ratio, mask))
    kl = None
    if cfg.beta != 0.0:
        diff = ref - logps
        kl = jnp.exp(diff) - diff - 1.0
        if cfg.use_bias_correction_kl:
            kl = kl * coef
    clipped = jnp.clip(coef, 1.0 - cfg.epsilon_low, 1.0 + cfg.epsilon_up)
    capped = coef if cfg.delta is None else jnp.minimum(coef, cfg.delta)
    loss = -jnp.minimum(capped * adv, clipped * adv)
    if is_ratio is not None:
        loss = loss * is_ratio
    if kl is not None:
        loss = loss + cfg.beta * kl
    low = ((coef < 1.0 - cfg.epsilon_low) & (adv < 0)).astype(jnp.float32)
    high = ((coef > 1.0 + cfg.epsilon_up) & (adv > 0)).astype(jnp.float32)
    return TokenTerms(loss, kl, coef, low, high)


def loss_sum(cfg: GRPOLossConfig, per_token_loss: Array, mask: Array) -> Array:
    """The micro-batch's loss as a sum that the step divides by the batch's normaliser (:func:`normaliser_key`):
    the ``loss_type``'s entry of ``objectives/loss_aggregations.py``."""
    return get_aggregation(cfg.loss_type).fn(per_token_loss * mask, mask, cfg.max_completion_length)


def normaliser_key(loss_type: str) -> str:
    """What the summed loss is divided by: completions (``"sequences"``) or the whole batch's completion tokens
    (``"tokens"``, TRL's ``num_items_in_batch``), as the ``loss_type``'s aggregation declares."""
    return get_aggregation(loss_type).normaliser


def importance_sampling_ratio(trainer_logps: Array, sampler_logps: Array, mask: Array, mode: str,
                              clip_min: float | None, clip_max: float | None) -> Array:
    """TRL's truncated (or masked) importance-sampling correction of sampler vs trainer, [N, C] or [N, 1].

    ``exp(trainer - sampler)`` per token (``token_*``) or of its sum over the completion
    (``sequence_*``); ``*_truncate`` clamps it to ``[clip_min, clip_max]``, ``*_mask`` sets a ratio
    outside that range to 0 (the row or token then teaches nothing)."""
    if mode not in IS_MODES:
        raise ValueError(f"vllm_importance_sampling_mode={mode!r} is not one of {list(IS_MODES)}")
    how = IS_MODES[mode]
    diff = jnp.nan_to_num((trainer_logps - sampler_logps) * mask, nan=0.0)
    if how.per_sequence:
        diff = jnp.sum(diff, axis=-1, keepdims=True)
    ratio = jnp.exp(diff)
    if not how.drops:
        return jnp.clip(ratio, clip_min, clip_max)
    lo = -jnp.inf if clip_min is None else clip_min
    hi = jnp.inf if clip_max is None else clip_max
    return jnp.where((ratio < lo) | (ratio > hi), 0.0, ratio)
