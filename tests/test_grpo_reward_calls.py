"""Calls into user reward code: a deadline on each (a hanging reward scores None and the run goes on; a
SIGTERM while one hangs stops the run with a checkpoint that resumes to the uninterrupted result), values
that are not finite numbers refused naming the function and the row, and ``module:function`` found beside
the recipe, checked before the data is read.

The command-line runs are the real ``python -m scaletrain train`` on a tiny random Llama (one CPU device),
started from a folder other than the recipe's, with the reward module beside the recipe and not on
``PYTHONPATH``. No figure here depends on timing: a hanging reward sleeps until released (or for ever),
and the one bound on time (SIGTERM to exit) is far under the reward timeout it would otherwise wait for.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import yaml

from grpo_testing import tiny_grpo_recipe
from preference_testing import one_device_mesh, word_tokenizer
from scaletrain.errors import DataError
from scaletrain.rl.rewards import load_rewards, score
from scaletrain.user_calls import DeadlineExceeded, StopRequested, abandoned, call_with_deadline
from xla_testing import child_xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = ["what is two plus three", "the sky colour", "say hello", "name a fruit", "count to four", "the dog",
           "is the cat a dog", "say goodbye"]
LIMIT_S = 300  # one command-line run, a few times its usual length on a loaded 2-core machine
REWARDS = '''
import os
import time

_calls = 0


def yes(prompts, completions, **columns):
    return [float("yes" in c.split()) for c in completions]


def verdict(prompts, completions, **columns):
    return ["correct" if "yes" in c.split() else "wrong" for c in completions]


def maybe_hang(prompts, completions, **columns):
    """Sleeps for ever at call HANG_AT_CALL (after touching HANG_MARK), else scores like ``yes``."""
    global _calls
    _calls += 1
    if str(_calls) == os.environ.get("HANG_AT_CALL"):
        open(os.environ["HANG_MARK"], "w").close()
        while True:
            time.sleep(1)
    return yes(prompts, completions)
'''


# ---- the deadline itself --------------------------------------------------------------------------------
def test_a_call_past_its_deadline_gives_control_back_and_a_stop_request_ends_the_wait():
    release = threading.Event()
    with pytest.raises(DeadlineExceeded, match="'blocked' did not return within 0.2 s"):
        call_with_deadline(release.wait, timeout=0.2, what="'blocked'")  # blocked in native code: left running
    assert abandoned() >= 1

    def spin() -> None:
        while True:
            pass

    with pytest.raises(DeadlineExceeded):
        call_with_deadline(spin, timeout=0.2)
    release.set()
    # the released call ends, and so does the loop (asked to stop at its next instruction): no thread is left
    start = time.monotonic()
    while abandoned() and time.monotonic() - start < 60:
        time.sleep(0.05)
    assert abandoned() == 0
    with pytest.raises(StopRequested, match="received SIGTERM while waiting for 'slow'"):
        call_with_deadline(threading.Event().wait, 3600, timeout=3600, what="'slow'",
                           stop_requested=lambda: "SIGTERM")
    assert call_with_deadline(lambda a, b=0: a + b, 1, b=2, timeout=60) == 3
    with pytest.raises(ZeroDivisionError):  # the call's own error, as it is
        call_with_deadline(lambda: 1 / 0, timeout=60)


# ---- item 4: a hanging reward times out, its rows score None, the run goes on ------------------------------
def yes_reward(prompts, completions, **columns):
    return [float("yes" in c.split()) for c in completions]


class Stall:
    """A reward that blocks at its second call until the test releases it (so no thread outlives the test)."""

    __name__ = "stall"

    def __init__(self) -> None:
        self.calls, self.release = 0, threading.Event()

    def __call__(self, prompts, completions, **columns):
        self.calls += 1
        if self.calls == 2:
            self.release.wait()
        return [1.0] * len(completions)


def test_a_hanging_reward_times_out_its_rows_score_none_and_the_run_goes_on(tmp_path):
    import scaletrain as st
    from scaletrain.models import LlamaConfig, LlamaForCausalLM, create_sharded_model
    from scaletrain.rl.trainer import GRPOTrainer

    tok = word_tokenizer(str(tmp_path / "tok"))
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         eos_token_id=1, pad_token_id=0, bos_token_id=None)
    model = create_sharded_model(LlamaForCausalLM, config, seed=0, mesh=one_device_mesh())[0]
    args = st.TrainingArguments(output_dir=str(tmp_path / "run"), total_batch_size=8, max_length=32,
                                learning_rate=3e-2, scheduler="constant", max_training_steps=3, log_steps=1,
                                save_at_end=False, progress_bar=False, report_to=(), seed=0)
    stall = Stall()
    trainer = GRPOTrainer(arguments=args, model=model, tokenizer=tok, reward_funcs=[yes_reward, stall],
                          options={"num_generations": 4, "max_completion_length": 6, "log_completions": False,
                                   "reward_timeout": 3.0},  # far above a call's microseconds
                          dataset_train=[{"prompt": p} for p in PROMPTS])
    try:
        trainer.train()
    finally:
        stall.release.set()
    records = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
               if r.get("split") == "train"]
    assert [r["step"] for r in records] == [1, 2, 3] and trainer.summary["final_step"] == 3
    assert [r["rewards/stall/timeouts"] for r in records] == [0.0, 8.0, 0.0]  # step 2's call: all 8 rows
    assert [r["rewards/yes_reward/timeouts"] for r in records] == [0.0, 0.0, 0.0]
    assert records[1]["rewards/stall/mean"] is None or math.isnan(records[1]["rewards/stall/mean"])
    assert records[0]["rewards/stall/mean"] == records[2]["rewards/stall/mean"] == 1.0
    assert records[1]["reward"] == records[1]["rewards/yes_reward/mean"]  # the step trained on what scored


def test_async_rewards_run_at_once_and_one_that_hangs_scores_its_rows_none_naming_the_reward_and_rows(caplog):
    """TRL gathers ``async def`` rewards; ours run at once too (two of them meet at a barrier, which a one-by-one
    run would break after its 20 s wait), and one past ``reward_timeout`` scores its rows None, counted, logged
    with its name and the rows."""
    import asyncio
    import logging

    from scaletrain.rl.rewards import RewardFunction, score_calls

    barrier = threading.Barrier(2, timeout=20)

    async def meets(prompts, completions, **columns):
        barrier.wait()
        return [1.0] * len(completions)

    async def hangs(prompts, completions, **columns):
        await asyncio.sleep(60)

    funcs = [RewardFunction("first", meets), RewardFunction("second", meets), RewardFunction("hangs", hangs),
             RewardFunction("yes", lambda prompts, completions, **c: [float(x == "yes") for x in completions])]
    with caplog.at_level(logging.WARNING, logger="scaletrain"):
        scores = score_calls(funcs, ["q"] * 3, ["yes", "no", "yes"], {}, rows=[4, 5, 6], timeout=1.0)
    assert scores.values[:, [0, 1, 3]].tolist() == [[1, 1, 1], [1, 1, 0], [1, 1, 1]]
    assert np.isnan(scores.values[:, 2]).all() and scores.timed_out[:, 2].all() and scores.timed_out.sum() == 3
    assert "reward function 'hangs' did not return within 1 s (objective.reward_timeout): its 3 rows (rows 4-6) " \
        "score None" in caplog.text


# ---- items 6 and 10: values that are not finite numbers -----------------------------------------------------
def words_reward(prompts, completions, **columns):
    return ["good" if c else "bad" for c in completions]


def text_number_reward(prompts, completions, **columns):
    return ["1.0" for _ in completions]


def infinite_reward(prompts, completions, **columns):
    return [-math.inf if c == "never" else math.log(len(c)) for c in completions]


def nan_reward(prompts, completions, **columns):
    return [np.float32("nan"), np.float64(0.5), 1, np.array(True)]


@pytest.mark.parametrize("name,match", [
    ("words_reward", r"^reward function 'words_reward' returned 'good' \(str\) for row 0 \(prompt 'q0', "
                     r"completion 'a'\); return a number \(float\) or None per completion$"),
    ("text_number_reward", r"returned '1.0' \(str\) for row 0 "),  # TRL's torch.tensor refuses it too
    ("infinite_reward", r"^reward function 'infinite_reward' returned -inf for row 2 \(prompt 'q2', completion "
                        r"'never'\); return a finite number, or None for a row it does not score$"),
])
def test_a_reward_value_that_is_not_a_finite_number_is_refused_naming_the_function_and_row(name, match):
    funcs, _ = load_rewards([f"test_grpo_reward_calls:{name}"])
    with pytest.raises(DataError, match=match):
        score(funcs, ["q0", "q1", "q2", "q3"], ["a", "bb", "never", "ccc"], {})


def test_nan_numpy_numbers_and_zero_d_arrays_are_rewards_as_in_trl():
    funcs, _ = load_rewards(["test_grpo_reward_calls:nan_reward"])
    out = score(funcs, ["q"] * 4, ["a", "b", "c", "d"], {})
    assert math.isnan(out[0, 0]) and out[1:, 0].tolist() == [0.5, 1.0, 1.0]


# ---- the command line: a reward module beside the recipe, run from another folder ------------------------------
@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("reward_calls")
    word_tokenizer(str(root / "tok"))
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    recipes = root / "recipes"
    recipes.mkdir()
    (recipes / "side_rewards.py").write_text(REWARDS)
    recipe = tiny_grpo_recipe(str(root), {"total_batch_size": 8, "max_training_steps": 5, "save_steps": 2,
                                          "resume_if_possible": True},
                              {"reward_funcs": ["side_rewards:maybe_hang"], "log_completions": False,
                               "reward_timeout": 3600})
    (recipes / "grpo.yaml").write_text(yaml.safe_dump(recipe))
    (root / "elsewhere").mkdir()
    return root


def _start(work, name: str, *overrides: str, **env: str) -> subprocess.Popen:
    """``python -m scaletrain train recipes/grpo.yaml`` into ``work/name``, from ``work/elsewhere``; PYTHONPATH
    holds the repository only (not the recipe's folder)."""
    # the cheap compile setting: the runs compared here are all such children (tests/xla_testing.py)
    environ = {**os.environ, "PYTHONPATH": ROOT, "XLA_FLAGS": child_xla_flags(1), **env}
    return subprocess.Popen([sys.executable, "-m", "scaletrain", "train", str(work / "recipes" / "grpo.yaml"),
                             f"training.output_dir={work / name}", *overrides],
                            cwd=work / "elsewhere", env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def _finish(child: subprocess.Popen, status: int) -> str:
    try:
        text, _ = child.communicate(timeout=LIMIT_S)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == status, text[-4000:]
    return text


def _error_lines(text: str) -> list[str]:
    return [x for x in text.splitlines() if "error" in x.lower() or "Traceback" in x]


def test_a_reward_module_beside_the_recipe_is_checked_before_the_data_is_read(work):
    """A misspelt function in the module beside the recipe is named first, though the data file is missing too
    (the data is read after every reward loads), in one line, exit 2."""
    text = _finish(_start(work, "misspelt", "objective.reward_funcs=[side_rewards:yes, side_rewards:no_such]",
                          f"data.source={work / 'missing.jsonl'}"), 2)
    assert "objective.reward_funcs[1]='side_rewards:no_such' cannot be loaded" in text, text[-3000:]
    assert "missing.jsonl" not in text and "Traceback" not in text, text[-3000:]


def test_a_reward_returning_strings_stops_the_command_with_one_line_naming_it_and_the_row(work):
    text = _finish(_start(work, "strings", "objective.reward_funcs=[side_rewards:verdict]"), 2)
    errors = _error_lines(text)
    assert len(errors) == 1 and errors[0].startswith("scaletrain: error: reward function 'verdict' returned "), text
    assert " (str) for row 0 (prompt '" in errors[0], errors  # the row's prompt (shuffled: any of them)


def _summary(out) -> dict:
    return json.loads((out / "summary.json").read_text())


def _records(out) -> dict[int, tuple]:
    keys = ("loss", "reward", "rewards/maybe_hang/mean", "rewards/maybe_hang/timeouts")
    return {r["step"]: tuple(r.get(k) for k in keys)
            for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["split"] == "train"}


@pytest.mark.slow
def test_sigterm_while_a_reward_hangs_stops_the_run_with_a_checkpoint_that_resumes_to_the_same_result(work):
    """The reward sleeps for ever at step 4 (reward_timeout is an hour): SIGTERM then stops the run at once with
    the checkpoint of step 3 (not a save step), and the resumed run ends as the uninterrupted one."""
    _finish(_start(work, "whole"), 0)
    mark = work / "waiting"
    child = _start(work, "stopped", HANG_AT_CALL="4", HANG_MARK=str(mark))
    start = time.monotonic()
    while not mark.exists() and child.poll() is None and time.monotonic() - start < LIMIT_S:
        time.sleep(0.5)
    assert mark.exists(), _finish(child, 0)[-3000:]
    child.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    _finish(child, 0)
    waited = time.monotonic() - sent
    assert waited < 120, waited  # measured ~5 s; without the deadline it never ends (the reward sleeps for ever)
    stopped = _summary(work / "stopped")
    assert stopped["final_step"] == 3 and stopped["stop_reason"].startswith(
        "received SIGTERM while waiting for reward function 'maybe_hang' at step 4"), stopped["stop_reason"]
    assert (work / "stopped" / "checkpoints" / "3").is_dir()
    _finish(_start(work, "stopped"), 0)
    resumed, whole = _summary(work / "stopped"), _summary(work / "whole")
    assert resumed["resumed_from"].endswith("/3") and resumed["final_step"] == 5
    assert resumed["params_sha256"] == whole["params_sha256"]
    assert _records(work / "stopped") == _records(work / "whole")
