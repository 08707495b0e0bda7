"""Generation: the rollout engine (batched sampling from live parameters, with log-probabilities) and
``generate()`` on top of it.

- :mod:`~scaletrain.generation.interface`: :class:`RolloutEngine`, what an RL trainer asks of an engine;
- :mod:`~scaletrain.generation.engine`: :func:`rollout`, :class:`SamplingParams`, :class:`Rollout`,
  the compiled program per shape bucket (:class:`StaticBatchProgram`), and :class:`StaticBatchEngine`,
  the first :class:`RolloutEngine`;
- :mod:`~scaletrain.generation.continuous`: :class:`ContinuousBatchEngine`, decode slots refilled as rows stop,
  over a paged cache (:mod:`~scaletrain.generation.paged_programs` its programs,
  :mod:`~scaletrain.generation.page_pool` which pages are held);
- :mod:`~scaletrain.generation.buckets`: what is padded (prompts left-padded to a power-of-two
  length, the batch to a power of two with finished dummy rows) and the rows the trainer scores;
- :mod:`~scaletrain.generation.sampling`: temperature / top-k / top-p, the per-row keys, and which
  distribution a log-probability is of;
- :mod:`~scaletrain.generation.generate`: the single-call ``generate()``;
- :mod:`~scaletrain.generation.stops`: the ids that end a reply.
"""

from scaletrain.generation.buckets import MIN_PROMPT_BUCKET, PaddedBatch, bucket, left_pad, rollout_rows
from scaletrain.generation.continuous import ContinuousBatchEngine
from scaletrain.generation.engine import (
    Rollout,
    SamplingParams,
    StaticBatchEngine,
    StaticBatchProgram,
    engine_for,
    rollout,
)
from scaletrain.generation.generate import generate
from scaletrain.generation.interface import RolloutEngine
from scaletrain.generation.sampling import filter_logits, pick_tokens, sample_token, sampling_problem
from scaletrain.generation.stops import end_of_turn_id, stop_token_ids, until_stop

__all__ = [
    "ContinuousBatchEngine", "MIN_PROMPT_BUCKET", "PaddedBatch", "Rollout", "RolloutEngine", "SamplingParams",
    "StaticBatchEngine", "StaticBatchProgram", "bucket",
    "end_of_turn_id", "engine_for", "filter_logits", "generate", "left_pad",
    "pick_tokens", "rollout", "rollout_rows", "sample_token", "sampling_problem", "stop_token_ids", "until_stop",
]
