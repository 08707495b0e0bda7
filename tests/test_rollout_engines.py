"""What every rollout engine keeps, whatever its schedule (tests/engine_testing.py lists the engines): rows come
back in request order, and a row's tokens and log-probs are the same run alone, in a full batch, or behind
other rows (for the continuous engine: in a slot that rows before it used and freed), greedy and sampled.

Written against the RolloutEngine interface only (``engine.generate(state, prompts, num_generations, seed,
step)``) on a TrainState of the tiny Llama (8-way fsdp, as the trainer holds it). A sampled row's draws are a
function of ``(seed, step, row, position)`` (the interface's contract), so sampled rows are compared at the
same row index with other neighbours; greedy rows at any index.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from scaletrain.generation import SamplingParams
from scaletrain.models.registry import AutoModelForCausalLM
from scaletrain.training.state import create_train_state
from engine_testing import ENGINE_NAMES, rollout_engines
from hf_testing import hf_model, save_hf

N = 12
#: an eighth of the tiny vocabulary (128) stops a row: sampled lengths from 1 to the cap, as RL's are
STOP = tuple(range(3, 19))
#: the same row's log-probs from programs of other batch shapes: XLA CPU may pick other matmul kernels by
#: shape, so float32 sums of ~10-magnitude logits can differ by a few ulps (measured: see the test's print)
LOGPROB_TOL = 1e-5


@pytest.fixture(scope="module")
def state(tmp_path_factory):
    folder = save_hf(hf_model("llama", seed=3), tmp_path_factory.mktemp("engines") / "hf")
    model = AutoModelForCausalLM.from_pretrained(folder)
    return create_train_state(model, optax.sgd(0.1), jax.tree.leaves(nnx.state(model))[0].sharding.mesh)


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rs = np.random.RandomState(seed)
    return [rs.randint(19, 128, n).tolist() for n in lengths]


def _rows(engine: str, state, prompts: list[list[int]], sampling: SamplingParams, generations: int = 1,
          seed: int = 3, step: int = 5) -> dict[str, np.ndarray]:
    out = rollout_engines()[engine](sampling).generate(state, prompts, num_generations=generations, seed=seed,
                                                       step=step)
    return {k: np.asarray(getattr(out, k)) for k in ("prompt_ids", "prompt_mask", "completion_ids",
                                                     "completion_mask", "log_probs", "lengths")}


def _assert_same_row(a: dict[str, np.ndarray], i: int, b: dict[str, np.ndarray], j: int) -> float:
    """Row ``i`` of ``a`` and row ``j`` of ``b``: the same tokens, mask and length; log-probs within
    :data:`LOGPROB_TOL`. Returns their largest difference."""
    for key in ("completion_ids", "completion_mask", "lengths"):
        np.testing.assert_array_equal(a[key][i], b[key][j], err_msg=key)
    diff = float(np.abs(a["log_probs"][i] - b["log_probs"][j]).max())
    assert diff <= LOGPROB_TOL, diff
    return diff


@pytest.mark.parametrize("engine", ENGINE_NAMES)
def test_rows_come_back_in_request_order(engine, state) -> None:
    """Prompt ``i``'s G completions are rows ``i*G .. i*G+G-1``: each row holds its own prompt (left-padded),
    and its greedy completion is the one that prompt gets alone."""
    prompts = _prompts([9, 3, 14, 6, 11], seed=0)  # lengths out of order: a scheduler by length would reorder
    greedy = SamplingParams(max_completion_length=N, temperature=0.0, stop_token_ids=STOP)
    batch = _rows(engine, state, prompts, greedy, generations=2)
    assert batch["completion_ids"].shape == (10, N)
    for row in range(10):
        mask = batch["prompt_mask"][row].astype(bool)
        assert batch["prompt_ids"][row][mask].tolist() == prompts[row // 2], row
        assert mask[-len(prompts[row // 2]):].all()  # left-padded: the prompt ends where the completion starts
    for i, prompt in enumerate(prompts):
        alone = _rows(engine, state, [prompt], greedy)
        for g in range(2):
            _assert_same_row(batch, 2 * i + g, alone, 0)


@pytest.mark.parametrize("engine", ENGINE_NAMES)
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_a_row_is_the_same_alone_in_a_full_batch_and_behind_other_rows(engine, temperature, state) -> None:
    """Row X alone, first in a full batch, and last behind 11 rows that stop early or run to the cap (with
    few slots, X runs in a slot they used): the same tokens and log-probs (sampled: at one row index)."""
    sampling = SamplingParams(max_completion_length=N, temperature=temperature, stop_token_ids=STOP)
    x = _prompts([7], seed=1)
    alone = _rows(engine, state, x, sampling)
    full = _rows(engine, state, x + _prompts([2, 16, 5, 9, 13, 4, 11], seed=2), sampling)
    behind_a = _rows(engine, state, _prompts([3, 15, 8, 1, 12, 6, 10, 2, 14, 5, 9], seed=4) + x, sampling)
    behind_b = _rows(engine, state, _prompts([16, 4, 13, 7, 2, 11, 5, 15, 3, 8, 12], seed=5) + x, sampling)
    assert len(set(behind_a["lengths"][:11].tolist())) > 1  # neighbours of different lengths: slots free unevenly
    diffs = [_assert_same_row(alone, 0, full, 0), _assert_same_row(behind_a, 11, behind_b, 11)]
    if temperature == 0.0:
        diffs.append(_assert_same_row(alone, 0, behind_a, 11))
    print(f"{engine}, temperature {temperature}: largest log-prob difference {max(diffs):.1e}")
    assert alone["completion_mask"][0].sum() > 0
