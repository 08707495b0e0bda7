"""PPO with a value head: GAE, whitening and the clipped losses against the reference formulas written out here
in torch, the first step of a run at learning rate 0 against those formulas on the run's own rollout, and a tiny
run whose value loss falls.

The oracle follows, step by step:
- TRL's last ``PPOTrainer`` (huggingface/trl v0.19, ``trl/trainer/ppo_trainer.py``, ``PPOTrainer.train``): the
  per-token KL (``logr = ref - logprobs``; ``k1``: ``-logr``, ``k3``: ``(exp(logr) - 1) - logr``), the non-score
  reward ``-kl_coef * kl``, ``whiten_rewards``, the GAE loop, the whitened advantages, ``vf_losses1/2``,
  ``vf_loss = 0.5 * masked_mean(max)``, ``pg_losses/2``, ``pg_loss = masked_mean(max)``, the clip fractions,
  ``approxkl = 0.5 * diff²``; ``trl/trainer/utils.py`` ``masked_mean``, ``masked_var``, ``masked_whiten``;
- verl (``verl/trainer/ppo/core_algos.py``, ``compute_gae_advantage_return``) for where the score sits: on the
  completion's last token (verl's reward manager writes ``reward_tensor[i, valid_response_length - 1]``).
Float32 on both sides, differences of summation order only: 1e-5 relative, 1e-6 absolute (figures near 0).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from preference_testing import export, hf_reward_model, tiny_llama, word_tokenizer

torch = pytest.importorskip("torch")

PROMPTS = ["what is two plus three", "the sky colour", "say hello", "name a fruit", "count to four", "the dog",
           "is the cat a dog", "say goodbye"]
TOL = {"rtol": 1e-5, "atol": 1e-6}


# ---- the oracle (torch, float32) ------------------------------------------------------------------------------
def _masked_mean(values, mask):
    return (values * mask).sum() / mask.sum()


def _masked_var(values, mask):
    mean = _masked_mean(values, mask)
    variance = _masked_mean((values - mean) ** 2, mask)
    return variance * (mask.sum() / (mask.sum() - 1))  # unbiased, as TRL's masked_var


def _masked_whiten(values, mask, shift_mean=True):
    mean, var = _masked_mean(values, mask), _masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def oracle_gae(scores, logprobs, ref, values, mask, *, kl_coef, kl_estimator, whiten_rewards, gamma, lam):
    """TRL's PPOTrainer rollout phase, with verl's placement of the score (see the module docstring)."""
    t = {k: torch.tensor(np.asarray(v), dtype=torch.float32) for k, v in
         dict(scores=scores, logprobs=logprobs, ref=ref, values=values, mask=mask).items()}
    mask, pad = t["mask"], t["mask"] == 0
    logr = t["ref"] - t["logprobs"]
    kl = -logr if kl_estimator == "k1" else (logr.exp() - 1) - logr
    kl = torch.masked_fill(kl, pad, 0.0)
    rewards = -kl_coef * kl
    last = mask.sum(1).long() - 1
    rewards[torch.arange(len(last)), last] += t["scores"]
    if whiten_rewards:
        rewards = torch.masked_fill(_masked_whiten(rewards, mask, shift_mean=False), pad, 0.0)
    values = torch.masked_fill(t["values"], pad, 0.0)
    lastgaelam, reversed_ = 0, []
    width = rewards.shape[1]
    for i in reversed(range(width)):
        nextvalues = values[:, i + 1] if i < width - 1 else 0.0
        delta = rewards[:, i] + gamma * nextvalues - values[:, i]
        lastgaelam = delta + gamma * lam * lastgaelam
        reversed_.append(lastgaelam)
    advantages = torch.stack(reversed_[::-1], dim=1)
    returns = torch.masked_fill(advantages + values, pad, 0.0)
    advantages = torch.masked_fill(_masked_whiten(advantages, mask), pad, 0.0)
    figures = {"objective/kl": kl.sum(1).mean(), "objective/scores": t["scores"].mean(),
               "objective/non_score_reward": (-kl_coef * kl).sum(1).mean(),
               "objective/entropy": (-torch.masked_fill(t["logprobs"], pad, 0.0)).sum(1).mean()}
    figures["objective/rlhf_reward"] = figures["objective/non_score_reward"] + figures["objective/scores"]
    return advantages, returns, {k: float(v) for k, v in figures.items()}


def oracle_losses(new_logprobs, vpred, old_logprobs, old_values, advantages, returns, mask, *, cliprange,
                  cliprange_value, vf_coef):
    """TRL's PPOTrainer update on one mini-batch: the loss and its logged figures."""
    t = {k: torch.tensor(np.asarray(v), dtype=torch.float32) for k, v in
         dict(new=new_logprobs, vpred=vpred, old=old_logprobs, oldv=old_values, adv=advantages, ret=returns,
              mask=mask).items()}
    mask = t["mask"]
    vpredclipped = torch.clamp(t["vpred"], t["oldv"] - cliprange_value, t["oldv"] + cliprange_value)
    vf_losses1, vf_losses2 = (t["vpred"] - t["ret"]) ** 2, (vpredclipped - t["ret"]) ** 2
    vf_loss = 0.5 * _masked_mean(torch.max(vf_losses1, vf_losses2), mask)
    vf_clipfrac = _masked_mean((vf_losses2 > vf_losses1).float(), mask)
    logprobs_diff = t["new"] - t["old"]
    ratio = torch.exp(logprobs_diff)
    pg_losses, pg_losses2 = -t["adv"] * ratio, -t["adv"] * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    pg_loss = _masked_mean(torch.max(pg_losses, pg_losses2), mask)
    figures = {"loss": pg_loss + vf_coef * vf_loss, "loss/policy_avg": pg_loss, "loss/value_avg": vf_loss,
               "val/clipfrac_avg": vf_clipfrac,
               "policy/clipfrac_avg": _masked_mean((pg_losses2 > pg_losses).float(), mask),
               "policy/approxkl_avg": _masked_mean(0.5 * logprobs_diff ** 2, mask),
               "val/ratio": _masked_mean(ratio, mask)}
    return {k: float(v) for k, v in figures.items()}


