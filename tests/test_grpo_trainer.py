"""The GRPO step end to end on a tiny random Llama: the reward rises, sampler and trainer agree, rollouts are
reused with their old log-probs, the figures and completions.jsonl are written, and a batch that
num_generations does not divide is refused.

The reward is the share of a completion's words that are "yes": a random policy says "yes" about
1 time in 45, and GRPO at learning rate 3e-2 should make it the most likely word within a few
steps. Sampling is a pure function of (seed, step, row), and XLA on CPU is deterministic, so the
figures are the same on every run; the assertions leave wide margins anyway (mean reward of the
last 2 rollouts at least 3x the first 2's: measured 0.030 -> 0.21).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from preference_testing import one_device_mesh, word_tokenizer

PROMPTS = ["what is two plus three", "the sky colour", "say hello", "name a fruit", "count to four", "the dog",
           "is the cat a dog", "say goodbye"]


def yes_reward(prompts, completions, **columns):
    return [c.split().count("yes") / max(len(c.split()), 1) for c in completions]


def _tiny(vocab: int):
    from scaletrain.models import LlamaConfig, LlamaForCausalLM, create_sharded_model

    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         eos_token_id=1, pad_token_id=0, bos_token_id=None)
    return create_sharded_model(LlamaForCausalLM, config, seed=0, mesh=one_device_mesh())[0]  # compiles faster


def _run(tmp_path, steps=8, **options):
    import scaletrain as st
    from scaletrain.rl.trainer import GRPOTrainer

    tok = word_tokenizer(str(tmp_path / "tok"))
    args = st.TrainingArguments(output_dir=str(tmp_path / "run"), total_batch_size=32, max_length=32,
                                learning_rate=3e-2, scheduler="constant", max_training_steps=steps, log_steps=1,
                                save_at_end=False, progress_bar=False, report_to=(), seed=0)
    opts = {"num_generations": 4, "max_completion_length": 6, "log_completions_steps": 4, **options}
    trainer = GRPOTrainer(arguments=args, model=_tiny(len(tok)), options=opts, tokenizer=tok,
                          dataset_train=[{"prompt": p, "topic": i} for i, p in enumerate(PROMPTS)],
                          reward_funcs=[yes_reward])
    trainer.train()
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        records = [r for r in map(json.loads, f) if r.get("split") == "train"]
    return records, tmp_path / "run"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One run of 8 steps, each rollout used twice (num_iterations=2), with the KL to the starting policy."""
    return _run(tmp_path_factory.mktemp("grpo"), steps=8, num_iterations=2, beta=0.04)


def test_reward_rises_and_sampler_matches_trainer(run):
    records, out = run
    sampled = [r for r in records if "reward" in r]
    assert [r["step"] for r in sampled] == [1, 3, 5, 7]  # steps 2, 4, ... reuse the rollout before them
    rewards = [r["reward"] for r in sampled]
    assert np.mean(rewards[-2:]) >= 3 * max(np.mean(rewards[:2]), 0.02), rewards
    # float32 on one device: the sampler's log-probs are the trainer's forward's up to summation order
    assert max(r["rollout/logprob_diff_max"] for r in sampled) <= 1e-5
    first = records[0]
    for name in ("reward_std", "rewards/yes_reward/mean", "rewards/yes_reward/std", "frac_reward_zero_std",
                 "completions/mean_length", "completions/clipped_ratio", "entropy", "kl", "clip_ratio/region_mean",
                 "time/rollout", "time/reference", "time/rewards", "time/update", "rollout/tokens_per_s"):
        assert name in first, name
    lines = [json.loads(x) for x in (out / "completions.jsonl").read_text().splitlines()]
    # TRL's logging steps 4 and 8 train on the rollouts sampled at steps 3 and 7 (tests/test_log_appends.py)
    assert {r["step"] for r in lines} == {3, 7} and len(lines) == 2 * 32
    assert set(lines[0]) == {"step", "prompt", "completion", "rewards", "advantage"}


