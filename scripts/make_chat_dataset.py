#!/usr/bin/env python
"""Write ``examples/chat/chat.jsonl``: small, original chat conversations for SFT examples and tests.

Why generated: no dataset hub is reachable here and copying a public chat set would
bring its licence along. These conversations are produced from templates with
answers computed by the script (arithmetic, word games, calendar, unit conversion,
small talk), so every assistant answer is correct and the set is reproducible
byte for byte. Some conversations have a system prompt that changes the style of
the answers (short / cheerful / formal), several are multi-turn, and a few are long
(counting) so truncation is exercised.

Usage (from the repository root)::

    python scripts/make_chat_dataset.py [--count 160] [--seed 0] [--out examples/chat/chat.jsonl]
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path

Message = dict[str, str]
Chat = list[Message]

DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December"]
WORDS = ["garden", "river", "lantern", "pepper", "window", "planet", "violin", "marble", "candle", "forest",
         "bridge", "rocket", "pillow", "cactus", "meadow", "harbor", "puzzle", "ladder", "tunnel", "kettle"]
OPPOSITES = {"hot": "cold", "early": "late", "empty": "full", "open": "closed", "light": "heavy",
             "fast": "slow", "loud": "quiet", "wide": "narrow", "rough": "smooth", "inside": "outside",
             "above": "below", "begin": "end", "buy": "sell", "win": "lose", "young": "old"}
FRUITS = ["apples", "pears", "oranges", "lemons", "plums", "peaches"]

STYLES = {
    "plain": None,
    "short": "Answer in one short sentence.",
    "cheerful": "You are a cheerful assistant. End every answer with an exclamation mark.",
    "formal": "You are a formal assistant. Begin every answer with 'Certainly.'",
    "tutor": "You are a patient math tutor for children.",
}


def styled(style: str, answer: str) -> str:
    """Apply the system prompt's style rule to a plain answer (so the system prompt matters)."""
    if style == "cheerful":
        return answer.rstrip(".") + "!"
    if style == "formal":
        return "Certainly. " + answer
    return answer


def arithmetic(rng: random.Random, style: str) -> Chat:
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    op = rng.choice(["plus", "minus", "times"])
    value = {"plus": a + b, "minus": a - b, "times": a * b}[op]
    chat = [{"role": "user", "content": f"What is {a} {op} {b}?"},
            {"role": "assistant", "content": styled(style, f"{a} {op} {b} is {value}.")}]
    if rng.random() < 0.5:
        chat += [{"role": "user", "content": "And if you double that?"},
                 {"role": "assistant", "content": styled(style, f"Doubling {value} gives {2 * value}.")}]
    return chat


def word_game(rng: random.Random, style: str) -> Chat:
    word = rng.choice(WORDS)
    chat = [{"role": "user", "content": f"How many letters are in the word '{word}'?"},
            {"role": "assistant", "content": styled(style, f"The word '{word}' has {len(word)} letters.")}]
    follow = rng.choice(["backwards", "first", "last", "vowels"])
    if follow == "backwards":
        q, ans = "Now spell it backwards.", f"'{word}' backwards is '{word[::-1]}'."
    elif follow == "first":
        q, ans = "What is its first letter?", f"The first letter of '{word}' is '{word[0]}'."
    elif follow == "last":
        q, ans = "And its last letter?", f"The last letter of '{word}' is '{word[-1]}'."
    else:
        n = sum(c in "aeiou" for c in word)
        q, ans = "How many vowels does it have?", f"'{word}' has {n} vowel{'s' if n != 1 else ''}."
    return chat + [{"role": "user", "content": q}, {"role": "assistant", "content": styled(style, ans)}]


def calendar(rng: random.Random, style: str) -> Chat:
    if rng.random() < 0.5:
        i = rng.randrange(7)
        q, ans = f"What day comes after {DAYS[i]}?", f"The day after {DAYS[i]} is {DAYS[(i + 1) % 7]}."
        q2, ans2 = "And the day before it?", f"The day before {DAYS[i]} is {DAYS[(i - 1) % 7]}."
    else:
        i = rng.randrange(12)
        q, ans = f"Which month comes after {MONTHS[i]}?", f"{MONTHS[(i + 1) % 12]} comes after {MONTHS[i]}."
        q2, ans2 = "Which number month is that?", f"{MONTHS[(i + 1) % 12]} is month number {(i + 1) % 12 + 1}."
    chat = [{"role": "user", "content": q}, {"role": "assistant", "content": styled(style, ans)}]
    if rng.random() < 0.6:
        chat += [{"role": "user", "content": q2}, {"role": "assistant", "content": styled(style, ans2)}]
    return chat