# ---- the formulas on random arrays ---------------------------------------------------------------------------
def _random_rollout(seed=0, rows=5, width=7):
    rng = np.random.default_rng(seed)
    lengths = np.array([7, 3, 1, 5, 6])[:rows]
    mask = (np.arange(width)[None, :] < lengths[:, None]).astype(np.float32)
    logps = rng.normal(-2.0, 0.7, (rows, width)).astype(np.float32)
    return dict(scores=rng.normal(0.0, 1.5, rows).astype(np.float32), logprobs=logps,
                ref=(logps + rng.normal(0.0, 0.3, (rows, width))).astype(np.float32),
                values=rng.normal(0.0, 0.8, (rows, width)).astype(np.float32), mask=mask)


@pytest.mark.parametrize("kl_estimator,whiten_rewards,gamma,lam", [("k1", False, 1.0, 0.95), ("k3", True, 0.9, 0.8)])
def test_gae_whitening_and_clipped_losses_equal_trls_ppo_formulas(kl_estimator, whiten_rewards, gamma, lam):
    import jax.numpy as jnp

    from scaletrain.objectives.ppo import PPOObjective
    from scaletrain.objectives.ppo_loss import GAESpec

    r = _random_rollout()
    spec = GAESpec(gamma=gamma, lam=lam, token_kl_coef=0.05, kl_estimator=kl_estimator, whiten_rewards=whiten_rewards)
    batch = {"completion_mask": jnp.asarray(r["mask"]), "old_logps": jnp.asarray(r["logprobs"]),
             "ref_logps": jnp.asarray(r["ref"]), "values": jnp.asarray(r["values"])}
    formed, figures = spec.form(jnp.asarray(r["scores"]), batch)
    advantages, returns, want = oracle_gae(**r, kl_coef=0.05, kl_estimator=kl_estimator,
                                           whiten_rewards=whiten_rewards, gamma=gamma, lam=lam)
    np.testing.assert_allclose(np.asarray(formed["advantages"]), advantages.numpy(), **TOL)
    np.testing.assert_allclose(np.asarray(formed["returns"]), returns.numpy(), **TOL)
    for name, value in want.items():
        np.testing.assert_allclose(float(figures[name]), value, **TOL, err_msg=name)

    # one update later: a policy and a value head that moved, some tokens past either clip
    rng = np.random.default_rng(1)
    new = (r["logprobs"] + rng.normal(0.0, 0.3, r["mask"].shape)).astype(np.float32)
    vpred = (r["values"] + rng.normal(0.0, 0.4, r["mask"].shape)).astype(np.float32)
    objective = PPOObjective(cliprange=0.2, cliprange_value=0.2, vf_coef=0.1)
    loss, sums = objective.sums_from(jnp.asarray(new), jnp.zeros_like(jnp.asarray(new)), jnp.asarray(vpred),
                                     {**batch, **formed}, batch["completion_mask"])
    ours = objective.step_metrics(sums, max(sums["tokens"], 1.0))
    theirs = oracle_losses(new, vpred, r["logprobs"], r["values"], formed["advantages"], formed["returns"],
                           r["mask"], cliprange=0.2, cliprange_value=0.2, vf_coef=0.1)
    assert 0 < theirs["policy/clipfrac_avg"] < 1 and 0 < theirs["val/clipfrac_avg"] < 1  # both clips in play
    for name, value in theirs.items():
        np.testing.assert_allclose(float(ours[name]), value, **TOL, err_msg=name)


# ---- the trainer ----------------------------------------------------------------------------------------------
def length_reward(prompts, completions, **columns):
    """A score with spread on a random policy: the completion's characters, scaled."""
    return [len(c) / 10.0 for c in completions]