def test_one_iteration_checks_the_sampler_in_the_update(tmp_path):
    """With one iteration the update's forward (at the sampling parameters) gives rollout/logprob_diff_*, and the
    rollout runs no scoring forward of its own; float32 on one device: within 1e-5, as the separate forward."""
    records, _ = _run(tmp_path, steps=2, num_iterations=1)
    assert len(records) == 2
    for r in records:
        assert 0.0 <= r["rollout/logprob_diff_mean"] <= r["rollout/logprob_diff_max"] <= 1e-5, r


def test_prompt_padding_is_cut_without_moving_a_log_prob():
    """The engine pads prompts to a power of two; the update reads them cut to the longest rounded up to an eighth of
    that bucket (at least 8), and every completion token's log-prob is the padded rows' (float32: the same sums
    with masked terms left out, 1e-6 absolute)."""
    import jax
    import jax.numpy as jnp

    from scaletrain.generation import rollout_rows
    from scaletrain.objectives.token_logps import completion_token_stats
    from scaletrain.rl.batch import trim_prompt_padding

    rng = np.random.default_rng(1)
    n, p, c = 6, 64, 5
    lengths = rng.integers(3, 12, n)
    lengths[0] = 11  # the longest prompt: 11 tokens, kept as 16 columns
    prompt_mask = (np.arange(p)[None, :] >= (p - lengths)[:, None]).astype(np.int32)
    prompt_ids = (rng.integers(3, 48, (n, p)) * prompt_mask).astype(np.int32)
    completion_mask = (np.arange(c)[None, :] < rng.integers(1, c + 1, n)[:, None]).astype(np.int32)
    completion_ids = (rng.integers(3, 48, (n, c)) * completion_mask).astype(np.int32)
    ids, mask = trim_prompt_padding(prompt_ids, prompt_mask, int(lengths.max()))
    assert ids.shape == mask.shape == (n, 16)
    np.testing.assert_array_equal(mask.sum(axis=1), lengths)
    assert trim_prompt_padding(prompt_ids[:, -8:], prompt_mask[:, -8:], 8)[0].shape == (n, 8)  # nothing to cut
    model = _tiny(48)
    logps = jax.jit(lambda *rows: completion_token_stats(model, *rows, c)[0])
    full = logps(*rollout_rows(prompt_ids, prompt_mask, completion_ids, completion_mask))
    cut = logps(*rollout_rows(ids, mask, completion_ids, completion_mask))
    keep = jnp.asarray(completion_mask) != 0
    np.testing.assert_allclose(np.where(keep, cut, 0.0), np.where(keep, full, 0.0), atol=1e-6, rtol=0)


def test_reused_rollouts_move_the_ratio_and_the_kl(run):
    records, _ = run
    # a fresh rollout's old log-probs are the current policy's: ratio 1, nothing clipped; the reuse step after
    # an update sees the policy moved (clipping) and away from the reference (KL > 0)
    assert records[0]["kl"] == pytest.approx(0.0, abs=1e-6) and records[0]["clip_ratio/region_mean"] == 0.0
    assert all(r["clip_ratio/region_mean"] == 0.0 for r in records[2::2])
    assert all(r["clip_ratio/region_mean"] > 0.0 for r in records[1::2])
    assert records[-1]["kl"] > records[1]["kl"] > 0