def units(rng: random.Random, style: str) -> Chat:
    kind = rng.choice(["hours", "km", "kg", "minutes"])
    n = rng.randint(2, 48)
    if kind == "hours":
        q, ans = f"How many minutes are in {n} hours?", f"{n} hours is {60 * n} minutes."
    elif kind == "km":
        q, ans = f"How many meters are in {n} kilometers?", f"{n} kilometers is {1000 * n} meters."
    elif kind == "kg":
        q, ans = f"Convert {n} kilograms to grams.", f"{n} kilograms is {1000 * n} grams."
    else:
        q, ans = f"How many seconds are in {n} minutes?", f"{n} minutes is {60 * n} seconds."
    return [{"role": "user", "content": q}, {"role": "assistant", "content": styled(style, ans)}]


def sorting(rng: random.Random, style: str) -> Chat:
    nums = rng.sample(range(1, 100), rng.randint(3, 6))
    listed = ", ".join(map(str, nums))
    up = ", ".join(map(str, sorted(nums)))
    down = ", ".join(map(str, sorted(nums, reverse=True)))
    chat = [{"role": "user", "content": f"Sort these numbers from smallest to largest: {listed}"},
            {"role": "assistant", "content": styled(style, f"Sorted: {up}.")}]
    if rng.random() < 0.5:
        chat += [{"role": "user", "content": "Now from largest to smallest, please."},
                 {"role": "assistant", "content": styled(style, f"Largest first: {down}.")}]
    return chat


def compare(rng: random.Random, style: str) -> Chat:
    a, b = rng.sample(range(1, 1000), 2)
    chat = [{"role": "user", "content": f"Which is larger, {a} or {b}?"},
            {"role": "assistant", "content": styled(style, f"{max(a, b)} is larger than {min(a, b)}.")}]
    if rng.random() < 0.5:
        n = rng.choice([a, b])
        chat += [{"role": "user", "content": f"Is {n} even or odd?"},
                 {"role": "assistant", "content": styled(style, f"{n} is {'even' if n % 2 == 0 else 'odd'}.")}]
    return chat


def opposites(rng: random.Random, style: str) -> Chat:
    word, opp = rng.choice(sorted(OPPOSITES.items()))
    return [{"role": "user", "content": f"What is the opposite of '{word}'?"},
            {"role": "assistant", "content": styled(style, f"The opposite of '{word}' is '{opp}'.")}]


def shopping(rng: random.Random, style: str) -> Chat:
    n, price, fruit = rng.randint(2, 12), rng.randint(5, 60), rng.choice(FRUITS)
    chat = [{"role": "user", "content": f"I buy {n} {fruit} at {price} cents each. How much do I pay?"},
            {"role": "assistant", "content": styled(style, f"{n} {fruit} at {price} cents each cost {n * price} cents.")}]
    if rng.random() < 0.4:
        paid = ((n * price) // 100 + 1) * 100
        chat += [{"role": "user", "content": f"I pay with {paid} cents. What is my change?"},
                 {"role": "assistant", "content": styled(style, f"Your change is {paid - n * price} cents.")}]
    return chat


def small_talk(rng: random.Random, style: str) -> Chat:
    greet = rng.choice(["Hello!", "Hi there.", "Good morning!", "Hey, are you there?"])
    chat = [{"role": "user", "content": greet},
            {"role": "assistant", "content": styled(style, "Hello! How can I help you today?")}]
    task = rng.choice([arithmetic, units, opposites])(rng, style)
    chat += task[:2]
    chat += [{"role": "user", "content": rng.choice(["Thanks, that's all.", "Great, thank you!", "Thank you."])},
             {"role": "assistant", "content": styled(style, "You're welcome. Have a good day.")}]
    return chat


def counting(rng: random.Random, style: str) -> Chat:
    n = rng.randint(20, 90)
    return [{"role": "user", "content": f"Count from 1 to {n}, separated by commas."},
            {"role": "assistant", "content": styled(style, ", ".join(str(i) for i in range(1, n + 1)) + ".")}]


GENERATORS: list[tuple[Callable[[random.Random, str], Chat], int]] = [
    (arithmetic, 5), (word_game, 4), (calendar, 3), (units, 3), (sorting, 3), (compare, 3),
    (opposites, 2), (shopping, 3), (small_talk, 3), (counting, 1),
]


def make(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    funcs = [f for f, w in GENERATORS for _ in range(w)]
    rows = []
    for i in range(count):
        style = rng.choice(list(STYLES))
        chat = rng.choice(funcs)(rng, style)
        system = STYLES[style]
        if system is not None:
            chat = [{"role": "system", "content": system}, *chat]
        rows.append({"id": i, "messages": chat})
    return rows


def main() -> None:
    root = Path(__file__).resolve().parent.parent
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--count", type=int, default=160)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(root / "examples" / "chat" / "chat.jsonl"))
    ns = p.parse_args()
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        for row in make(ns.count, ns.seed):
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"wrote {ns.count} conversations to {out}")


if __name__ == "__main__":
    main()
