"""The rollout engine: its log-probs equal the trainer's forward, greedy equals transformers, stops, LoRA
unmerged on live parameters, one compile per bucket, and draws that are a pure function of (seed, step, row)."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jax.numpy as jnp

from scaletrain.generation import SamplingParams, engine_for, left_pad, rollout, rollout_rows
from scaletrain.generation.sampling import categorical
from scaletrain.models.registry import AutoModelForCausalLM
from scaletrain.objectives.token_logps import completion_token_stats
from scaletrain.peft.lora import LoRAConfig, apply_lora, merge_lora
from scaletrain.training.state import create_train_state
from hf_testing import hf_model, save_hf

torch = pytest.importorskip("torch")

N = 12
# float32 on one device: the cache path and the training forward sum the same products in another
# order (one query against the cache vs the whole row), a few ulps on logits of magnitude ~10
ONE_DEVICE_TOL = 1e-5
# over 8 devices (fsdp 2 x tp 4) the head and attention sums are also split into partial sums
# reduced across devices in another order: still float32 rounding, printed for the docs
SHARDED_TOL = 1e-4


def _prompts(lengths: tuple[int, ...] = (5, 9, 3), seed: int = 0) -> list[list[int]]:
    rs = np.random.RandomState(seed)
    return [rs.randint(3, 128, n).tolist() for n in lengths]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    return save_hf(hf_model("llama", seed=3), tmp_path_factory.mktemp("rollout") / "hf")


@pytest.fixture(scope="module")
def state(llama_dir):
    """A TrainState of the tiny Llama, as the trainer holds it (8-way fsdp, the default mesh)."""
    model = AutoModelForCausalLM.from_pretrained(llama_dir)
    return create_train_state(model, optax.sgd(0.1), jax.tree.leaves(nnx.state(model))[0].sharding.mesh)


def _trainer_log_probs(graphdef, params, frozen, out, temperature: float) -> np.ndarray:
    """The completion tokens' log-probs by the function GRPO's update and ``rollout/logprob_diff_*`` use."""
    @jax.jit
    def forward(params, frozen, prompt_ids, prompt_mask, completion_ids, completion_mask):
        model = nnx.merge(graphdef, params, *(() if frozen is None else (frozen,)))
        rows = rollout_rows(prompt_ids, prompt_mask, completion_ids, completion_mask)
        logps, _ = completion_token_stats(model, *rows, completion_ids.shape[1], temperature=temperature)
        return jnp.where(completion_mask != 0, logps, 0.0)

    return np.asarray(forward(params, frozen, out.prompt_ids, out.prompt_mask, out.completion_ids,
                              out.completion_mask))


def _logprob_diff(graphdef, params, frozen=None) -> float:
    sampling = SamplingParams(max_completion_length=N, temperature=0.7, top_k=40, stop_token_ids=(5,))
    out = rollout((graphdef, params, frozen), _prompts(), sampling, num_generations=2, seed=1, step=4)
    ours = np.asarray(out.log_probs)
    theirs = _trainer_log_probs(graphdef, params, frozen, out, 0.7)
    mask = np.asarray(out.completion_mask)
    assert mask.sum() > 20 and (ours[mask == 0] == 0).all()
    return float(np.abs(ours - theirs).max())


def test_log_probs_equal_the_trainers_forward_on_one_device(state) -> None:
    """What GRPO's ``rollout/logprob_diff_max`` checks: float32, one device, <= 1e-5."""
    one = jax.device_put((state.params, state.frozen), jax.devices()[0])
    diff = _logprob_diff(state.graphdef, *one)
    print(f"rollout/logprob_diff_max, float32, one device: {diff:.2e}")
    assert diff <= ONE_DEVICE_TOL


def test_log_probs_on_the_sharded_mesh(llama_dir) -> None:
    model = AutoModelForCausalLM.from_pretrained(llama_dir, sharding_axis_dims=(1, 2, 1, 4, 1))
    graphdef, params = nnx.split(model)
    with jax.set_mesh(jax.tree.leaves(params)[0].sharding.mesh):
        diff = _logprob_diff(graphdef, params)
    print(f"rollout/logprob_diff_max, float32, fsdp 2 x tp 4: {diff:.2e}")
    assert diff <= SHARDED_TOL


@pytest.mark.parametrize("lengths", [(4, 4), (7, 15, 2), (16, 17, 30)])  # buckets 16, 16 and 32
def test_greedy_equals_transformers_generate(llama_dir, state, lengths) -> None:
    ref = hf_model("llama", seed=3)
    prompts = _prompts(lengths, seed=len(lengths))
    ids, mask = left_pad(prompts)
    with torch.no_grad():
        theirs = ref.generate(torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask),
                              max_new_tokens=N, do_sample=False).numpy()[:, ids.shape[1]:]
    out = rollout(state, prompts, SamplingParams(max_completion_length=N, temperature=0.0))
    np.testing.assert_array_equal(np.asarray(out.completion_ids), theirs)
    assert (np.asarray(out.lengths) == N).all() and np.asarray(out.truncated).all()


