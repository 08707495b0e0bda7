"""The GRPO step stays on the devices: only the completion ids (and per-row lengths, flags, advantages) reach the
host, and the trainer samples through the rollout interface, so another engine plugs in as an argument.

How host reads are seen: every read of the value of a ``jax.Array`` laid out over several devices
(``np.asarray``, ``jax.device_get``, ``float``, ``.item()``, ``.tolist()``) goes through ``ArrayImpl._value``;
the recorder wraps it for the duration of the trainer's ``run_training_step`` only (the loop's logging reads
the step's scalar metrics afterwards). A one-device CPU array is read through the buffer protocol instead,
which no Python hook sees, so the run is on a mesh of two devices, where every array of the step is laid out
over both (the control read below proves the recorder sees one). JAX's transfer guard is no help here: on
CPU a read is no transfer and the guard never fires.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from preference_testing import word_tokenizer
from test_grpo_trainer import PROMPTS, yes_reward

ROWS, COMPLETION = 32, 6  # completions a step, max_completion_length


def _tiny_on_two_devices(vocab: int):
    import jax

    from scaletrain.models import LlamaConfig, LlamaForCausalLM, create_sharded_model
    from scaletrain.parallel import create_mesh

    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         eos_token_id=1, pad_token_id=0, bos_token_id=None)
    mesh = create_mesh((1, 2, 1, 1, 1), devices=jax.devices()[:2])  # fsdp 2
    return create_sharded_model(LlamaForCausalLM, config, seed=0, mesh=mesh)[0]


class _Reads:
    """The (shape, dtype) of every array whose value is read on the host while ``on``, once per array (numpy
    asks an array for its value more than once in one ``np.asarray``)."""

    def __init__(self):
        self.on, self.seen, self.arrays = False, [], []

    def record(self, array) -> None:
        if self.on and not any(a is array for a in self.arrays):
            self.arrays.append(array)
            self.seen.append((tuple(array.shape), str(array.dtype)))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Three steps (fresh rollout, its reuse, a fresh one) with every per-token array the objective can declare
    (old log-probs for ``num_iterations=2``, the reference's for ``beta``), completions logged every step,
    sampled through an engine handed to the trainer; the host reads of each step recorded."""
    import jax
    from jax._src.array import ArrayImpl

    import scaletrain as st
    from scaletrain.generation import RolloutEngine, SamplingParams, StaticBatchEngine, stop_token_ids
    from scaletrain.rl.trainer import GRPOTrainer

    class CountingEngine:
        """Today's engine, counting the calls the trainer makes through the interface."""

        def __init__(self, inner: StaticBatchEngine):
            self.inner, self.sampling, self.calls = inner, inner.sampling, []

        def generate(self, state, prompts, *, num_generations=1, seed=0, step=0):
            self.calls.append((len(prompts), num_generations, step))
            return self.inner.generate(state, prompts, num_generations=num_generations, seed=seed, step=step)

    tmp = tmp_path_factory.mktemp("device_step")
    tok = word_tokenizer(str(tmp / "tok"))
    args = st.TrainingArguments(output_dir=str(tmp / "run"), total_batch_size=ROWS, max_length=32,
                                learning_rate=3e-2, scheduler="constant", max_training_steps=3, log_steps=1,
                                save_at_end=False, progress_bar=False, report_to=(), seed=0)
    opts = {"num_generations": 4, "max_completion_length": COMPLETION, "num_iterations": 2, "beta": 0.04,
            "log_completions_steps": 1}
    sampling = SamplingParams(max_completion_length=COMPLETION, stop_token_ids=stop_token_ids(tok, 1),
                              pad_token_id=tok.pad_token_id)
    engine = CountingEngine(StaticBatchEngine(sampling))
    assert isinstance(engine, RolloutEngine)
    trainer = GRPOTrainer(arguments=args, model=_tiny_on_two_devices(len(tok)), options=opts, tokenizer=tok,
                          dataset_train=[{"prompt": p} for p in PROMPTS], reward_funcs=[yes_reward],
                          rollout_engine=engine)
    assert trainer.rollout_engine is engine

    reads, value = _Reads(), ArrayImpl._value
    steps: list[list[tuple[tuple[int, ...], str]]] = []

    def recording(self):
        reads.record(self)
        return value.fget(self)

    step = trainer.run_training_step

    def recorded_step(state, batch):
        reads.on, reads.seen, reads.arrays = True, [], []
        try:
            return step(state, batch)
        finally:
            reads.on = False
            steps.append(reads.seen)

    trainer.run_training_step = recorded_step
    ArrayImpl._value = property(recording)
    try:
        trainer.train()
        # the recorder sees a per-token read when there is one: the control for every assertion below
        reads.on, reads.seen, reads.arrays = True, [], []
        np.asarray(trainer._scored.batch["completion_mask"])
        control, reads.on = reads.seen, False
    finally:
        ArrayImpl._value = value
    with open(tmp / "run" / "metrics.jsonl") as f:
        records = [r for r in map(json.loads, f) if r.get("split") == "train"]
    return steps, control, engine.calls, records, tmp / "run", jax


