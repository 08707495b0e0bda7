"""PPO's per-token pieces on arrays: the rewards of a rollout's tokens, GAE, whitening, the clipped losses.

Why apart from the objective: these are the formulas the oracle test checks step by step against the
reference ones written out in torch (TRL's last ``PPOTrainer``, ``trl/trainer/ppo_trainer.py`` and
``trl/core.py``'s ``masked_whiten``; verl's ``core_algos.compute_gae_advantage_return`` and
``compute_value_loss``), and none depends on where the log-probabilities and values came from.

With ``mask`` [N, C] 1 on the completion tokens the loss counts:

- the token rewards (:func:`token_rewards`): ``-kl_coef * kl_t`` on every token, ``kl_t`` the policy's
  log-ratio to the reference (``k1``: ``logp - ref``; ``k3``: ``(r - 1) - log r`` with ``r = exp(ref - logp)``),
  plus the completion's score on its last token (verl's placement; TRL's ``PPOTrainer`` put it one position
  after the last token, inside the padding, which the value of that padding then had to learn);
- ``whiten_rewards``: the token rewards whitened over the batch's tokens, their mean kept (TRL);
- GAE (:func:`gae`): ``δ_t = r_t + γ V_{t+1} - V_t``, ``A_t = δ_t + γ λ A_{t+1}`` from the last column back,
  values and rewards 0 outside the mask (so a row's advantages stop at its end); ``returns = A + V``; the
  advantages are then whitened over the batch's tokens (mean 0, unit variance; TRL and verl alike);
- the policy loss per token ``max(-A ρ, -A clip(ρ, 1 - ε, 1 + ε))``, ``ρ = exp(logp - old)`` (``cliprange`` ε);
- the value loss per token ``½ max((v - R)², (clip(v, V - εv, V + εv) - R)²)`` (``cliprange_value`` εv), TRL's
  and verl's clipped value loss with its ½.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

Array = jax.Array
KL_ESTIMATORS = ("k1", "k3")


def masked_mean(x: Array, mask: Array) -> Array:
    """The mean of ``x`` over ``mask``'s ones (the whole batch's)."""
    return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def masked_whiten(x: Array, mask: Array, shift_mean: bool = True) -> Array:
    """``(x - mean) / sqrt(var + 1e-8)`` over ``mask``'s ones, the variance with Bessel's correction (TRL's
    ``masked_whiten``); ``shift_mean`` False adds the mean back. Outside the mask: 0."""
    mean = masked_mean(x, mask)
    count = jnp.sum(mask)
    var = jnp.sum(((x - mean) ** 2) * mask) / jnp.maximum(count, 1.0)
    var = var * count / jnp.maximum(count - 1.0, 1.0)
    out = (x - mean) * jax.lax.rsqrt(var + 1e-8)
    if not shift_mean:
        out = out + mean
    return out * mask


def last_token(mask: Array) -> Array:
    """[N, C] one-hot of each row's last masked token (all 0 for a row with none)."""
    cols = jnp.arange(mask.shape[1])
    last = jnp.max(jnp.where(mask != 0, cols, -1), axis=1)
    return (cols[None, :] == last[:, None]).astype(jnp.float32)


def token_kl(logps: Array, ref_logps: Array, estimator: str) -> Array:
    """The per-token KL estimate of the policy to the reference (see the module docstring)."""
    if estimator == "k1":
        return logps - ref_logps
    log_r = ref_logps - logps
    return jnp.expm1(log_r) - log_r


def token_rewards(scores: Array, mask: Array, kl: Array | None, kl_coef: float) -> Array:
    """[N, C]: ``-kl_coef * kl`` per token plus the completion's score on its last token, 0 outside ``mask``."""
    rewards = scores[:, None] * last_token(mask)
    if kl is not None:
        rewards = rewards - kl_coef * kl * mask
    return rewards * mask


