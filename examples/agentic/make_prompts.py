#!/usr/bin/env python
"""Write the data of the agentic examples: the calculator's prompts and tool-use conversations, the game's prompts.

``calculator.jsonl``: GRPO prompts of examples/agentic/tools_smollm2.yaml. ``calculator_sft.jsonl``: worked
tool-use conversations for examples/agentic/tools_sft_smollm2.yaml, the short SFT that run starts from
(SmolLM2-135M-Instruct never writes a ``<tool_call>`` on its own: 0 of 32 samples at temperature 1).
``guess_number.jsonl``: prompts of examples/agentic_game_smollm2.yaml, each with the ``secret`` its game hides.
``guess_number_sft.jsonl``: played games for examples/agentic_game_sft_smollm2.yaml, the short SFT that run starts
from (SmolLM2-135M-Instruct rambles instead of replying with one number: 1 game won of 32 in a first run).

Why generated: no dataset hub is reachable here, and a verifiable reward needs a known answer per prompt. Each
row is a conversation (a system prompt that says how to call a tool, then a question) in the ``prompt`` column
and the correct result in ``answer``. The numbers are large (a 3-digit number times a 2-digit one, sums of two
4-digit numbers) so that a 135M-parameter model cannot work them out itself: it earns the reward by calling the
calculator and repeating its result. Reproducible byte for byte from the seed.

Usage (from the repository root)::

    python examples/agentic/make_prompts.py [--count 256] [--sft-count 320] [--seed 0]

The SFT conversations carry the tools' schemas in their system message as the chat template writes them at
GRPO time (rendered with ``tool_chat_template.jinja``), so SFT and GRPO see the same prompt text; their
questions are other draws, phrased otherwise ("Compute 12 * 34."), than the GRPO prompts', and are products only:
the SFT teaches the call format on ``multiply``, and GRPO has to learn to call ``add`` for the sums (half its
prompts) and to read the questions as they are phrased there.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SYSTEM = ("You are a calculator assistant. You cannot do arithmetic in your head: call a tool, then reply with "
          "its result only.")
QUESTIONS = {
    "times": ("What is {a} times {b}?", lambda a, b: a * b),
    "plus": ("What is {a} plus {b}?", lambda a, b: a + b),
}


def calculator_row(rng: random.Random, index: int) -> dict:
    """One calculator prompt row: ``id``, ``prompt`` (system + user messages), ``answer`` (the result as text)."""
    kind = rng.choice(sorted(QUESTIONS))
    template, result = QUESTIONS[kind]
    if kind == "times":
        a, b = rng.randint(101, 999), rng.randint(11, 99)
    else:
        a, b = rng.randint(1001, 9999), rng.randint(1001, 9999)
    return {"id": index, "prompt": [{"role": "system", "content": SYSTEM},
                                    {"role": "user", "content": template.format(a=a, b=b)}],
            "answer": str(result(a, b))}


SFT_QUESTION = "Compute {a} * {b}."


def tools_system() -> str:
    """The system message's text with the calculator's tool schemas, as ``tool_chat_template.jinja`` renders it."""
    import sys

    from transformers.utils import get_json_schema
    from transformers.utils.chat_template_utils import render_jinja_template

    folder = Path(__file__).resolve().parent
    sys.path.insert(0, str(folder))
    from calculator import Calculator

    calc = Calculator()
    template = (folder / "tool_chat_template.jinja").read_text(encoding="utf-8")
    rendered, _ = render_jinja_template(conversations=[[{"role": "system", "content": SYSTEM}]], chat_template=template,
                                        tools=[get_json_schema(calc.add), get_json_schema(calc.multiply)])
    return rendered[0].removeprefix("<|im_start|>system\n").removesuffix("<|im_end|>\n")


def sft_row(rng: random.Random, index: int, system: str) -> dict:
    """One worked episode: the question, the call, the tool's result (a ``<tool_response>`` user turn), the answer.
    Products only: the SFT shows the format on ``multiply``; choosing ``add`` for a sum is left to GRPO."""
    a, b = rng.randint(101, 999), rng.randint(11, 99)
    result = str(a * b)
    call = json.dumps({"name": "multiply", "arguments": {"a": a, "b": b}})
    return {"id": index, "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": SFT_QUESTION.format(a=a, b=b)},
        {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
        {"role": "user", "content": f"<tool_response>\n{result}\n</tool_response>"},
        {"role": "assistant", "content": result}]}


GAME_SYSTEM = ("Let's play a game. I am thinking of a whole number from 1 to 10. Guess it in at most 4 tries. After "
               "each wrong guess I say \"Higher.\" (my number is bigger) or \"Lower.\" (it is smaller). Reply with "
               "your guess only: one number.")
GAME_FIRST = "I have my number. Your first guess?"
GAME_TRIES = 4


def game_row(rng: random.Random, index: int) -> dict:
    """One guess-the-number prompt row: ``id``, ``prompt``, and the ``secret`` the environment's ``reset`` reads."""
    return {"id": index, "prompt": [{"role": "system", "content": GAME_SYSTEM},
                                    {"role": "user", "content": GAME_FIRST}],
            "secret": rng.randint(1, 10)}


def game_sft_row(rng: random.Random, index: int) -> dict:
    """One played game: the GRPO prompt, then guesses and hints until a win or the 4th guess. The player guesses
    any number the hints still allow, at random: it follows the hints without searching well (it wins 76% of
    games in 4 tries; halving the range wins all), so the SFT teaches the reply format and the hints' meaning and
    leaves GRPO a better search to find."""
    secret, low, high = rng.randint(1, 10), 1, 10
    messages = [{"role": "system", "content": GAME_SYSTEM}, {"role": "user", "content": GAME_FIRST}]
    for _ in range(GAME_TRIES):
        guess = rng.randint(low, high)
        messages.append({"role": "assistant", "content": str(guess)})
        if guess == secret:
            break
        low, high = (guess + 1, high) if guess < secret else (low, guess - 1)
        messages.append({"role": "user", "content": "Higher." if guess < secret else "Lower."})
    if messages[-1]["role"] == "user":
        messages.pop()  # the 4th guess was wrong: the game ends on it, as max_turns ends a GRPO episode
    return {"id": index, "messages": messages, "secret": secret}


def write(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    print(f"wrote {len(rows)} prompts to {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=256)
    parser.add_argument("--sft-count", type=int, default=320)
    parser.add_argument("--game-sft-count", type=int, default=160)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--folder", default="examples/agentic")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    write(Path(args.folder) / "calculator.jsonl", [calculator_row(rng, i) for i in range(args.count)])
    system = tools_system()
    write(Path(args.folder) / "calculator_sft.jsonl", [sft_row(rng, i, system) for i in range(args.sft_count)])
    write(Path(args.folder) / "guess_number.jsonl", [game_row(rng, i) for i in range(args.count)])
    write(Path(args.folder) / "guess_number_sft.jsonl", [game_sft_row(rng, i) for i in range(args.game_sft_count)])


if __name__ == "__main__":
    main()