def test_a_grpo_step_reads_no_per_token_array_but_the_completion_ids_to_the_host(trained):
    steps, control, _, records, out, _ = trained
    assert control == [((ROWS, COMPLETION), "float32")]
    assert len(steps) == 3 and [("reward" in r) for r in records] == [True, False, True]
    for fresh, reads in zip((True, False, True), steps):
        per_token = [r for r in reads if len(r[0]) > 1]
        # a fresh rollout: its completion ids, to decode for the rewards; a reused one: nothing at all
        assert per_token == ([((ROWS, COMPLETION), "int32")] if fresh else []), reads
        # besides: per-row values (lengths, stop flags, the reward figures' [N] rewards, the advantages
        # completions.jsonl shows) and scalars, never anything wider
        assert all(shape in ((ROWS,), ()) for shape, _ in reads if len(shape) < 2), reads
        assert {((ROWS,), "int32"), ((ROWS,), "bool")} <= set(reads) if fresh else not reads, reads
    # the figures that used to be formed from host copies are still there, from the devices
    for r in records[::2]:
        assert 0.0 <= r["rollout/logprob_diff_mean"] <= r["rollout/logprob_diff_max"] <= 1e-5, r
    lines = [json.loads(x) for x in (out / "completions.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1] * ROWS + [3] * ROWS


def test_the_trainer_samples_through_the_rollout_engine_it_is_given(trained):
    _, _, calls, _, _, _ = trained
    # prompts per step (32 completions in groups of 4), the group size and the step: fresh rollouts only
    assert calls == [(8, 4, 1), (8, 4, 3)]


def test_the_score_program_sums_rloos_kl_rows_over_the_tokens_the_loss_counts():
    """RLOO's ``beta`` takes each completion's ``sum_t (policy_t - reference_t)`` off its reward, over the tokens the
    loss counts (a truncated completion's none, with ``mask_truncated_completions``), as TRL's ``RLOOTrainer``: the
    score program's ``kl_rows`` equal that sum of the trainer's forward of the policy and of a second random model
    as the reference, and the host reads the same array the update does. Tolerance: the same float32 forwards,
    compiled into one program or two (1e-5 absolute on sums of 5 log-ratios of order 1)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import SingleDeviceSharding

    from preference_testing import tiny_llama
    from scaletrain.generation import rollout_rows
    from scaletrain.objectives.token_logps import completion_token_stats
    from scaletrain.rl.step_programs import KL_ROWS, ScoreSpec, make_score_program
    from scaletrain.training.state import FrozenModel

    policy, reference = tiny_llama(0, layers=1), tiny_llama(1, layers=1)
    graphdef, params = nnx.split(policy)
    ref_graphdef, ref_params = nnx.split(reference)
    rng = np.random.default_rng(0)
    n, p, c = 4, 8, 5
    prompt_mask = (np.arange(p)[None, :] >= np.array([[3], [0], [5], [2]])).astype(np.int32)
    completion_mask = (np.arange(c)[None, :] < np.array([[5], [2], [4], [1]])).astype(np.int32)
    rollout = {"prompt_ids": rng.integers(2, 128, (n, p)).astype(np.int32) * prompt_mask, "prompt_mask": prompt_mask,
               "completion_ids": rng.integers(2, 128, (n, c)).astype(np.int32) * completion_mask,
               "completion_mask": completion_mask, "log_probs": np.zeros((n, c), np.float32),
               "lengths": completion_mask.sum(axis=1).astype(np.int32), "truncated": np.array([True, False, False, False])}
    one = SingleDeviceSharding(jax.devices()[0])
    spec = ScoreSpec(temperature=1.0, check_in_update=False, num_iterations=1, beta=0.05,
                     mask_truncated_completions=True, kl_rows=True)
    score = make_score_program(graphdef, spec, lambda rank: one, one)
    batch, _, for_host = score(params, None, FrozenModel(ref_params, ref_graphdef),
                               {k: jnp.asarray(v) for k, v in rollout.items()}, drop=0)
    rows = rollout_rows(*(jnp.asarray(rollout[k]) for k in ("prompt_ids", "prompt_mask", "completion_ids",
                                                            "completion_mask")))
    logps = [np.asarray(completion_token_stats(m, *rows, c, 1.0)[0]) for m in (policy, reference)]
    counted = completion_mask * ~rollout["truncated"][:, None]
    expected = np.sum((logps[0] - logps[1]) * counted, axis=1)
    np.testing.assert_allclose(np.asarray(batch[KL_ROWS]), expected, atol=1e-5, rtol=0)
    assert np.asarray(batch[KL_ROWS])[0] == 0.0 and np.abs(expected[1:]).min() > 1e-3  # truncated: no token counts
    np.testing.assert_array_equal(np.asarray(for_host[KL_ROWS]), np.asarray(batch[KL_ROWS]))
