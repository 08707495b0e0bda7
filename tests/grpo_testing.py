"""The tiny GRPO recipe the GRPO run tests share: a one-layer Llama over a word tokenizer, prompts from a JSONL file.

Each test gives only what it is about (the training budget, save steps, the rewards, ...); the model, data
and the settings every such run shares are written once here.
"""

from __future__ import annotations

import os
from typing import Any

TINY_LLAMA = {"type": "llama", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "eos_token_id": 1,
              "pad_token_id": 0, "bos_token_id": None}


def tiny_grpo_recipe(workdir: str, training: dict[str, Any], objective: dict[str, Any]) -> dict[str, Any]:
    """A recipe dict over ``workdir``'s ``tok`` tokenizer and ``prompts.jsonl``: 4 completions of at most 6 tokens
    a prompt, a constant learning rate of 3e-2, every step logged; ``training`` and ``objective`` add to that."""
    return {
        "model": dict(TINY_LLAMA),
        "tokenizer": {"path": os.path.join(workdir, "tok")},
        "data": {"kind": "prompt", "source": os.path.join(workdir, "prompts.jsonl")},
        "training": {"max_length": 32, "num_train_epochs": None, "learning_rate": 3e-2, "scheduler": "constant",
                     "log_steps": 1, "progress_bar": False, "report_to": [], **training},
        "objective": {"type": "grpo", "num_generations": 4, "max_completion_length": 6, **objective},
    }
