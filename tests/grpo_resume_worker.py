"""A tiny GRPO recipe run (prompt data kind, a built-in reward, num_iterations=3, KL to a frozen copy of the
starting policy), used as a subprocess by the resume test; with ``RESUME_OBJECTIVE=ppo`` in the environment,
the same run as PPO (num_ppo_epochs=3, kl_coef 0.04: a value head trained beside the policy).

Usage: python grpo_resume_worker.py WORKDIR RUN [KILL_AT_STEP|-] [REFERENCE_FOLDER]
WORKDIR holds prompts.jsonl and tok/ (written by the test); the run goes to WORKDIR/RUN. With
KILL_AT_STEP the process sends itself SIGKILL right after that step, once its checkpoint writes
are complete.
"""

import os

import scaletrain as st

from grpo_testing import tiny_grpo_recipe
from resume_worker import run_recipe_worker  # argv, SIGKILL after a step once its checkpoint writes are done


def recipe(workdir: str, out: str, reference: str | None = None) -> st.Recipe:
    objective = {"num_iterations": 3, "beta": 0.04,
                 "reward_funcs": [{"function": "format_regex", "pattern": r"(?s).*\b(yes|no|maybe|one|two)\b.*"}],
                 "log_completions": False}
    if os.environ.get("RESUME_OBJECTIVE") == "ppo":
        objective = {**{k: v for k, v in objective.items() if k not in ("num_iterations", "beta")},
                     "type": "ppo", "num_ppo_epochs": 3, "kl_coef": 0.04}
    if reference:
        objective["reference"] = reference
    return st.Recipe.from_dict(tiny_grpo_recipe(
        workdir, {"output_dir": out, "total_batch_size": 16, "max_training_steps": 6, "save_steps": 2,
                  "resume_if_possible": True}, objective))


if __name__ == "__main__":
    run_recipe_worker(recipe)
