"""A tiny DPO recipe run (preference data kind, frozen-copy reference), used as a subprocess by the resume test.

Usage: python preference_resume_worker.py WORKDIR RUN [KILL_AT_STEP|-] [REFERENCE_FOLDER]
WORKDIR holds pairs.jsonl and tok/ (written by the test); the run goes to WORKDIR/RUN. With
KILL_AT_STEP the process sends itself SIGKILL right after that step, once its checkpoint writes
are complete.
"""

import os

import scaletrain as st

from resume_worker import run_recipe_worker  # argv, SIGKILL after a step once its checkpoint writes are done


def recipe(workdir: str, out: str, reference: str | None = None) -> st.Recipe:
    objective = {"type": "dpo", "beta": 0.5, "loss_type": ["sigmoid", "hinge"], "loss_weights": [1.0, 0.5]}
    if reference:
        objective["reference"] = reference
    return st.Recipe.from_dict({
        "model": {"type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                  "num_attention_heads": 4, "num_key_value_heads": 2},
        "tokenizer": {"path": os.path.join(workdir, "tok")},
        "data": {"kind": "preference", "source": os.path.join(workdir, "pairs.jsonl"), "eval_fraction": 0.0},
        "training": {"output_dir": out, "total_batch_size": 8, "gradient_accumulation_steps": 2, "max_length": 16,
                     "num_train_epochs": None, "max_training_steps": 6, "learning_rate": 1e-2, "log_steps": 1,
                     "save_steps": 2, "resume_if_possible": True, "progress_bar": False, "do_eval": False,
                     "report_to": []},
        "objective": objective,
    })


if __name__ == "__main__":
    run_recipe_worker(recipe)
