"""GRPO on two processes (`scaletrain launch --nproc 2`, one CPU device each) against one process with two CPU
devices: the same mesh (fsdp 2), so the same rollout, rewards, advantages and updates. Distillation (the student
samples on both processes, the teacher scores inside the step) and reward-model training (pairs split over the
processes) get one row each, with the same rule.

The recipe: 12 completions a step in groups of 4, so each process holds 6 rows and the middle prompt's group
straddles the two (its advantages need the other process's rewards); ``num_iterations=3`` with a checkpoint at
step 2, inside the first cycle, so the checkpoint stores the reused rollout (gathered from both processes: the
same record as one process's); ``beta > 0`` (a frozen reference).
The reward function notes how many completions each call scored, in which process, and raises where told to.

Tolerance: none. Both runs compile the same programs for the same 2-device mesh; the only sums across devices
are all-reduces of two operands, and ``a + b`` is ``b + a`` bit for bit, whether gloo adds them between
processes or XLA within one. So parameters (their sha256), losses, rewards and the completions file are equal
exactly (measured so), as the 1-device resume test's are.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from grpo_testing import tiny_grpo_recipe
from preference_testing import export, tiny_llama, word_tokenizer
from test_preference_resume import PAIRS
from test_jax_launch_runs import LIMIT_S, ROOT, _env, _kill_leftovers
from xla_testing import child_xla_flags

pytestmark = pytest.mark.slow
PROMPTS = ["what is two plus three", "the sky colour", "say hello", "name a fruit", "count to four", "the dog"]
REWARD = '''
import os
import time
import jax
from scaletrain.rl.rewards import format_regex

_hung = []

def words(prompts, completions, **columns):
    with open(os.path.join(os.environ["GRPO_CALLS"], f"{jax.process_index()}.txt"), "a") as f:
        f.write(f"{len(completions)}\\n")
    if os.environ["GRPO_FAIL"] == str(jax.process_index()):
        raise ValueError("no reward today")
    if os.environ.get("GRPO_HANG") == str(jax.process_index()) and not _hung:  # its first call sleeps for ever
        _hung.append(True)
        while True:
            time.sleep(1)
    return format_regex(prompts, completions, pattern=r"(?s).*\\b(yes|no|maybe|one|two)\\b.*")
'''


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo_launch")
    word_tokenizer(str(root / "tok"))
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    (root / "grpo_words.py").write_text(REWARD)
    recipe = tiny_grpo_recipe(str(root), {"total_batch_size": 12, "max_training_steps": 4, "save_steps": 2},
                              {"num_iterations": 3, "beta": 0.04, "reward_funcs": ["grpo_words:words"],
                               "log_completions_steps": 3})
    (root / "grpo.yaml").write_text(yaml.safe_dump(recipe))
    return root


def _run(work, name: str, *command: str, devices: int = 1, fail_in: str = "", hang_in: str = "", status: int = 0,
         overrides: tuple[str, ...] = (), recipe: str = "grpo.yaml") -> str:
    """Run ``recipe`` (``command``: ``train`` or ``launch ...``) into ``work/name``; ``fail_in``: the process
    whose reward raises, ``hang_in``: the one whose first reward call never returns; the text it printed, once it
    exited with ``status``."""
    out, calls = work / name, work / f"{name}-calls"
    calls.mkdir(exist_ok=True)
    env = _env(PYTHONPATH=os.pathsep.join([ROOT, str(work)]), GRPO_CALLS=str(calls), GRPO_FAIL=fail_in,
               GRPO_HANG=hang_in, XLA_FLAGS=child_xla_flags(devices))
    child = subprocess.Popen([sys.executable, "-m", "scaletrain", *command, str(work / recipe),
                              f"training.output_dir={out}", *overrides],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        text, _ = child.communicate(timeout=LIMIT_S)
    finally:
        _kill_leftovers(out)
    assert child.returncode == status, text[-4000:]
    return text


def _records(out) -> dict[int, tuple]:
    keys = ("loss", "kl", "reward", "rewards/words/mean", "reward_std", "completions/mean_length")
    return {r["step"]: tuple(r.get(k) for k in keys)
            for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["split"] == "train"}


def _calls(work, name: str) -> dict[str, list[int]]:
    folder = work / f"{name}-calls"
    return {p.stem: [int(x) for x in p.read_text().split()] for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def one(work):
    _run(work, "one", "train", devices=2)
    return work / "one"


@pytest.fixture(scope="module")
def two(work):
    _run(work, "two", "launch", "--nproc", "2", "--kill-after", "10")
    return work / "two"


def test_two_processes_sample_score_and_learn_as_one_process(work, one, two):
    ours, ref = json.loads((two / "summary.json").read_text()), json.loads((one / "summary.json").read_text())
    assert (ours["process_count"], ref["process_count"], ours["final_step"]) == (2, 1, 4)
    assert ours["params_sha256"] == ref["params_sha256"]
    records = _records(two)
    assert records == _records(one) and sorted(records) == [1, 2, 3, 4]
    assert [s for s, r in sorted(records.items()) if r[2] is not None] == [1, 4]  # a rollout every 3 steps
    assert (two / "completions.jsonl").read_text() == (one / "completions.jsonl").read_text()
    # each process scored its own 6 rows of each of the 2 rollouts; one process scored all 12
    assert _calls(work, "two") == {"0": [6, 6], "1": [6, 6]} and _calls(work, "one") == {"0": [12, 12]}
    # the checkpoint of step 2 (inside the first cycle) stores the whole rollout of step 1, gathered from both
    # processes: the very record one process stores, so it resumes on either process count as test_grpo_resume's
    stored = [json.loads((run / "checkpoints" / "2" / "data" / "metadata").read_text())["train"] for run in (two, one)]
    assert stored[0]["repeat"] == 2 and stored[0]["rollout"] == stored[1]["rollout"]


def test_a_reward_raising_in_one_process_stops_both_at_once(work):
    """Process 1's reward raises: it names the function and the row (its number in the whole batch), process 0,
    told through the step's failure flags, stops too, instead of waiting for it in the next collective."""
    text = _run(work, "failing", "launch", "--nproc", "2", "--kill-after", "10", fail_in="1", status=2)
    errors = [x for x in text.splitlines() if "scaletrain: error:" in x]
    assert any(x.startswith("[1] scaletrain: error: reward function 'words' raised on row 6 (prompt ") and
               x.endswith("ValueError: no reward today") for x in errors), errors
    assert "[0] scaletrain: error: a reward function raised in process 1 (its log names it and the row); process 0 " \
           "stops too" in errors, errors