def gae(rewards: Array, values: Array, mask: Array, gamma: float, lam: float) -> tuple[Array, Array]:
    """``(advantages, returns)`` [N, C] by GAE over the completion tokens (module docstring), not whitened."""
    r, v = rewards * mask, values * mask

    def back(carry: tuple[Array, Array], x: tuple[Array, Array]) -> tuple[tuple[Array, Array], Array]:
        next_value, next_adv = carry
        r_t, v_t = x
        adv = r_t + gamma * next_value - v_t + gamma * lam * next_adv
        return (v_t, adv), adv

    zero = jnp.zeros(r.shape[0], jnp.float32)
    _, adv = jax.lax.scan(back, (zero, zero), (r.T, v.T), reverse=True)
    adv = adv.T * mask
    return adv, (adv + v) * mask


def policy_terms(logps: Array, old: Array, advantages: Array, cliprange: float) -> tuple[Array, Array, Array]:
    """``(loss, clipped, ratio)`` per token: the PPO-clip loss, where the clipped branch is the larger, the ratio."""
    ratio = jnp.exp(logps - old)
    plain = -advantages * ratio
    clipped = -advantages * jnp.clip(ratio, 1.0 - cliprange, 1.0 + cliprange)
    return jnp.maximum(plain, clipped), (clipped > plain).astype(jnp.float32), ratio


def value_terms(values: Array, old_values: Array, returns: Array, cliprange_value: float) -> tuple[Array, Array]:
    """``(loss, clipped)`` per token: the clipped value loss with its ½, where the clipped branch is the larger."""
    plain = (values - returns) ** 2
    clipped = (jnp.clip(values, old_values - cliprange_value, old_values + cliprange_value) - returns) ** 2
    return 0.5 * jnp.maximum(plain, clipped), (clipped > plain).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class GAESpec:
    """How a PPO rollout's ``[N]`` scores become per-token ``advantages`` and ``returns`` (TRL's ``PPOConfig``
    names): the rollout's first update calls :meth:`form` on the devices, as GRPO's estimators are called."""

    gamma: float = 1.0
    lam: float = 0.95
    token_kl_coef: float = 0.05  # PPOConfig's kl_coef: the KL penalty on each token's reward
    kl_estimator: str = "k1"
    whiten_rewards: bool = False
    #: what the GRPO rollout reads of an estimator: no per-row KL taken off the scores (RLOO's ``kl_coef``), the
    #: group spread ``frac_reward_zero_std`` reads
    kl_coef: ClassVar[float] = 0.0
    spread: ClassVar[str] = "group"

    def shaped(self, rewards: Array, kl_rows: Array | None = None) -> Array:
        """The scores as the rollout's figures read them: as they are (the KL is per token, in :meth:`form`)."""
        return jnp.asarray(rewards, jnp.float32)

    def form(self, scores: Array, batch: Any, num_generations: int = 1,
             kl_rows: Array | None = None) -> tuple[dict[str, Array], dict[str, Array]]:
        """``({"advantages", "returns"} [N, C], figures)`` of the scores [N] (NaN: unscored, 0) and the batch's
        ``completion_mask``, ``values`` and ``old_logps`` (and ``ref_logps`` with ``kl_coef``). The figures are
        TRL's ``objective/*`` of the rollout: per-completion sums averaged over completions."""
        mask = batch["completion_mask"].astype(jnp.float32)
        scores = jnp.nan_to_num(scores.astype(jnp.float32), nan=0.0)
        logps = batch["old_logps"].astype(jnp.float32)
        kl = None
        if self.token_kl_coef != 0.0:
            kl = token_kl(logps, batch["ref_logps"].astype(jnp.float32), self.kl_estimator) * mask
        rewards = token_rewards(scores, mask, kl, self.token_kl_coef)
        if self.whiten_rewards:
            rewards = masked_whiten(rewards, mask, shift_mean=False)
        advantages, returns = gae(rewards, batch["values"].astype(jnp.float32), mask, self.gamma, self.lam)
        rows = jnp.asarray(mask.shape[0], jnp.float32)
        kl_sum = jnp.zeros((), jnp.float32) if kl is None else jnp.sum(kl) / rows
        non_score = -self.token_kl_coef * kl_sum
        figures = {"objective/kl": kl_sum, "objective/entropy": -jnp.sum(logps * mask) / rows,
                   "objective/non_score_reward": non_score, "objective/scores": jnp.mean(scores),
                   "objective/rlhf_reward": non_score + jnp.mean(scores)}
        return {"advantages": masked_whiten(advantages, mask), "returns": returns}, figures