def _ppo_run(tmp_path, *, steps, learning_rate, capture=False, reward=length_reward, **options):
    import scaletrain as st
    from scaletrain.rl.ppo import PPOTrainer

    class Capturing(PPOTrainer):
        """Keeps the first rollout's batch as the update reads it (scores, old log-probs, values, reference)."""

        captured = None

        def _rollout(self, state, prompts, step):
            scored = super()._rollout(state, prompts, step)
            if self.captured is None:
                self.captured = {k: np.asarray(v) for k, v in scored.batch.items()}
            return scored

    tok = word_tokenizer(str(tmp_path / "tok"))
    args = st.PPOConfig(output_dir=str(tmp_path / "run"), total_batch_size=8, max_length=32,
                        learning_rate=learning_rate, scheduler="constant", max_training_steps=steps, log_steps=1,
                        save_at_end=False, progress_bar=False, report_to=(), seed=0, max_completion_length=6,
                        log_completions=False, **options)
    trainer = (Capturing if capture else PPOTrainer)(args=args, model=tiny_llama(seed=0),
                                                     train_dataset=[{"prompt": p} for p in PROMPTS],
                                                     processing_class=tok, reward_funcs=[reward])
    trainer.train()
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        records = [r for r in map(json.loads, f) if r.get("split") == "train"]
    return records, trainer


def test_first_step_at_learning_rate_0_equals_trls_ppo_formulas_on_its_own_rollout(tmp_path):
    """The run's first logged figures are the oracle's on the rollout the run sampled: the scores on the last
    tokens, the per-token KL to another reference model, GAE, whitening, both clipped losses (at learning rate 0
    the update's forward is the rollout's: ratio 1, the values where they were). The value head starts from a
    reward model's ``score.weight`` (``value_model``)."""
    from safetensors.numpy import load_file

    reference = export(tiny_llama(seed=11), str(tmp_path / "reference"))
    hf_reward_model(str(tmp_path / "rm"), seed=3)
    options = dict(kl_coef=0.1, kl_estimator="k3", gamma=0.9, lam=0.8, whiten_rewards=True, vf_coef=0.5,
                   num_ppo_epochs=1, reference=reference, value_model=str(tmp_path / "rm"))
    records, trainer = _ppo_run(tmp_path, steps=1, learning_rate=0.0, capture=True, **options)
    b = trainer.captured
    assert b["completion_mask"].sum() > 8 and np.std(b["rewards"]) > 0
    advantages, returns, want = oracle_gae(b["rewards"], b["old_logps"], b["ref_logps"], b["values"],
                                           b["completion_mask"], kl_coef=0.1, kl_estimator="k3", whiten_rewards=True,
                                           gamma=0.9, lam=0.8)
    want.update(oracle_losses(b["old_logps"], b["values"], b["old_logps"], b["values"], advantages, returns,
                              b["completion_mask"], cliprange=0.2, cliprange_value=0.2, vf_coef=0.5))
    assert want["objective/kl"] > 1e-3 and want["loss/value_avg"] > 1e-3  # a KL and a value loss to compare
    got = records[0]
    for name, value in want.items():
        # the update's forward and the rollout's: the same parameters in two programs, ~1e-7 apart per token
        np.testing.assert_allclose(got[name], value, rtol=1e-4, atol=1e-5, err_msg=name)
    head = np.asarray(trainer.model_state.params["score"]["kernel"])
    np.testing.assert_array_equal(head, load_file(str(tmp_path / "rm" / "model.safetensors"))["score.weight"].T)


def prompt_reward(prompts, completions, **columns):
    """A score the value of a prompt's first state can learn: the prompt's words, quartered (0.5 .. 1.25)."""
    return [len(p.split()) / 4.0 for p in prompts]


def test_a_tiny_ppo_run_learns_its_values(tmp_path):
    """Twelve rollouts of a one-sample-a-prompt PPO run at 1e-2 whose score depends on the prompt alone (no KL,
    γ = 1: every token's return is the score): the value loss of the last three updates is below a third of
    the first three's (the value head learns the returns)."""
    records, _ = _ppo_run(tmp_path, steps=12, learning_rate=1e-2, num_ppo_epochs=1, vf_coef=1.0, kl_coef=0.0,
                          reward=prompt_reward)
    values = [r["loss/value_avg"] for r in records]
    assert len(values) == 12 and np.mean(values[-3:]) < np.mean(values[:3]) / 3, values
    for name in ("loss/policy_avg", "policy/clipfrac_avg", "val/clipfrac_avg", "policy/approxkl_avg",
                 "policy/entropy_avg", "val/ratio", "objective/kl", "objective/scores", "objective/rlhf_reward",
                 "objective/non_score_reward", "reward", "rollout/logprob_diff_max"):
        assert name in records[0], name