def test_a_reward_hanging_in_one_process_times_out_there_and_both_go_on(work):
    """Process 1's first reward call never returns: after reward_timeout its 6 rows score None (counted in
    rewards/words/timeouts, the same figure on both processes since it is gathered with the rewards), and both
    processes train on to the horizon, process 0 never waiting for ever in the gather."""
    _run(work, "hanging", "launch", "--nproc", "2", "--kill-after", "10", hang_in="1",
         overrides=("objective.reward_timeout=5",))  # far above a call's microseconds
    records = [r for r in map(json.loads, (work / "hanging" / "metrics.jsonl").read_text().splitlines())
               if r["split"] == "train" and "reward" in r]
    assert [(r["step"], r["rewards/words/timeouts"]) for r in records] == [(1, 6.0), (4, 0.0)]
    assert json.loads((work / "hanging" / "summary.json").read_text())["final_step"] == 4
    assert _calls(work, "hanging") == {"0": [6, 6], "1": [6, 6]}


#: per objective, the logged figures that must be equal across process counts
FIGURES = {"distillation": ("loss", "entropy", "completions/mean_length"),
           "reward": ("loss", "accuracy", "margin", "mean_reward")}


@pytest.fixture(scope="module")
def other_recipes(work):
    """``distillation.yaml`` (6 prompts a step, 3 a process, a one-layer teacher folder of the tokenizer's vocabulary)
    and ``reward.yaml`` (8 pairs a step in 2 micro-batches, so 2 pairs a micro-batch a process) over ``work``."""
    export(tiny_llama(seed=5, layers=1), str(work / "teacher"))
    distill = tiny_grpo_recipe(str(work), {"total_batch_size": 6, "max_training_steps": 2}, {})
    distill["objective"] = {"type": "distillation", "teacher": str(work / "teacher"), "max_completion_length": 6}
    (work / "distillation.yaml").write_text(yaml.safe_dump(distill))
    (work / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    reward = tiny_grpo_recipe(str(work), {"total_batch_size": 8, "gradient_accumulation_steps": 2, "max_length": 16,
                                          "max_training_steps": 2, "learning_rate": 1e-2, "do_eval": False}, {})
    reward["data"] = {"kind": "preference", "source": str(work / "pairs.jsonl"), "eval_fraction": 0.0}
    reward["objective"] = {"type": "reward", "center_rewards_coefficient": 0.01}
    (work / "reward.yaml").write_text(yaml.safe_dump(reward))
    return work


@pytest.mark.parametrize("objective", ["distillation", "reward"])
def test_distillation_and_reward_training_on_two_processes_equal_one_process(other_recipes, objective):
    """Bitwise, as GRPO's row above and for its reason: the same 2-device mesh, sums across devices of two operands."""
    work = other_recipes
    _run(work, f"{objective}-one", "train", devices=2, recipe=f"{objective}.yaml")
    _run(work, f"{objective}-two", "launch", "--nproc", "2", "--kill-after", "10", recipe=f"{objective}.yaml")
    one, two = work / f"{objective}-one", work / f"{objective}-two"
    ours, ref = json.loads((two / "summary.json").read_text()), json.loads((one / "summary.json").read_text())
    assert (ours["process_count"], ref["process_count"], ours["final_step"]) == (2, 1, 2)
    assert ours["params_sha256"] == ref["params_sha256"]

    def records(out):
        return {r["step"]: tuple(r[k] for k in FIGURES[objective])
                for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["split"] == "train"}

    assert records(two) == records(one) and sorted(records(one)) == [1, 2]
