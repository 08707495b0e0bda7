"""A tiny reward-model recipe run (the DPO resume worker's model and pairs, ``objective.type: reward``), used as a
subprocess by tests/test_reward_resume.py.

Usage: python reward_resume_worker.py WORKDIR RUN [KILL_AT_STEP|-]
"""

import scaletrain as st

from preference_resume_worker import recipe as dpo_recipe
from resume_worker import run_recipe_worker  # argv, SIGKILL after a step once its checkpoint writes are done


def recipe(workdir: str, out: str, reference: str | None = None) -> st.Recipe:
    data = dpo_recipe(workdir, out).to_dict()
    data["objective"] = {"type": "reward", "center_rewards_coefficient": 0.01}
    return st.Recipe.from_dict(data)


if __name__ == "__main__":
    run_recipe_worker(recipe)
