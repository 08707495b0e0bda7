"""The agentic examples' parts (examples/agentic/): the tool chat template, the generated data, the environments.

The runs themselves are in docs/agentic.md; ``test_multi_turn_grpo.py`` runs one step of each recipe. Here: the
template SmolLM2 gets for tools (its own has no tool section) renders the tool lines, writes and parses Hermes
``<tool_call>`` JSON and is prefix-preserving (multi-turn rollouts append to it); the data files are what the
script writes, with right answers, and the SFT conversations start as the GRPO prompts render; the two
environments behave and score as their docstrings say.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import random
import sys

import pytest

from agentic_testing import chatml_tokenizer

REPO = pathlib.Path(__file__).resolve().parents[1]
FOLDER = REPO / "examples" / "agentic"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"agentic_example_{name}", FOLDER / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tok():
    """The byte-level chat tokenizer (its specials are ChatML's, as SmolLM2's) with the example's template."""
    return chatml_tokenizer(template=(FOLDER / "tool_chat_template.jinja").read_text())


def test_tool_template_renders_tool_lines_and_hermes_calls_and_keeps_prefixes(tok):
    from scaletrain.rl.chat_turns import prompt_ids, tool_result_ids
    from scaletrain.rl.tool_calls import parse_turn, resolve_format, tool_calls

    calc = _module("calculator").Calculator()
    question = [{"role": "system", "content": "S"}, {"role": "user", "content": "What is 877 times 64?"}]
    prompt = prompt_ids(tok, question, [calc.add, calc.multiply])
    text = tok.decode(prompt)
    assert text.startswith("<|im_start|>system\nS\n\nTools:\n- add(a: integer, b: integer): Add two integers.\n"
                           "- multiply(a: integer, b: integer): Multiply two integers.\nTo call a tool, write:\n")
    assert text.endswith("<|im_end|>\n<|im_start|>user\nWhat is 877 times 64?<|im_end|>\n<|im_start|>assistant\n")
    assert resolve_format(tok, "auto") == "hermes"  # the template writes <tool_call>
    call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": 877, "b": 64}}}
    episode = [*question, {"role": "assistant", "content": "", "tool_calls": [call]},
               {"role": "tool", "name": "multiply", "content": "56128"}, {"role": "assistant", "content": "56128"}]
    whole = tok.apply_chat_template(episode, tools=[calc.add, calc.multiply], tokenize=False)
    turn = '<tool_call>\n{"name": "multiply", "arguments": {"a": 877, "b": 64}}\n</tool_call><|im_end|>'
    result = "\n<|im_start|>user\n<tool_response>\n56128\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert whole == text + turn + result + "56128<|im_end|>\n"  # each turn appends: prefix-preserving
    assert tok.decode(tool_result_ids(tok, [{"role": "tool", "name": "multiply", "content": "56128"}])) == result
    parsed = parse_turn(tok, tok.encode(turn, add_special_tokens=False), "hermes")
    assert [(c.name, c.arguments) for c in tool_calls(parsed)] == [("multiply", {"a": 877, "b": 64})]


def test_example_data_is_what_the_script_writes_and_sft_starts_as_grpo_prompts_render(tok):
    from scaletrain.rl.chat_turns import prompt_ids

    script = _module("make_prompts")
    calc = _module("calculator").Calculator()
    rng = random.Random(0)
    files = {n: [json.loads(x) for x in (FOLDER / f"{n}.jsonl").read_text().splitlines()]
             for n in ("calculator", "calculator_sft", "guess_number", "guess_number_sft")}
    assert files["calculator"] == [script.calculator_row(rng, i) for i in range(len(files["calculator"]))]
    system = script.tools_system()
    assert files["calculator_sft"] == [script.sft_row(rng, i, system) for i in range(len(files["calculator_sft"]))]
    assert files["guess_number"] == [script.game_row(rng, i) for i in range(len(files["guess_number"]))]
    assert files["guess_number_sft"] == [script.game_sft_row(rng, i) for i in range(len(files["guess_number_sft"]))]
    for row in files["calculator"]:
        a, op, b = row["prompt"][-1]["content"].removeprefix("What is ").removesuffix("?").split()
        assert row["answer"] == str(int(a) * int(b) if op == "times" else int(a) + int(b))
    sft = files["calculator_sft"][0]["messages"]
    assert sft[-1]["content"] == sft[-2]["content"].split("\n")[1] == str(eval(sft[1]["content"][8:-1]))
    grpo_system = tok.decode(prompt_ids(tok, files["calculator"][0]["prompt"][:1], [calc.add, calc.multiply]))
    sft_system = tok.apply_chat_template(sft[:1], tokenize=False)
    assert grpo_system.split("<|im_end|>")[0] == sft_system.split("<|im_end|>")[0]
    assert {r["secret"] for r in files["guess_number"]} <= set(range(1, 11))
    game = _module("guess_number").GuessTheNumber()
    for row in files["guess_number_sft"]:  # played games: the GRPO prompt, then guesses the hints allow
        messages = row["messages"]
        assert messages[:2] == files["guess_number"][0]["prompt"] and messages[-1]["role"] == "assistant"
        game.reset(secret=row["secret"])
        for said, heard in zip(messages[2::2], [*messages[3::2], None]):
            assert int(said["content"]) in game.candidates()
            reply, _, done = game.step(said["content"])
            assert (reply if heard is None else heard["content"]) == reply and done == (heard is None and game.won)


def test_calculator_and_guess_the_number_environments_score_as_documented():
    calc = _module("calculator").Calculator()
    calc.reset(answer="56128", prompt=[])
    assert calc.add(877, 64) == 941 and calc.get_reward() == 0.0
    assert calc.multiply(877, 64) == 56128 and calc.get_reward() == 1.0
    game = _module("guess_number").GuessTheNumber()
    game.reset(secret=7)
    assert game.step("5") == ("Higher.", None, False) and game.step("I guess 9, or 8") == ("Lower.", None, False)
    assert game.step("no idea") == ("Reply with one number from 1 to 10.", None, False)
    # hints "Higher." than 5 and "Lower." than 9 leave 6, 7, 8: 7 of the 9 wrong numbers ruled out, no win yet
    assert game.candidates() == [6, 7, 8] and game.get_reward() == pytest.approx(0.5 * 7 / 9)
    assert game.step("3") == ("Higher.", None, False) and game.get_reward() == pytest.approx(0.5 * 7 / 9)
    assert game.step("7") == (None, None, True) and game.get_reward() == 1.0  # a win, at any guess
    game.reset(secret=2)
    assert game.get_reward() == 0.0 and game.step("10")[0] == "Lower." and game.get_reward() == pytest.approx(0.5 / 9)


def test_exact_answer_reads_the_models_last_reply_not_a_tool_result_or_user_turn():
    """A multi-turn completion that stops after the tool's result (the model wrote nothing more) is not answered:
    the tool's text, though it holds the answer, is not the model's (in a run of the calculator example, before
    this rule, such episodes scored exact_answer 1)."""
    from scaletrain.rl.rewards import exact_answer

    call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "multiply", "arguments": {"a": 748, "b": 58}}}]}
    result = {"role": "tool", "name": "multiply", "content": "43384"}
    completions = [[call, result], [call, result, {"role": "assistant", "content": "43384"}],
                   [{"role": "assistant", "content": "5"}, {"role": "user", "content": "Higher. 43384"}],
                   [{"role": "assistant", "content": "43384"}], "43384"]
    assert exact_answer([None] * 5, completions, answer=["43384"] * 5) == [0.0, 1.0, 0.0, 1.0, 1.0]
