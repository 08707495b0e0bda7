#!/usr/bin/env python
"""Write ``examples/preference/{train,eval}.jsonl``: small, original preference pairs for DPO & co.

Why generated: no dataset hub is reachable here and copying a public preference set
would bring its licence along. Every pair is built from a template whose answer the
script computes (arithmetic, unit conversion, sorting, comparisons, words, calendar),
so ``chosen`` is always the correct answer that follows every instruction of the
prompt, and ``rejected`` has exactly one flaw, recorded in the row's ``flaw`` column:

- ``wrong_result``: the same wording as ``chosen`` with a wrong value (an arithmetic
  slip, a wrong conversion factor, a mis-sorted list, the smaller number called
  larger, the wrong day, ...);
- ``broken_instruction``: a correct value that ignores a rule of the prompt (a
  format rule such as "reply with only the number", "answer in JSON with the key
  answer", "in capital letters", "answer with yes or no", or the system prompt's
  style: "end every answer with an exclamation mark", "begin with 'Certainly.'").

The rows are in TRL's conversational preference format: ``prompt`` is a message list
(an optional system message and one user message), ``chosen`` and ``rejected`` are
lists holding one assistant message. The held-out file is generated from its own
seed and holds no prompt of the training file. Both are reproducible byte for byte.

Usage (from the repository root)::

    python scripts/make_preference_dataset.py [--train 320] [--eval 64] [--seed 0] [--out-dir examples/preference]
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path

Message = dict[str, str]
#: (user question, chosen answer, rejected answer, flaw)
Pair = tuple[str, str, str, str]

WRONG = "wrong_result"
BROKEN = "broken_instruction"

DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
WORDS = ["garden", "river", "lantern", "pepper", "window", "planet", "violin", "marble", "candle", "forest",
         "bridge", "rocket", "pillow", "cactus", "meadow", "harbor", "puzzle", "ladder", "tunnel", "kettle"]
OPPOSITES = {"hot": "cold", "early": "late", "empty": "full", "open": "closed", "light": "heavy",
             "fast": "slow", "loud": "quiet", "wide": "narrow", "rough": "smooth", "inside": "outside",
             "above": "below", "begin": "end", "buy": "sell", "win": "lose", "young": "old"}

#: system prompts with a style rule the chosen answer follows and a ``broken_instruction`` one ignores
STYLES = {
    "cheerful": "You are a cheerful assistant. End every answer with an exclamation mark.",
    "formal": "You are a formal assistant. Begin every answer with 'Certainly.'",
}


#: format rules in a question: a style rule on top would contradict them, so such prompts get no system prompt
FORMAT_RULES = ("Reply with only the number.", "Answer in JSON", "Answer with yes or no.", "in capital letters",
                "Repeat the word")


def styled(style: str | None, answer: str) -> str:
    """The answer as the system prompt's style rule wants it."""
    if style == "cheerful":
        return answer.rstrip(".") + "!"
    if style == "formal":
        return "Certainly. " + answer
    return answer


def slip(rng: random.Random, value: int) -> int:
    """A plausible wrong value: off by a small amount or by ten (never the value itself)."""
    return value + rng.choice([-10, -2, -1, 1, 2, 10])


def arithmetic(rng: random.Random) -> Pair:
    a, b = rng.randint(2, 60), rng.randint(2, 30)
    op = rng.choice(["plus", "minus", "times"])
    value = {"plus": a + b, "minus": a - b, "times": a * b}[op]
    rule = rng.choice([None, "number", "json"])
    if rule == "number":
        q = f"What is {a} {op} {b}? Reply with only the number."
        if rng.random() < 0.5:
            return q, str(value), f"{a} {op} {b} is {value}.", BROKEN
        return q, str(value), str(slip(rng, value)), WRONG
    if rule == "json":
        q = f"What is {a} {op} {b}? Answer in JSON with the key \"answer\"."
        if rng.random() < 0.5:
            return q, f'{{"answer": {value}}}', f"{a} {op} {b} is {value}.", BROKEN
        return q, f'{{"answer": {value}}}', f'{{"answer": {slip(rng, value)}}}', WRONG
    return f"What is {a} {op} {b}?", f"{a} {op} {b} is {value}.", f"{a} {op} {b} is {slip(rng, value)}.", WRONG


def units(rng: random.Random) -> Pair:
    n = rng.randint(2, 24)
    q, unit, factor, wrong_factor, target = rng.choice([
        ("How many minutes are in {n} hours?", "hours", 60, 100, "minutes"),
        ("How many meters are in {n} kilometers?", "kilometers", 1000, 100, "meters"),
        ("Convert {n} kilograms to grams.", "kilograms", 1000, 100, "grams"),
        ("How many seconds are in {n} minutes?", "minutes", 60, 100, "seconds"),
        ("How many hours are in {n} days?", "days", 24, 12, "hours"),
    ])
    answer = "{n} {unit} is {v} {target}."
    return (q.format(n=n), answer.format(n=n, unit=unit, v=n * factor, target=target),
            answer.format(n=n, unit=unit, v=n * wrong_factor, target=target), WRONG)


