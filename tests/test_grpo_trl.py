"""GRPO's advantages, loss and figures number for number with TRL 1.16's ``GRPOTrainer``, run here.

A real ``GRPOTrainer`` is built on a random tiny Llama (exported to a Hugging Face folder) with a
``rollout_func`` that returns fixed completions (ragged, some ending in EOS, some truncated), and a
reward function that reads a column (one ``None`` row, so the nan-aware path is exercised). TRL's
own ``_generate_and_score_completions`` computes the advantages and TRL's own ``_compute_loss`` the
loss and figures; we compute ours from the same per-token log-probabilities (TRL's, read through
its ``_get_per_token_logps_and_entropies``), the same old and reference log-probabilities (set
away from the current ones so the ratio is clipped and the KL is not 0) and the same masks, for
every ``loss_type`` x ``importance_sampling_level`` x ``scale_rewards``; and the sampler-vs-trainer
importance-sampling correction (TRL's vLLM path, fed sampler log-probs through ``rollout_func``) in its four modes.

Tolerance: both sides compute in float32 from the same inputs, with different summation orders
(torch vs numpy / XLA) over at most 48 tokens: ~1e-7 relative per value, so 1e-5 relative with a
1e-6 absolute floor for figures that can be 0 (clip ratios, advantages of zero-std groups).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from preference_testing import export, tiny_llama, word_tokenizer

pytest.importorskip("trl")
pytestmark = pytest.mark.filterwarnings("ignore")

G = 4
PROMPTS = ["what is two plus three", "the sky colour", "say hello", "name a fruit"]
# completions of the 16 rows (word ids); "</s>" = id 1 ends a reply, others run into max_completion_length
COMPLETIONS = [
    [5, 1], [6, 7, 8, 9, 10, 11], [12, 1], [13, 14, 1],
    [15, 16, 17, 1], [1], [18, 19, 20, 21, 22, 23], [24, 1],
    [25, 26, 1], [27, 28, 29, 30, 31, 32], [33, 1], [34, 35, 36, 1],
    [5, 6, 1], [7, 1], [8, 9, 10, 11, 12, 13], [14, 15, 16, 1],
]
# the reward column: group 2 has zero spread (frac_reward_zero_std), row 5 is unscored (None)
SCORES = [1.0, 0.0, 0.5, 2.0, 1.0, None, 3.0, 0.0, 0.7, 0.7, 0.7, 0.7, -1.0, 2.0, 0.5, 0.25]
MAX_LEN = 6
TEMPERATURE = 0.7  # TRL scores log-probabilities and entropies at the sampling temperature


def column_reward(prompts, completions, score, **kwargs):
    return list(score)


@pytest.fixture(scope="module")
def trl_trainer(tmp_path_factory):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    root = tmp_path_factory.mktemp("grpo_trl")
    tok = word_tokenizer(str(root / "tok"))
    folder = str(root / "policy")
    policy = tiny_llama(seed=0)
    export(policy, folder)
    tok.save_pretrained(folder)
    dataset = Dataset.from_list([{"prompt": p, "score": 0.0} for p in PROMPTS])

    def rollout_func(prompts, trainer):
        ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
        return {"prompt_ids": ids, "completion_ids": [list(c) for c in COMPLETIONS],
                "logprobs": [[0.0] * len(c) for c in COMPLETIONS]}

    args = GRPOConfig(output_dir=str(root / "out"), per_device_train_batch_size=16, num_generations=G,
                      max_completion_length=MAX_LEN, beta=0.04, epsilon=0.2, epsilon_high=0.28, report_to="none",
                      temperature=TEMPERATURE,
                      use_cpu=True, bf16=False, save_strategy="no", logging_steps=1, seed=0)
    trainer = GRPOTrainer(model=folder, reward_funcs=[column_reward], args=args, train_dataset=dataset,
                          processing_class=tok, rollout_func=rollout_func)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    trainer.jax_policy = policy
    return trainer


def _inputs():
    return [{"prompt": PROMPTS[i // G], "score": SCORES[i]} for i in range(len(COMPLETIONS))]



def _trl_token_logps(t, out):
    """TRL's own per-token log-probs and entropies of a scored rollout ``out`` (its trainer ``t``'s model)."""
    import torch

    mask = out["completion_mask"]
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
    attention = torch.cat([out["prompt_mask"], mask], dim=1)
    with torch.no_grad():
        logps, entropy, _ = t._get_per_token_logps_and_entropies(t.model, ids, attention, mask.shape[1],
                                                                 compute_entropy=True)
    return logps, entropy

def _close(ours, theirs, name):
    np.testing.assert_allclose(np.asarray(ours, np.float64), np.asarray(theirs, np.float64), rtol=1e-5, atol=1e-6,
                               err_msg=name)


@pytest.mark.parametrize("loss_type,level,scale", list(itertools.product(
    ("grpo", "bnpo", "dr_grpo", "dapo"), ("token", "sequence"), ("group", "batch", "none"))))
def test_grpo_matches_trl(trl_trainer, loss_type, level, scale):
    import jax.numpy as jnp
    import torch

    from scaletrain.objectives.grpo import GRPOObjective
    from scaletrain.objectives.grpo_loss import GRPOLossConfig
    from scaletrain.rl.advantages import group_advantages

    t = trl_trainer
    t.loss_type, t.importance_sampling_level, t.scale_rewards = loss_type, level, scale
    t._metrics["train"].clear()
    out = t._generate_and_score_completions(_inputs())

    # advantages and reward figures
    scores = np.array([[np.nan if s is None else s] for s in SCORES], np.float32)
    adv = group_advantages(scores, [1.0], G, scale, names=["column_reward"])
    _close(adv.advantages, out["advantages"].numpy(), "advantages")
    for name, value in adv.metrics.items():
        _close(value, t._metrics["train"][name][-1], name)

    # one step's loss and figures from the same log-probabilities
    mask = out["completion_mask"]
    logps, entropy = _trl_token_logps(t, out)
    g = torch.Generator().manual_seed(0)
    out["old_per_token_logps"] = logps + 0.3 * torch.randn(logps.shape, generator=g)
    out["ref_per_token_logps"] = logps + 0.5 * torch.randn(logps.shape, generator=g)
    t._metrics["train"].clear()
    with torch.no_grad():
        trl_loss = float(t._compute_loss(t.model, out))

    cfg = GRPOLossConfig(loss_type=loss_type, importance_sampling_level=level, epsilon=0.2, epsilon_high=0.28,
                         beta=0.04, max_completion_length=MAX_LEN)
    objective = GRPOObjective(loss=cfg, num_iterations=2)
    m = jnp.asarray(mask.numpy(), jnp.float32)
    batch = {"advantages": jnp.asarray(out["advantages"].numpy()),
             "old_logps": jnp.asarray(out["old_per_token_logps"].numpy()),
             "ref_logps": jnp.asarray(out["ref_per_token_logps"].numpy())}
    loss, sums = objective.sums_from_logps(jnp.asarray(logps.numpy()), jnp.asarray(entropy.numpy()), batch, m)
    denom = jnp.maximum(sums[objective.normaliser], 1.0)
    metrics = objective.step_metrics(sums, denom)
    _close(float(loss / denom), trl_loss, "loss")
    for name in ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
        _close(float(metrics[name]), t._metrics["train"][name][-1], name)
    assert float(metrics["clip_ratio/region_mean"]) > 0  # the perturbed old log-probs do clip


def test_mask_truncated_completions_masks_what_trl_masks(trl_trainer):
    from scaletrain.rl.batch import truncated_mask

    t = trl_trainer
    t.mask_truncated_completions = True
    try:
        out = t._generate_and_score_completions(_inputs())
    finally:
        t.mask_truncated_completions = False
    lengths = np.array([len(c) for c in COMPLETIONS])
    mask = (np.arange(MAX_LEN)[None, :] < lengths[:, None]).astype(np.int32)
    truncated = np.array([c[-1] != 1 for c in COMPLETIONS])
    np.testing.assert_array_equal(truncated_mask(mask, truncated), out["completion_mask"].numpy())


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_importance_sampling_correction_matches_trl(trl_trainer, mode):
    """TRL's sampler-vs-trainer correction (its vLLM path, fed our sampler's log-probs through rollout_func):
    the ratio, the logged difference and the corrected loss."""
    import jax.numpy as jnp
    import torch

    from scaletrain.objectives.grpo import GRPOObjective
    from scaletrain.objectives.grpo_loss import GRPOLossConfig, importance_sampling_ratio
    from scaletrain.rl.scoring import logprob_diff

    t = trl_trainer
    g = torch.Generator().manual_seed(1)
    # near a random 128-word policy's log(1/128) = -4.85, so some ratios fall inside [0.8, 1.25] and some outside
    sampler = [(-4.85 + 0.6 * (torch.rand(len(c), generator=g) - 0.5)).tolist() for c in COMPLETIONS]
    original = t.rollout_func

    def with_logprobs(prompts, trainer):
        return {**original(prompts, trainer), "logprobs": sampler}

    saved = (t.use_vllm, t.vllm_importance_sampling_correction, t.vllm_importance_sampling_mode,
             t.vllm_importance_sampling_clip_min, t.vllm_importance_sampling_clip_max, t.loss_type)
    t.rollout_func, t.use_vllm, t.vllm_importance_sampling_correction = with_logprobs, True, True
    t.vllm_importance_sampling_mode, t.vllm_importance_sampling_clip_min = mode, 0.8
    t.vllm_importance_sampling_clip_max, t.loss_type = 1.25, "dapo"
    t._last_loaded_step = t.state.global_step  # no vLLM weights to sync
    try:
        t._metrics["train"].clear()
        out = t._generate_and_score_completions(_inputs())
        mask = out["completion_mask"]
        trainer_logps = out["old_per_token_logps"].numpy()
        sampler_logps = out["sampling_per_token_logps"].numpy()
        ratio = importance_sampling_ratio(jnp.asarray(trainer_logps), jnp.asarray(sampler_logps),
                                          jnp.asarray(mask.numpy(), jnp.float32), mode, 0.8, 1.25)
        _close(np.asarray(ratio) * (mask.numpy() if mode.startswith("token") else 1),
               out["importance_sampling_ratio"].numpy() * (mask.numpy() if mode.startswith("token") else 1), "ratio")
        raw = np.exp((trainer_logps - sampler_logps) * mask.numpy())[mask.numpy() != 0]
        if mode.startswith("token"):  # the correction both keeps and bounds (or drops) some tokens
            assert ((raw > 0.8) & (raw < 1.25)).any() and ((raw < 0.8) | (raw > 1.25)).any()
        diff = logprob_diff(trainer_logps, sampler_logps, mask.numpy())
        _close(diff["rollout/logprob_diff_mean"], t._metrics["train"]["sampling/sampling_logp_difference/mean"][-1],
               "mean")
        _close(diff["rollout/logprob_diff_max"], t._metrics["train"]["sampling/sampling_logp_difference/max"][-1],
               "max")
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
        attention = torch.cat([out["prompt_mask"], mask], dim=1)
        with torch.no_grad():
            logps, entropy, _ = t._get_per_token_logps_and_entropies(t.model, ids, attention, mask.shape[1],
                                                                     compute_entropy=True)
        out["ref_per_token_logps"] = logps + 0.5 * torch.randn(logps.shape, generator=g)
        with torch.no_grad():
            trl_loss = float(t._compute_loss(t.model, out))
    finally:
        t.rollout_func = original
        (t.use_vllm, t.vllm_importance_sampling_correction, t.vllm_importance_sampling_mode,
         t.vllm_importance_sampling_clip_min, t.vllm_importance_sampling_clip_max, t.loss_type) = saved
    objective = GRPOObjective(loss=GRPOLossConfig(epsilon=0.2, epsilon_high=0.28, beta=0.04,
                                                  max_completion_length=MAX_LEN),
                              num_iterations=2, importance_sampling_correction=True)
    batch = {"advantages": jnp.asarray(out["advantages"].numpy()), "old_logps": jnp.asarray(trainer_logps),
             "ref_logps": jnp.asarray(out["ref_per_token_logps"].numpy()), "importance_sampling_ratio": ratio}
    loss, sums = objective.sums_from_logps(jnp.asarray(logps.numpy()), jnp.asarray(entropy.numpy()), batch,
                                           jnp.asarray(mask.numpy(), jnp.float32))
    _close(float(loss / jnp.maximum(sums[objective.normaliser], 1.0)), trl_loss, "loss")


def test_token_logps_and_entropy_match_trl_at_the_temperature(trl_trainer):
    """Our per-token forward (``completion_token_stats``, what the GRPO objective differentiates) on the same
    weights and rows as TRL's ``_get_per_token_logps_and_entropies``: left-padded prompts, right-padded
    completions, logits divided by the temperature. Float32 both sides; log-probs near -5: 1e-5 absolute."""
    import jax.numpy as jnp
    import torch

    from scaletrain.generation import rollout_rows
    from scaletrain.objectives.token_logps import completion_token_stats

    t = trl_trainer
    out = t._generate_and_score_completions(_inputs())
    mask = out["completion_mask"]
    logps, entropy = _trl_token_logps(t, out)
    rows = rollout_rows(*(jnp.asarray(out[k].numpy()) for k in ("prompt_ids", "prompt_mask", "completion_ids",
                                                               "completion_mask")))
    ours, our_entropy = completion_token_stats(t.jax_policy, *rows, mask.shape[1], TEMPERATURE)
    keep = mask.numpy() != 0
    np.testing.assert_allclose(np.asarray(ours)[keep], logps.numpy()[keep], atol=1e-5)
    np.testing.assert_allclose(np.asarray(our_entropy)[keep], entropy.numpy()[keep], atol=1e-5)