def test_stop_tokens_and_max_length(state) -> None:
    greedy = SamplingParams(max_completion_length=N, temperature=0.0)
    free = np.asarray(rollout(state, _prompts(), greedy).completion_ids)
    stop = int(free[0, 3])
    out = rollout(state, _prompts(), SamplingParams(max_completion_length=N, temperature=0.0, stop_token_ids=(stop,),
                                                    pad_token_id=0))
    tokens, mask = np.asarray(out.completion_ids), np.asarray(out.completion_mask)
    for row in range(len(free)):
        hits = np.flatnonzero(free[row] == stop)
        length = int(hits[0]) + 1 if hits.size else N  # the stop token is part of the completion
        assert int(out.lengths[row]) == length and bool(out.truncated[row]) == (hits.size == 0)
        np.testing.assert_array_equal(tokens[row, :length], free[row, :length])
        assert (mask[row, :length] == 1).all() and (mask[row, length:] == 0).all()
        assert (tokens[row, length:] == 0).all()
    assert int(out.steps) == int(np.asarray(out.lengths).max())  # the loop ends when every row has stopped
    assert tokens.shape == (3, N)


def test_lora_adapters_run_unmerged_on_live_parameters(llama_dir) -> None:
    """The engine reads the TrainState's adapters and frozen base as they are (no merge, no copy): after
    the adapters change, the next rollout (same program) samples the new policy, which is the merged
    model's."""
    model = apply_lora(AutoModelForCausalLM.from_pretrained(llama_dir), LoRAConfig(rank=4, target_modules="all-linear"))
    st = create_train_state(model, optax.sgd(0.1), jax.tree.leaves(nnx.state(model))[0].sharding.mesh)
    sampling = SamplingParams(max_completion_length=N, temperature=0.0)
    before = np.asarray(rollout(st, _prompts(), sampling).completion_ids)
    # a step's worth of change to every lora_b (zero at start): the adapters now matter
    params = jax.tree_util.tree_map_with_path(
        lambda p, x: x + 0.5 * jax.random.normal(jax.random.key(len(str(p))), x.shape, x.dtype)
        if "lora_b" in str(p) else x, st.params)
    st = st.replace(params=params)
    traces = engine_for(st.graphdef, st.params, st.frozen).traces
    after = rollout(st, _prompts(), sampling)
    assert engine_for(st.graphdef, st.params, st.frozen).traces == traces  # no recompile for new values
    merged = merge_lora(st.model)
    assert not any("lora" in str(p) for p, _ in jax.tree_util.tree_flatten_with_path(nnx.state(merged))[0])
    expected = np.asarray(rollout(merged, _prompts(), sampling).completion_ids)
    np.testing.assert_array_equal(np.asarray(after.completion_ids), expected)
    assert not np.array_equal(before, expected)
    diff = _logprob_diff(st.graphdef, *jax.device_put((st.params, st.frozen), jax.devices()[0]))
    assert diff <= ONE_DEVICE_TOL  # the adapters' extra matmuls keep the sampler on the trainer's numbers


def test_compiled_once_per_bucket(state) -> None:
    engine = engine_for(state.graphdef, state.params, state.frozen)
    sampling = SamplingParams(max_completion_length=6, temperature=1.0, top_p=0.9)
    rollout(state, _prompts((5, 9, 3)), sampling, seed=0)
    traces = engine.traces
    rollout(state, _prompts((11, 2, 7, 13), seed=1), sampling, seed=1, step=3)  # prompt bucket 16, batch bucket 8
    assert engine.traces == traces
    rollout(state, _prompts((20,)), sampling)  # prompt bucket 32: a new program
    assert engine.traces == traces + 1


def test_draws_are_a_pure_function_of_seed_step_and_row(state) -> None:
    """A resumed run at step s samples what the uninterrupted run did; a row's draws do not depend on the
    other rows or the batch padding; another step draws anew."""
    sampling = SamplingParams(max_completion_length=N, temperature=1.0)
    three = np.asarray(rollout(state, _prompts(), sampling, seed=7, step=2).completion_ids)
    np.testing.assert_array_equal(three, np.asarray(rollout(state, _prompts(), sampling, seed=7, step=2).completion_ids))
    five = np.asarray(rollout(state, _prompts() + _prompts((6, 8), seed=9), sampling, seed=7, step=2).completion_ids)
    np.testing.assert_array_equal(five[:3], three)
    assert not np.array_equal(three, np.asarray(rollout(state, _prompts(), sampling, seed=7, step=3).completion_ids))
    groups = np.asarray(rollout(state, _prompts(), sampling, num_generations=2, seed=7, step=2).completion_ids)
    assert not np.array_equal(groups[0], groups[1])  # a prompt's generations differ from each other


def test_categorical_draws_follow_the_distribution() -> None:
    """The two-level inverse-CDF sampler: frequencies within 5 standard errors of softmax(logits) for 600
    tokens over three blocks (fixed keys: deterministic), and never a token of zero probability."""
    logits = jax.random.normal(jax.random.key(2), (600,)) * 2
    logits = logits.at[::7].set(-np.inf)
    probs = np.asarray(jax.nn.softmax(logits))
    n = 100_000
    draws = np.asarray(jax.jit(categorical)(jax.random.split(jax.random.key(3), n), jax.numpy.broadcast_to(logits,
                                                                                                          (n, 600))))
    freq = np.bincount(draws, minlength=600) / n
    assert (freq[probs == 0] == 0).all()
    assert (np.abs(freq - probs) <= 5 * np.sqrt(probs * (1 - probs) / n) + 1e-9).all()


@pytest.mark.parametrize("field,value,message", [
    ("max_completion_length", 0, "max_completion_length must be at least 1"),
    ("top_k", 0, "top_k must be at least 1"),
    ("top_p", 0.0, "top_p must be in"),
    ("temperature", -1.0, "temperature must be >= 0"),
])
def test_sampling_params_that_cannot_work_are_refused_by_name(field, value, message) -> None:
    kwargs = {"max_completion_length": 4, field: value}
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
