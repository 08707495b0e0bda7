"""RLOO's advantages, loss and figures number for number with TRL 1.16's ``RLOOTrainer``, run here.

A real ``RLOOTrainer`` on the random tiny Llama of ``test_grpo_trl.py`` (its prompts, ragged fixed
completions and column reward with one ``None`` row), with ``beta`` > 0 and a reference that differs from
the policy (another random Llama), so the KL penalty on the reward is not 0. ``RLOOTrainer`` has no
``rollout_func``, so its one generation call (``_generate_single_turn``) returns the fixed completions;
everything after it is TRL's own code: the policy and reference forwards, the KL-shaped rewards, the
leave-one-out advantages, the figures, and ``_compute_loss``. Ours start from the same per-token
log-probabilities (TRL's, read through its ``_get_per_token_logps_and_entropies``) and rewards.

Tolerance as in ``test_grpo_trl.py``: float32 both sides, different summation orders over at most 48
tokens, so 1e-5 relative with a 1e-6 absolute floor (figures that can be 0).
"""

from __future__ import annotations

import numpy as np
import pytest

from preference_testing import export, tiny_llama, torch_model, word_tokenizer
from test_grpo_trl import COMPLETIONS, MAX_LEN, PROMPTS, SCORES, TEMPERATURE, G, column_reward

pytest.importorskip("trl")
pytestmark = pytest.mark.filterwarnings("ignore")
BETA = 0.05  # TRL's default


@pytest.fixture(scope="module")
def rloo_trainer(tmp_path_factory):
    from datasets import Dataset
    from trl import RLOOConfig, RLOOTrainer

    root = tmp_path_factory.mktemp("rloo_trl")
    tok = word_tokenizer(str(root / "tok"))
    folder, ref_folder = str(root / "policy"), str(root / "ref")
    export(tiny_llama(seed=0), folder)
    export(tiny_llama(seed=1), ref_folder)
    tok.save_pretrained(folder)
    dataset = Dataset.from_list([{"prompt": p, "score": 0.0} for p in PROMPTS])
    args = RLOOConfig(output_dir=str(root / "out"), per_device_train_batch_size=16, num_generations=G,
                      max_completion_length=MAX_LEN, beta=BETA, epsilon=0.2, epsilon_high=0.28, report_to="none",
                      temperature=TEMPERATURE, use_cpu=True, bf16=False, save_strategy="no", logging_steps=1, seed=0)
    trainer = RLOOTrainer(model=folder, reward_funcs=[column_reward], args=args, train_dataset=dataset,
                          processing_class=tok)
    # a reference unlike the policy (another random Llama's weights in TRL's own reference module): KL is not 0
    trainer.ref_model.load_state_dict(torch_model(ref_folder).state_dict())
    trainer._generate_single_turn = lambda prompt_ids, images, fields: [list(c) for c in COMPLETIONS]
    trainer.model.train()
    return trainer


def _close(ours, theirs, name):
    np.testing.assert_allclose(np.asarray(ours, np.float64), np.asarray(theirs, np.float64), rtol=1e-5, atol=1e-6,
                               err_msg=name)


@pytest.mark.parametrize("normalize,clip", [(False, None), (True, (0.0, 1.5))])
def test_rloo_loss_and_metrics_equal_trl_rloo_trainer(rloo_trainer, normalize, clip):
    import jax.numpy as jnp
    import torch

    from scaletrain.objectives.registry import build_objective
    from scaletrain.rl.advantages import advantages_of

    t = rloo_trainer
    t.normalize_advantages, t.reward_clip_range = normalize, clip
    t._metrics["train"].clear()
    out = t._generate_and_score_completions([{"prompt": PROMPTS[i // G], "score": SCORES[i]}
                                             for i in range(len(COMPLETIONS))])
    rollout_figures = {k: v[-1] for k, v in t._metrics["train"].items()}
    mask = out["completion_mask"]
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
    attention = torch.cat([out["prompt_mask"], mask], dim=1)
    with torch.no_grad():
        logps, entropy, _ = t._get_per_token_logps_and_entropies(t.model, ids, attention, mask.shape[1],
                                                                 compute_entropy=True)
        ref, _, _ = t._get_per_token_logps_and_entropies(t.ref_model, ids, attention, mask.shape[1])
    m = mask.numpy().astype(np.float32)

    # the recipe's objective (type: rloo) with TRL's options, its advantages from the same rewards and log-probs
    objective = build_objective("rloo", {"num_generations": G, "beta": BETA, "epsilon": 0.2, "epsilon_high": 0.28,
                                         "max_completion_length": MAX_LEN, "temperature": TEMPERATURE,
                                         "normalize_advantages": normalize, "reward_clip_range": clip})
    scores = np.array([[np.nan if s is None else s] for s in SCORES], np.float32)
    kl_rows = np.sum((logps.numpy() - ref.numpy()) * m, axis=1)
    assert np.abs(kl_rows).max() > 0.5  # the penalty moves the rewards
    adv = advantages_of(scores, [1.0], G, objective.advantages, ["column_reward"], kl_rows)
    _close(adv.advantages, out["advantages"].numpy(), "advantages")
    for name, value in adv.metrics.items():
        _close(value, rollout_figures[name], name)

    # one update's loss and figures, the old log-probabilities set away from the current ones so ratios clip
    g = torch.Generator().manual_seed(0)
    old = logps + 0.05 * torch.randn(logps.shape, generator=g)
    out["old_logps"] = (old * mask).sum(1)
    t._metrics["train"].clear()
    with torch.no_grad():
        trl_loss = float(t._compute_loss(t.model, out))
    figures = {k: v[-1] for k, v in t._metrics["train"].items()}
    batch = {"advantages": jnp.asarray(out["advantages"].numpy()), "old_logps": jnp.asarray(old.numpy()),
             "ref_logps": jnp.asarray(ref.numpy())}
    update = type(objective)(loss=objective.loss, num_iterations=2, advantages=objective.advantages)
    loss, sums = update.sums_from_logps(jnp.asarray(logps.numpy()), jnp.asarray(entropy.numpy()), batch,
                                        jnp.asarray(m))
    denom = jnp.maximum(sums[update.normaliser], 1.0)
    metrics = update.step_metrics(sums, denom)
    _close(float(loss / denom), trl_loss, "loss")
    for name in ("entropy", "clip_ratio/low_mean", "clip_ratio/low_min", "clip_ratio/high_mean",
                 "clip_ratio/high_max", "clip_ratio/region_mean"):
        _close(float(metrics[name]), figures[name], name)
    assert 0 < float(metrics["clip_ratio/region_mean"]) < 1  # some completions clip, some do not

    # kl: with one iteration the update's own forward stands for the sampling policy, as TRL's rollout reads it
    _, sums1 = objective.sums_from_logps(jnp.asarray(logps.numpy()), jnp.asarray(entropy.numpy()), batch,
                                         jnp.asarray(m))
    _close(float(objective.step_metrics(sums1, denom)["kl"]), rollout_figures["kl"], "kl")
