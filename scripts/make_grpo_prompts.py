#!/usr/bin/env python
"""Write ``examples/grpo/prompts.jsonl``: arithmetic questions with their answers, for the GRPO example.

Why generated: no dataset hub is reachable here, and a verifiable reward needs a known answer
per prompt. Each row is a conversation (a system prompt asking for the number alone, then the
question) in the ``prompt`` column and the correct result in the ``answer`` column, which the
built-in ``exact_answer`` reward compares with the completion's last number. The numbers are
small (sums, differences and products below 100) so that a 135M-parameter instruct model gets
some right and some wrong: GRPO learns only from groups whose rewards differ. Reproducible byte
for byte from the seed.

Usage (from the repository root)::

    python scripts/make_grpo_prompts.py [--count 256] [--seed 0] [--out examples/grpo/prompts.jsonl]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SYSTEM = "You are a calculator. Reply with the final number only."
QUESTIONS = {
    "plus": ("What is {a} plus {b}?", lambda a, b: a + b),
    "minus": ("What is {a} minus {b}?", lambda a, b: a - b),
    "times": ("What is {a} times {b}?", lambda a, b: a * b),
    "sum": ("Add {a} and {b}.", lambda a, b: a + b),
}


def make_row(rng: random.Random, index: int) -> dict:
    """One prompt row: ``id``, ``prompt`` (system + user messages), ``answer`` (the result as text)."""
    kind = rng.choice(sorted(QUESTIONS))
    template, result = QUESTIONS[kind]
    if kind == "times":
        a, b = rng.randint(2, 9), rng.randint(2, 9)
    else:
        a, b = rng.randint(2, 49), rng.randint(2, 49)
        if kind == "minus" and b > a:
            a, b = b, a
    return {"id": index, "prompt": [{"role": "system", "content": SYSTEM},
                                    {"role": "user", "content": template.format(a=a, b=b)}],
            "answer": str(result(a, b))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="examples/grpo/prompts.jsonl")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as f:
        for i in range(args.count):
            f.write(json.dumps(make_row(rng, i), ensure_ascii=False) + "\n")
    print(f"wrote {args.count} prompts to {out}")


if __name__ == "__main__":
    main()
