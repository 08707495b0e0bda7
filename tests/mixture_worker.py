"""A recipe run with a data.mixture, as a subprocess of tests/test_mixture.py (so it can be killed).

Usage: python mixture_worker.py RECIPE.yaml [KILL_AT_STEP]
With KILL_AT_STEP the process sends itself SIGKILL right after that step (tests/resume_worker.py's KillAt).
"""

import sys

from resume_worker import KillAt

from scaletrain.recipe import Recipe
from scaletrain.run import run_training


def main() -> None:
    recipe = Recipe.load(sys.argv[1])
    kill_at = int(sys.argv[2]) if len(sys.argv) > 2 else None
    run_training(recipe, callbacks=[KillAt(kill_at)] if kill_at else [])


if __name__ == "__main__":
    main()
