"""The GRPO run plan's batch lines: what a rollout samples and what an update reads.

Why not the base plan's ``total_batch_size x max_length``: GRPO reads no ``training.max_length``. A rollout's
rows are its prompts' completions, left-padded to the engine's prompt bucket; an update reads each row's prompt
(its padding cut to the step's longest prompt, ``rl/batch.py``) and completion, in micro-batches. The figures
here are the ones the rollout engine and the update compute with.
"""

from __future__ import annotations

from typing import Any

from scaletrain.generation.buckets import MIN_PROMPT_BUCKET, round_up_pow2
from scaletrain.rl.batch import kept_prompt_columns


def grpo_plan_lines(arguments: Any, options: Any, prompt_lengths: list[int], batch_devices: int) -> list[str]:
    """``rollout`` and ``update`` lines of the printed plan for prompts of ``prompt_lengths`` tokens (after
    ``max_prompt_length``), rows split over ``batch_devices`` devices."""
    o, g = options, options.num_generations
    rows = arguments.total_batch_size
    prompts = rows // g
    shortest, longest = min(prompt_lengths), max(prompt_lengths)
    bucket = round_up_pow2(longest, MIN_PROMPT_BUCKET)
    width = kept_prompt_columns(bucket, longest) + o.max_completion_length
    every = "every step" if o.num_iterations == 1 else f"every {o.num_iterations} steps (num_iterations)"
    micro = arguments.gradient_accumulation_steps
    cut = f", the last {o.max_prompt_length} kept" if o.max_prompt_length is not None else ""
    return [
        f"rollout         {prompts} prompts x {g} completions = {rows} rows, {every}; engine batch "
        f"{round_up_pow2(rows, batch_devices)} rows",
        f"                prompts {shortest}-{longest} tokens{cut} (padded to a bucket of at most {bucket}), "
        f"completions up to {o.max_completion_length} tokens (objective.max_completion_length)",
        f"update          {rows} rows x at most {width} tokens (prompt + completion), {micro} micro-batch(es) of "
        f"{rows // micro} rows; training.max_length ({arguments.max_length}) is not used by GRPO",
    ]
