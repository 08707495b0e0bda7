"""A tiny GKD recipe run (prompt rows with completions, lmbda=0.5: some steps sample from the student, the others
read the dataset's completions; a one-layer teacher folder), used as a subprocess by the distillation resume test.

Usage: python distill_resume_worker.py WORKDIR RUN [KILL_AT_STEP|-]
WORKDIR holds prompts.jsonl, tok/ and teacher/ (written by the test); the run goes to WORKDIR/RUN. With
KILL_AT_STEP the process sends itself SIGKILL right after that step, once its checkpoint writes are complete.
"""

import os

import scaletrain as st

from grpo_testing import tiny_grpo_recipe
from resume_worker import run_recipe_worker  # argv, SIGKILL after a step once its checkpoint writes are done


def recipe(workdir: str, out: str, teacher: str | None = None) -> st.Recipe:
    objective = {"type": "gkd", "teacher": teacher or os.path.join(workdir, "teacher"), "lmbda": 0.5,
                 "beta": 0.5, "max_new_tokens": 6}
    raw = tiny_grpo_recipe(workdir, {"output_dir": out, "total_batch_size": 8, "max_training_steps": 6,
                                     "save_steps": 2, "resume_if_possible": True}, {})
    raw["objective"] = objective
    return st.Recipe.from_dict(raw)


if __name__ == "__main__":
    run_recipe_worker(recipe)
