"""A rollout's rows scored where they are held, and the few per-row figures every process needs, gathered.

Why one function: the rewards run on the host for the rows this process owns (``RowLayout.owned``), under
``reward_timeout`` and cut short by a signal; a failure or a signal seen by one process must stop every
process at the same point (``raise_agreed``), and the rewards, lengths, truncation flags and timeout flags are
gathered in one collective so that every process forms the same batch-wide
advantages and figures. The trainer keeps only what it does with them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from scaletrain.errors import DataError
from scaletrain.rl.process_rows import RowLayout, raise_agreed
from scaletrain.rl.rewards import RewardFunction, score_calls
from scaletrain.rl.scoring import decode, reward_inputs
from scaletrain.training.stopping import pending_signal
from scaletrain.user_calls import StopRequested


@dataclasses.dataclass(frozen=True)
class RowScores:
    """Every row's figures, the same on every process; ``comp_ids``: this process's owned rows' completions."""

    per_func: np.ndarray  # [N, F] float32, NaN where a reward gave None
    lengths: np.ndarray  # [N] completion lengths
    truncated: np.ndarray  # [N] bool: stopped by max_completion_length
    timeouts: dict[str, float]  # rewards/<name>/timeouts: calls given up at reward_timeout
    comp_ids: np.ndarray


def score_rows(layout: RowLayout, held: dict[str, np.ndarray], rows: Sequence[Any], num_generations: int,
               reward_functions: Sequence[RewardFunction], tokenizer: Any, conversational: bool,
               timeout: float, agent: Any = None) -> RowScores:
    """Run the rewards of the rows this process owns (``held``: its rows of the rollout's ``completion_ids``,
    ``lengths`` and ``truncated``, the only arrays a step reads to the host; ``rows``: the step's prompt rows,
    ``num_generations`` completions each) and gather the per-row figures. ``agent``: a multi-turn step's
    host record (``rl/agentic.py``): each row's completion is its messages (turns and tool results, as TRL
    gives them) and the ``environments`` column holds its environment."""
    own = np.searchsorted(layout.held, layout.owned)
    comp_ids, lengths = held["completion_ids"][own], held["lengths"][own]
    names = [f.name for f in reward_functions]
    per_func, timed_out, failure = np.zeros((0, len(names)), np.float32), np.zeros((0, len(names)), bool), None
    try:
        if len(own):
            completions = decode(tokenizer, comp_ids, lengths, conversational) if agent is None else \
                [agent.messages[r] for r in layout.owned]
            prompt_values, columns = reward_inputs([rows[r // num_generations] for r in layout.owned], 1, comp_ids,
                                                   lengths)
            if agent is not None:
                columns["environments"] = [agent.environments[r] for r in layout.owned]
                columns["environment_rewards"] = [agent.environment_rewards[r] for r in layout.owned]
            scores = score_calls(reward_functions, prompt_values, completions, columns, layout.owned,
                                 timeout=timeout, stop_requested=pending_signal)
            per_func, timed_out = scores.values, scores.timed_out
    except (DataError, StopRequested) as err:  # said by this process, after telling the others
        failure = err
    raise_agreed(failure)  # a reward that raised, or a signal while waiting for one, stops every process
    every = layout.gather(np.concatenate([per_func.astype(np.float64), lengths[:, None].astype(np.float64),
                                          held["truncated"][own, None].astype(np.float64),
                                          timed_out.astype(np.float64)], axis=1))
    k = len(names)
    return RowScores(per_func=every[:, :k].astype(np.float32), lengths=every[:, k], truncated=every[:, k + 1] != 0,
                     timeouts={f"rewards/{n}/timeouts": float(every[:, k + 2 + j].sum()) for j, n in enumerate(names)},
                     comp_ids=comp_ids)
