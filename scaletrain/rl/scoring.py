"""From a rollout's completion ids on the host to the rewards' inputs, the figures and ``completions.jsonl``.

Why host-side and apart from the trainer: rewards are Python callables over text, so a rollout's
completion ids are read to the host once per step; what is done with them there (decode, the
reward functions' inputs, the completion figures and records under TRL's names) is plain work
that the tests check without a model. The per-token arrays stay on the devices
(``rl.step_programs``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from scaletrain.data.prompts import PromptRow, is_messages


def decode(tokenizer: Any, completion_ids: np.ndarray, lengths: np.ndarray, conversational: bool) -> list[Any]:
    """Each completion's text (special tokens dropped, as TRL decodes), or ``[{"role": "assistant", ...}]``
    for conversational prompts."""
    texts = [tokenizer.decode([int(t) for t in row[:n]], skip_special_tokens=True)
             for row, n in zip(completion_ids, lengths)]
    return [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts


def reward_inputs(prompts: Sequence[PromptRow], num_generations: int, completion_ids: np.ndarray,
                  lengths: np.ndarray) -> tuple[list[Any], dict[str, list[Any]]]:
    """``(prompts, columns)`` for the reward functions: each prompt and each of its columns repeated for its
    ``num_generations`` completions (the first row's columns, as TRL takes them), plus ``completion_ids``."""
    repeated = [p for p in prompts for _ in range(num_generations)]
    keys = list(prompts[0].columns) if prompts else []
    columns: dict[str, list[Any]] = {k: [p.columns.get(k) for p in repeated] for k in keys}
    columns["completion_ids"] = [[int(t) for t in row[:n]] for row, n in zip(completion_ids, lengths)]
    return [p.prompt for p in repeated], columns


def completion_metrics(lengths: np.ndarray, truncated: np.ndarray) -> dict[str, float]:
    """TRL's ``completions/*``: lengths (stop token counted) and the share cut at ``max_completion_length``."""
    lengths = np.asarray(lengths, np.float64)
    truncated = np.asarray(truncated, bool)
    ended = lengths[~truncated] if (~truncated).any() else np.zeros(1)
    return {
        "completions/mean_length": float(lengths.mean()),
        "completions/min_length": float(lengths.min()),
        "completions/max_length": float(lengths.max()),
        "completions/clipped_ratio": float(truncated.mean()),
        "completions/mean_terminated_length": float(ended.mean()),
        "completions/min_terminated_length": float(ended.min()),
        "completions/max_terminated_length": float(ended.max()),
    }


def logprob_diff(trainer_logps: Any, sampler_logps: Any, mask: Any) -> dict[str, float]:
    """``rollout/logprob_diff_max`` and ``_mean``: how far the sampler's log-probabilities of its tokens are from
    the trainer's forward over the same tokens (0 for an exactly on-policy rollout); the step's own device
    function (``rl.step_programs.gap_figures``), read here."""
    import jax.numpy as jnp

    from scaletrain.rl.step_programs import gap_figures

    figures = gap_figures(jnp.asarray(trainer_logps, jnp.float32), jnp.asarray(sampler_logps, jnp.float32),
                          jnp.asarray(mask))
    return {k: float(v) for k, v in figures.items()}


def completion_records(step: int, prompts: list[Any], completions: list[Any], rewards: np.ndarray,
                       names: Sequence[str], advantages: np.ndarray, limit: int | None) -> list[dict[str, Any]]:
    """Rows of ``completions.jsonl`` (what a person reads): step, prompt, completion, each reward, advantage."""
    out = []
    for i in range(len(completions) if limit is None else min(limit, len(completions))):
        completion = completions[i]
        out.append({
            "step": step,
            "prompt": prompts[i],
            "completion": completion[-1]["content"] if is_messages(completion) else completion,
            "rewards": {n: (None if np.isnan(rewards[i, j]) else float(rewards[i, j])) for j, n in enumerate(names)},
            "advantage": float(advantages[i]),
        })
    return out


def logs_completions(step: int, num_iterations: int, every: int, last_step: int) -> bool:
    """Whether the rollout sampled at ``step`` goes to ``completions.jsonl``: one of the steps it trains
    (``step`` to the end of its ``num_iterations`` cycle, at most ``last_step``) is a multiple of ``every``.

    Why: TRL logs completions on its logging steps (N, 2N, ...: the rollout each trains on); with
    one iteration those are the logged steps. A rollout reused by several logging steps is written
    once, under the step that sampled it, so a resume that cuts the records after its checkpoint
    (``log_files.drop_records_after``) never cuts one it will not sample again. Cycles start at steps
    1, 1 + μ, ... (``PromptBatches`` repeats each batch μ times).
    """
    cycle_end = min(((step - 1) // num_iterations + 1) * num_iterations, last_step)
    return cycle_end >= step and cycle_end // every > (step - 1) // every
