"""A tiny GRPO recipe run (prompt data kind, a built-in reward, num_iterations=3, KL to a frozen copy of the
starting policy), used as a subprocess by the resume test.

Usage: python grpo_resume_worker.py WORKDIR RUN [KILL_AT_STEP|-] [REFERENCE_FOLDER]
WORKDIR holds prompts.jsonl and tok/ (written by the test); the run goes to WORKDIR/RUN. With
KILL_AT_STEP the process sends itself SIGKILL right after that step, once its checkpoint writes
are complete.
"""

import os

import scaletrain as st

from resume_worker import run_recipe_worker  # argv, SIGKILL after a step once its checkpoint writes are done


def recipe(workdir: str, out: str, reference: str | None = None) -> st.Recipe:
    objective = {"type": "grpo", "num_generations": 4, "max_completion_length": 6, "num_iterations": 3,
                 "beta": 0.04, "reward_funcs": [{"function": "format_regex", "pattern": r"(?s).*\b(yes|no|maybe|one|two)\b.*"}],
                 "log_completions": False}
    if reference:
        objective["reference"] = reference
    return st.Recipe.from_dict({
        "model": {"type": "llama", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
                  "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "max_position_embeddings": 64, "eos_token_id": 1, "pad_token_id": 0, "bos_token_id": None},
        "tokenizer": {"path": os.path.join(workdir, "tok")},
        "data": {"kind": "prompt", "source": os.path.join(workdir, "prompts.jsonl")},
        "training": {"output_dir": out, "total_batch_size": 16, "max_length": 32, "num_train_epochs": None,
                     "max_training_steps": 6, "learning_rate": 3e-2, "scheduler": "constant", "log_steps": 1,
                     "save_steps": 2, "resume_if_possible": True, "progress_bar": False, "report_to": []},
        "objective": objective,
    })


if __name__ == "__main__":
    run_recipe_worker(recipe)
