"""Reward functions (TRL's signature, loading, built-ins, failures named by row), the ``prompt`` data kind,
and group advantages' edge cases (None rewards, one-value groups)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from preference_testing import word_tokenizer
from scaletrain.data.kinds import DATA_KINDS, data_kind
from scaletrain.data.prompts import load_prompts
from scaletrain.errors import ConfigError, DataError
from scaletrain.rl.advantages import group_advantages
from scaletrain.rl.rewards import exact_answer, final_answer, format_regex, load_rewards, score


def length_reward(prompts, completions, **columns):
    """A user reward in TRL's style: shorter is better, None for empty completions."""
    return [None if not c else -float(len(c)) for c in completions]


def picky_reward(prompts, completions, **columns):
    for c in completions:
        if "boom" in c:
            raise ValueError("cannot score boom")
    return [1.0] * len(completions)


def test_final_answer_and_exact_answer():
    assert final_answer("so it is \\boxed{42}.") == "42"
    assert final_answer("<answer> 7 </answer> then 9") == "7"
    assert final_answer("reasoning #### 1,000") == "1,000"
    assert final_answer("two plus three is 5.") == "5"
    rewards = exact_answer(["p"] * 5, ["the answer is 5", "#### 1,000", "6", [{"role": "assistant", "content": "5"}],
                                      "x"], answer=["5", "1000.0", "5", 5, None])
    assert rewards == [1.0, 1.0, 0.0, 1.0, None]


def test_format_regex_default_and_custom_pattern():
    good, bad = "<think>add</think> <answer>5</answer>", "5"
    assert format_regex([], [good, bad]) == [1.0, 0.0]
    assert format_regex([], ["A: 5", "5"], pattern=r"A: \d+") == [1.0, 0.0]


def test_load_by_module_path_builtin_and_options():
    funcs, weights = load_rewards(["test_grpo_rewards:length_reward", "exact_answer",
                                   {"function": "format_regex", "pattern": r"A: \d+", "name": "fmt"}], [1.0, 2.0, 0.5])
    assert [f.name for f in funcs] == ["length_reward", "exact_answer", "fmt"] and weights == [1.0, 2.0, 0.5]
    out = score(funcs, ["p"] * 3, ["A: 5", "", "no"], {"answer": ["5", "5", "7"]})
    assert out[0].tolist() == [-4.0, 1.0, 1.0]
    assert math.isnan(out[1, 0]) and out[1, 1:].tolist() == [0.0, 0.0]  # None -> NaN, skipped later
    assert out[2].tolist() == [-2.0, 0.0, 0.0]


@pytest.mark.parametrize("spec,weights,match", [
    ("nowhere_module_xyz:f", None, "cannot be loaded"),
    ("length_reward", None, "built-in"),
    ("test_grpo_rewards:length_reward", [1.0, 2.0], "reward_weights has 2"),
    ([], None, "at least one"),
])
def test_load_errors_name_the_field(spec, weights, match):
    with pytest.raises(ConfigError, match=match):
        load_rewards(spec, weights)


def test_a_raising_reward_names_itself_and_the_row():
    funcs, _ = load_rewards(["test_grpo_rewards:picky_reward"])
    with pytest.raises(DataError, match=r"'picky_reward' raised on row 2 \(prompt 'q2', completion 'boom'\).*"
                                        r"cannot score boom"):
        score(funcs, ["q0", "q1", "q2"], ["a", "b", "boom"], {})


def test_none_rows_are_skipped_as_trl_does():
    r = np.array([[1.0, np.nan], [np.nan, np.nan], [0.0, 1.0], [2.0, np.nan]], np.float32)
    adv = group_advantages(r, [1.0, 1.0], num_generations=2, scale_rewards="none")
    # group 0: row 1 is unscored (advantage 0), row 0 is alone in its group's mean; group 1: sums 1 and 2
    np.testing.assert_allclose(adv.advantages, [0.0, 0.0, -0.5, 0.5])
    assert adv.metrics["reward"] == pytest.approx((1.0 + 1.0 + 2.0) / 3)
    assert adv.metrics["rewards/reward_1/mean"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="whole groups"):
        group_advantages(r[:3], [1.0, 1.0], num_generations=2)


def test_prompt_kind_reads_text_and_messages_with_columns(tmp_path):
    tok = word_tokenizer(str(tmp_path / "tok"))
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}say{% endif %}"
    path = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "what is two plus three", "answer": "5"},
            {"prompt": [{"role": "user", "content": "name a fruit"}], "answer": "apple", "level": 2}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = load_prompts(str(path), tok, max_prompt_length=3)
    assert out[0].prompt_ids == tuple(tok("two plus three")["input_ids"])  # the last 3 tokens kept
    assert out[1].prompt_ids == tuple(tok("a fruit say")["input_ids"])
    assert out[0].columns == {"answer": "5"} and out[1].columns == {"answer": "apple", "level": 2}
    assert "prompt" in DATA_KINDS and data_kind("prompt").text_files is False
    path.write_text(json.dumps({"question": "x"}) + "\n")
    with pytest.raises(DataError, match=r"line 1\): column 'prompt' must be text or a list of messages"):
        load_prompts(str(path), tok)


def test_prompt_rows_that_carry_messages_are_told_the_column_option(tmp_path):
    """Chat rows (``messages``, no ``prompt``): the error names the row and the setting that reads them
    (``data.prompt_column: messages``), which then works; GRPOTrainer in Python, which has no such setting, says to
    rename the column."""
    import scaletrain as st

    tok = word_tokenizer(str(tmp_path / "tok"))
    tok.chat_template = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
                         "{% if add_generation_prompt %}say{% endif %}")
    path = tmp_path / "chat.jsonl"
    rows = [{"messages": [{"role": "user", "content": "name a fruit"}], "answer": "apple"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError) as err:
        load_prompts(str(path), tok)
    assert str(err.value) == (f"{path} (line 1): no 'prompt' column, but a 'messages' list (chat rows): set "
                              f"data.prompt_column: messages to read them as the prompt; the chat template then adds "
                              f"the generation prompt after the last message")
    out = load_prompts(str(path), tok, prompt_column="messages")
    assert out[0].prompt_ids == tuple(tok("name a fruit say")["input_ids"]) and out[0].columns == {"answer": "apple"}
    args = st.TrainingArguments(output_dir=str(tmp_path / "run"), total_batch_size=4, max_training_steps=1)
    with pytest.raises(DataError, match=r"row 1: no 'prompt' column, but a 'messages' list \(chat rows\): rename "
                                         r"the column to 'prompt'"):
        st.GRPOTrainer(args=args, train_dataset=rows, processing_class=tok, reward_funcs=[exact_answer],
                       num_generations=4)