def sorting(rng: random.Random) -> Pair:
    nums = rng.sample(range(1, 100), rng.randint(3, 5))
    listed = ", ".join(map(str, nums))
    up = sorted(nums)
    wrong = list(up)
    i = rng.randrange(len(wrong) - 1)
    wrong[i], wrong[i + 1] = wrong[i + 1], wrong[i]  # one neighbouring pair swapped: not sorted
    return (f"Sort these numbers from smallest to largest: {listed}", "Sorted: " + ", ".join(map(str, up)) + ".",
            "Sorted: " + ", ".join(map(str, wrong)) + ".", WRONG)


def compare(rng: random.Random) -> Pair:
    a, b = rng.sample(range(1, 1000), 2)
    hi, lo = max(a, b), min(a, b)
    if rng.random() < 0.5:
        return f"Which is larger, {a} or {b}?", f"{hi} is larger than {lo}.", f"{lo} is larger than {hi}.", WRONG
    n = rng.choice([a, b])
    parity, other = ("even", "odd") if n % 2 == 0 else ("odd", "even")
    q = f"Is {n} an even number? Answer with yes or no."
    chosen = "Yes." if parity == "even" else "No."
    if rng.random() < 0.5:
        return q, chosen, f"{n} is an {parity} number.", BROKEN
    return q, chosen, "No." if chosen == "Yes." else "Yes.", WRONG


def words(rng: random.Random) -> Pair:
    word = rng.choice(WORDS)
    kind = rng.choice(["letters", "capitals", "repeat", "opposite"])
    if kind == "letters":
        return (f"How many letters are in the word '{word}'?", f"The word '{word}' has {len(word)} letters.",
                f"The word '{word}' has {len(word) + rng.choice([-1, 1])} letters.", WRONG)
    if kind == "capitals":
        return f"Write the word '{word}' in capital letters.", word.upper(), word, BROKEN
    if kind == "repeat":
        n = rng.randint(2, 4)
        wrong = n + (1 if n < 4 else -1)
        return (f"Repeat the word '{word}' {n} times, separated by spaces.", " ".join([word] * n),
                " ".join([word] * wrong), WRONG)
    w, opp = rng.choice(sorted(OPPOSITES.items()))
    decoy = rng.choice([o for o in sorted(OPPOSITES.values()) if o != opp])
    return f"What is the opposite of '{w}'?", f"The opposite of '{w}' is '{opp}'.", \
        f"The opposite of '{w}' is '{decoy}'.", WRONG


def calendar(rng: random.Random) -> Pair:
    i = rng.randrange(7)
    if rng.random() < 0.5:
        return (f"What day comes after {DAYS[i]}?", f"The day after {DAYS[i]} is {DAYS[(i + 1) % 7]}.",
                f"The day after {DAYS[i]} is {DAYS[(i + 2) % 7]}.", WRONG)
    return (f"What day comes before {DAYS[i]}?", f"The day before {DAYS[i]} is {DAYS[(i - 1) % 7]}.",
            f"The day before {DAYS[i]} is {DAYS[(i + 1) % 7]}.", WRONG)


GENERATORS: list[tuple[Callable[[random.Random], Pair], int]] = [
    (arithmetic, 5), (units, 2), (sorting, 2), (compare, 3), (words, 4), (calendar, 2),
]


def make(count: int, seed: int, exclude: frozenset[str] = frozenset()) -> list[dict]:
    """``count`` pairs from ``seed``, none whose rendered prompt is in ``exclude``, none repeated."""
    rng = random.Random(seed)
    funcs = [f for f, w in GENERATORS for _ in range(w)]
    rows: list[dict] = []
    seen = set(exclude)
    while len(rows) < count:
        question, chosen, rejected, flaw = rng.choice(funcs)(rng)
        style = rng.choice([None, None, None, "cheerful", "formal"])
        prompt: list[Message] = [{"role": "user", "content": question}]
        if style is not None and not any(rule in question for rule in FORMAT_RULES):
            prompt.insert(0, {"role": "system", "content": STYLES[style]})
            if rng.random() < 1 / 3:  # the flaw: the correct answer, the system prompt's rule ignored
                rejected, flaw = chosen, BROKEN
            else:
                rejected = styled(style, rejected)
            chosen = styled(style, chosen)
        key = json.dumps(prompt)
        if key in seen or chosen == rejected:
            continue
        seen.add(key)
        rows.append({"prompt": prompt, "chosen": [{"role": "assistant", "content": chosen}],
                     "rejected": [{"role": "assistant", "content": rejected}], "flaw": flaw})
    return [{"id": i, **row} for i, row in enumerate(rows)]


def write(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> None:
    root = Path(__file__).resolve().parent.parent
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--train", type=int, default=320, help="training pairs (default 320)")
    p.add_argument("--eval", type=int, default=64, help="held-out pairs (default 64)")
    p.add_argument("--seed", type=int, default=0, help="the training file's seed; the held-out file uses seed + 1")
    p.add_argument("--out-dir", default=str(root / "examples" / "preference"))
    ns = p.parse_args(argv)
    train = make(ns.train, ns.seed)
    held_out = make(ns.eval, ns.seed + 1, exclude=frozenset(json.dumps(r["prompt"]) for r in train))
    out = Path(ns.out_dir)
    write(train, out / "train.jsonl")
    write(held_out, out / "eval.jsonl")
    print(f"wrote {len(train)} pairs to {out / 'train.jsonl'} and {len(held_out)} held-out pairs to "
          f"{out / 'eval.jsonl'}")


if __name__ == "__main__":
    main()