def test_total_batch_size_must_be_whole_groups(tmp_path):
    import scaletrain as st
    from scaletrain.errors import ConfigError
    from scaletrain.rl.trainer import GRPOTrainer

    tok = word_tokenizer(str(tmp_path / "tok"))
    args = st.TrainingArguments(output_dir=str(tmp_path / "run"), total_batch_size=30, max_training_steps=1)
    with pytest.raises(ConfigError, match="total_batch_size=30 counts completions and must be a multiple of "
                                          "objective.num_generations=4"):
        GRPOTrainer(arguments=args, model=_tiny(len(tok)), options={"num_generations": 4}, tokenizer=tok,
                    dataset_train=[{"prompt": p} for p in PROMPTS], reward_funcs=[yes_reward])


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])  # a per-completion and a per-token normaliser
def test_micro_batches_give_the_whole_batch_loss_and_gradient(loss_type):
    """The objective's sums over two micro-batches, divided once by the summed normaliser, equal the whole batch's
    loss and gradient (completions of different lengths, so a per-micro-batch mean would differ). Float32 sums
    grouped differently: 1e-5 relative for the loss; per gradient entry 1e-4 relative, plus 1e-5 of the leaf's
    largest entry absolute (a sum's rounding error follows the size of its terms, not of the result: an entry
    1000x smaller than its leaf's largest was off by 2.7e-7 under XLA's cheap compile setting)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from scaletrain.generation import rollout_rows
    from scaletrain.objectives.grpo import GRPOObjective
    from scaletrain.objectives.grpo_loss import GRPOLossConfig

    model = _tiny(48)
    rng = np.random.default_rng(0)
    n, p, c = 8, 4, 5
    prompt_mask = (np.arange(p)[None, :] >= rng.integers(0, 3, n)[:, None]).astype(np.int32)  # left-padded
    lengths = rng.integers(1, c + 1, n)
    completion_mask = (np.arange(c)[None, :] < lengths[:, None]).astype(np.int32)
    ids, seg, pos = rollout_rows(jnp.asarray(rng.integers(3, 48, (n, p)) * prompt_mask), jnp.asarray(prompt_mask),
                                 jnp.asarray(rng.integers(3, 48, (n, c)) * completion_mask),
                                 jnp.asarray(completion_mask))
    batch = {"input_ids": ids, "segment_ids": seg, "positions": pos,
             "completion_mask": jnp.asarray(completion_mask, jnp.float32),
             "advantages": jnp.asarray(rng.normal(size=n), jnp.float32),
             "old_logps": jnp.asarray(-4 + 0.3 * rng.normal(size=(n, c)), jnp.float32)}
    objective = GRPOObjective(loss=GRPOLossConfig(loss_type=loss_type, max_completion_length=c), num_iterations=2)
    graphdef, params = nnx.split(model)

    def loss_and_sums(params, rows):
        return objective.loss_and_sums(nnx.merge(graphdef, params), rows, {})

    grad = jax.jit(jax.grad(loss_and_sums, has_aux=True))
    whole_grad, whole = grad(params, batch)
    halves = [grad(params, {k: v[i::2] for k, v in batch.items()}) for i in (0, 1)]
    denom = max(float(whole[objective.normaliser]), 1.0)
    assert sum(float(h[1][objective.normaliser]) for h in halves) == float(whole[objective.normaliser])
    np.testing.assert_allclose(sum(float(h[1]["loss"]) for h in halves) / denom, float(whole["loss"]) / denom,
                               rtol=1e-5)
    for g, a, b in zip(jax.tree.leaves(whole_grad), jax.tree.leaves(halves[0][0]), jax.tree.leaves(halves[1][0])):
        np.testing.assert_allclose(np.asarray(a) + np.asarray(b), np.asarray(g), rtol=1e-4,
                                   atol=1e-5 * float(np.abs(np.asarray(g)).max()))


@pytest.fixture(scope="module")
def shown(tmp_path_factory):
    """One 4-step run (each rollout used twice) with the progress bar on: its printed plan, its stderr (the bar)
    and its train records. The peak is given (1 TFLOP/s a device) so MFU is a fixed multiple of TFLOP/s."""
    import contextlib
    import io
    import logging

    import scaletrain as st
    from scaletrain.rl.trainer import GRPOTrainer

    tmp = tmp_path_factory.mktemp("grpo_shown")
    tok = word_tokenizer(str(tmp / "tok"))
    args = st.TrainingArguments(output_dir=str(tmp / "run"), total_batch_size=32, max_length=32,
                                learning_rate=3e-2, scheduler="constant", max_training_steps=4, log_steps=1,
                                save_at_end=False, progress_bar=True, report_to=(), seed=0,
                                peak_flops_per_device=1e12)
    trainer = GRPOTrainer(arguments=args, model=_tiny(len(tok)), tokenizer=tok, reward_funcs=[yes_reward],
                          options={"num_generations": 4, "max_completion_length": 6, "num_iterations": 2},
                          dataset_train=[{"prompt": p} for p in PROMPTS])
    logs, err = io.StringIO(), io.StringIO()
    handler = logging.StreamHandler(logs)
    log = logging.getLogger("scaletrain")
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        with contextlib.redirect_stderr(err):
            trainer.train()
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    with open(tmp / "run" / "metrics.jsonl") as f:
        records = [r for r in map(json.loads, f) if r.get("split") == "train"]
    return logs.getvalue(), err.getvalue(), records, [len(tok(p)["input_ids"]) for p in PROMPTS], len(tok)


def test_the_grpo_plan_prints_what_the_rollout_and_update_use(shown):
    """The plan's batch lines are the rollout's (prompts x completions, how often, the engine's rows, prompt
    lengths and bucket, the completion cap) and the update's (rows, their longest, micro-batches), not
    ``total_batch_size x max_length``, which GRPO does not read."""
    from scaletrain.rl.batch import kept_prompt_columns

    plan, _, _, lengths, _ = shown
    lo, hi = min(lengths), max(lengths)
    assert hi <= 16  # the word tokenizer's prompts: one 16-token bucket
    expected = [
        "  rollout         8 prompts x 4 completions = 32 rows, every 2 steps (num_iterations); engine batch 32 rows",
        f"                  prompts {lo}-{hi} tokens (padded to a bucket of at most 16), completions up to 6 tokens "
        "(objective.max_completion_length)",
        f"  update          32 rows x at most {kept_prompt_columns(16, hi) + 6} tokens (prompt + completion), "
        "1 micro-batch(es) of 32 rows; training.max_length (32) is not used by GRPO",
    ]
    lines = plan.splitlines()
    start = lines.index(expected[0])
    assert lines[start:start + 3] == expected
    assert not any(x.lstrip().startswith("batch ") for x in lines), plan


def test_the_grpo_progress_bar_shows_the_reward_between_rollouts(shown):
    """The bar shows the mean reward beside the loss, and keeps the last one on the steps that reuse a rollout
    (which log no reward): the last step here is such a step."""
    _, err, records, _, _ = shown
    assert "reward" not in records[-1] and "reward" in records[-2]
    final = err.rstrip().split("\r")[-1]
    assert f"reward={records[-2]['reward']:.3f}" in final and "loss=" in final, final


def test_grpo_mfu_counts_the_rollout_and_update_it_computed(shown):
    """``rollout/*`` on the steps that sample, ``update/*`` on every step, from the FLOPs each part computed:
    a reused rollout's update computes what its first update did; those FLOPs lie between the hand counts for
    completions of 1 and of 6 tokens; MFU is TFLOP/s over the given peak (1 TFLOP/s x 8 devices)."""
    _, _, records, lengths, vocab = shown
    sampled = [r for r in records if "reward" in r]
    assert [r["step"] for r in sampled] == [1, 3]
    done = [r["update/tflops"] * 1e12 * r["time/update"] for r in records]
    assert done[0] == pytest.approx(done[1], rel=1e-9) and done[2] == pytest.approx(done[3], rel=1e-9)
    # the tiny model by hand: per layer q 32x32, k and v 32x16, o 32x32, mlp 3 x 32x64, two norms of 32; a final
    # norm; head 32 x vocab; attention width 2 layers x 32
    body, width = 2 * (32 * 32 + 2 * 32 * 16 + 32 * 32 + 3 * 32 * 64 + 2 * 32) + 32, 2 * 32
    head = 32 * vocab

    def update(c):  # forward, input gradients, weight gradients (full fine-tune), every row with c tokens
        t = np.repeat(lengths, 4) + c
        return float(np.sum(6 * body * t + 6 * width * t * (t + 1) + 6 * head * c))

    assert update(1) < done[0] < update(6)
    for r in records:
        assert r["update/mfu"] == pytest.approx(r["update/tflops"] / 8, rel=1e-9)
        assert 0 < r["mfu"] < 1 and r["tflops"] > 0 and r["tokens_per_s"] > 0
    for r in sampled:
        assert r["rollout/mfu"] == pytest.approx(r["rollout/tflops"] / 8, rel=1e-9)
    assert all("rollout/mfu" not in r for r in records if "reward" not in r)
