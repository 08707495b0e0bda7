#!/usr/bin/env python
"""Write the distillation example's data (``examples/distill/``) from the GRPO example's arithmetic prompts.

Why these splits: the example makes its own teacher (no larger SmolLM2 is offline), so the prompts are cut
three ways: the teacher is fine-tuned on the first 128 rows with their answers as the assistant turn
(``teacher_sft.jsonl``, chat rows: it learns to reply with the number alone, as the system prompt asks and
the base model mostly does not); the student is distilled on the next 96, prompts only (``prompts.jsonl``:
on-policy distillation needs no answers); the last 32 rows, less any whose question is already in the first
two parts or earlier in this one (the source draws small numbers, so questions repeat), are held out
(``heldout.jsonl``): no model trains on them, and they measure the student's agreement with the teacher
before and after (``examples/distill/agreement.py``). The teacher's and the student's parts may share a
question; only the held-out part must be new. Reproducible byte for byte from ``examples/grpo/prompts.jsonl``.

Usage (from the repository root)::

    python scripts/make_distill_data.py [--source examples/grpo/prompts.jsonl] [--out examples/distill]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

TEACHER_ROWS, STUDENT_ROWS = 128, 96


def question(row: dict) -> str:
    """The row's user turn: what makes two rows the same question (the system prompt is every row's)."""
    return row["prompt"][-1]["content"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--source", default="examples/grpo/prompts.jsonl")
    parser.add_argument("--out", default="examples/distill")
    args = parser.parse_args()
    rows = [json.loads(line) for line in Path(args.source).read_text(encoding="utf-8").splitlines() if line]
    teacher = [{"id": r["id"], "messages": r["prompt"] + [{"role": "assistant", "content": r["answer"]}]}
               for r in rows[:TEACHER_ROWS]]
    student = [{"id": r["id"], "prompt": r["prompt"]} for r in rows[TEACHER_ROWS: TEACHER_ROWS + STUDENT_ROWS]]
    seen = {question(r) for r in rows[: TEACHER_ROWS + STUDENT_ROWS]}
    heldout = []
    for r in rows[TEACHER_ROWS + STUDENT_ROWS:]:
        if question(r) not in seen:
            seen.add(question(r))
            heldout.append({"id": r["id"], "prompt": r["prompt"]})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, part in (("teacher_sft", teacher), ("prompts", student), ("heldout", heldout)):
        with (out / f"{name}.jsonl").open("w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in part)
        print(f"wrote {len(part)} rows to {out / name}.jsonl")


if __name__ == "__main__":
    main()
