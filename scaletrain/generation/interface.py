"""The rollout interface: what an RL trainer asks of whatever samples its completions.

Why an interface: the trainer's step (``scaletrain.rl.trainer``) needs completions sampled from
the live train state, their per-token log-probabilities as the sampler drew them, and which
positions are padding; it does not care how a batch is scheduled. Today's engine runs a static
batch per shape bucket (:class:`~scaletrain.generation.engine.StaticBatchEngine`); a
continuous-batching engine over a paged cache, or a multi-turn loop that hands each turn to an
environment before sampling the next, implements the same one method and the trainer is left
as it is (``GRPOTrainer(rollout_engine=...)``, or override ``make_rollout_engine``).

The contract, which every implementation keeps:

- **Live weights**: sample from ``state`` (a ``TrainState``: ``graphdef``, ``params`` and, for
  LoRA, the unmerged ``frozen`` base) where it lives; no copy of the weights, no sync.
- **Rows in request order**: ``num_generations`` completions of each prompt, adjacent (prompt
  ``i``'s at rows ``i * G .. i * G + G - 1``), whatever slot or batch ran them.
- **Determinism**: a row's tokens depend only on ``(seed, step, row, position)``, so a resumed
  run samples the completions the uninterrupted one did. ``row`` is the row's request index unless
  ``rows`` gives each output row its own id (a multi-turn rollout keys a row's later turns by the
  row itself, not by its place among the rows still going).
- **What comes back** (:class:`~scaletrain.generation.engine.Rollout`, device arrays, rows over
  the mesh's batch axes): ``prompt_ids`` / ``prompt_mask`` left-padded (mask 0 on padding),
  ``completion_ids`` / ``completion_mask`` right-padded to ``max_completion_length`` (mask 1 up to
  and including the stop token; the mask is what the loss counts), ``log_probs`` the sampler's
  log-probability of each completion token (0 under a mask of 0), ``lengths`` and ``truncated``
  per row. Nothing is read to the host here: the trainer reads the completion ids (to decode them
  for the rewards) and leaves the rest on the devices.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from scaletrain.generation.engine import Rollout, SamplingParams, StaticBatchEngine


@runtime_checkable
class RolloutEngine(Protocol):
    """Samples ``num_generations`` completions of each prompt from the live ``state`` (see the module docstring).

    ``sampling``: how it samples (TRL's names; the trainer scores the same tokens at its ``temperature``).
    """

    sampling: SamplingParams

    def generate(self, state: Any, prompts: Sequence[Sequence[int]], *, num_generations: int = 1, seed: int = 0,
                 step: int = 0, rows: Sequence[int] | None = None) -> Rollout:
        """The rollout of ``prompts`` (token ids, any lengths) at ``(seed, step)``, as device arrays; ``rows``: the id
        each output row's draws are keyed by (``len(prompts) * num_generations`` of them; default its index)."""
        ...


__all__ = ["Rollout", "RolloutEngine", "SamplingParams", "StaticBatchEngine"]
