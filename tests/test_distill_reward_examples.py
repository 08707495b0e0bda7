"""The distillation example's data (docs/post-training.md): its files are what scripts/make_distill_data.py
writes, and no held-out question is trained on. The real runs (SmolLM2-135M, minutes each) are not repeated here.
"""

from __future__ import annotations

import importlib.util
import json

from data_helpers import REPO


def test_make_distill_data_writes_the_shipped_files_and_no_held_out_question_is_trained_on(tmp_path):
    spec = importlib.util.spec_from_file_location("make_distill_data", REPO / "scripts" / "make_distill_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    import sys

    argv, sys.argv = sys.argv, ["make_distill_data", "--out", str(tmp_path)]
    try:
        module.main()
    finally:
        sys.argv = argv
    parts = {}
    for name in ("teacher_sft", "prompts", "heldout"):
        shipped = REPO / "examples" / "distill" / f"{name}.jsonl"
        assert (tmp_path / f"{name}.jsonl").read_bytes() == shipped.read_bytes(), name
        parts[name] = [json.loads(line) for line in shipped.read_text().splitlines()]
    questions = {name: [json.dumps((r.get("messages") or r["prompt"])[:2]) for r in rows]
                 for name, rows in parts.items()}
    assert [len(parts[n]) for n in parts] == [128, 96, 27]  # 5 of the last 32 rows repeat a question: dropped
    held_out = set(questions["heldout"])
    assert len(held_out) == 27 and not held_out & set(questions["teacher_sft"] + questions["prompts"])
