"""The prompts of each GRPO step, in a resumable order, each batch served ``num_iterations`` times.

Why its own iterator: a GRPO step consumes prompts, not token rows, and with ``num_iterations``
= μ one rollout batch feeds μ optimizer steps (TRL's reuse with stored old log-probabilities).
So the iterator hands out each batch of prompt indices μ times in a row, flagging the first
(sample it) from the repeats (reuse it); its position, repeats included, is a small JSON
state that checkpoints store, so a resumed run continues with the same prompts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class PromptBatch:
    """Indices of a step's prompts; ``fresh``: the first of its ``num_iterations`` uses (sample it)."""

    indices: tuple[int, ...]
    epoch: int
    index: int
    fresh: bool


class PromptBatches:
    """Batches of ``per_step`` prompt indices out of ``num_rows``, shuffled per epoch by ``seed``.

    A last partial batch of an epoch is dropped; ``num_epochs`` None repeats forever.
    """

    def __init__(self, num_rows: int, per_step: int, *, seed: int, shuffle: bool = True,
                 num_epochs: int | None = None, repeats: int = 1):
        self.num_rows, self.per_step, self.seed = num_rows, per_step, seed
        self.shuffle, self.num_epochs, self.repeats = shuffle, num_epochs, repeats
        self.batches_per_epoch = num_rows // per_step
        self.epoch = self.index = self.repeat = 0

    def __iter__(self) -> "PromptBatches":
        return self

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_rows)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)

    def __next__(self) -> PromptBatch:
        if self.index >= self.batches_per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
        if self.batches_per_epoch == 0 or (self.num_epochs is not None and self.epoch >= self.num_epochs):
            raise StopIteration
        start = self.index * self.per_step
        indices = tuple(int(i) for i in self._order(self.epoch)[start:start + self.per_step])
        batch = PromptBatch(indices, self.epoch, self.index, self.repeat == 0)
        self.repeat += 1
        if self.repeat == self.repeats:
            self.repeat, self.index = 0, self.index + 1
        return batch

    def get_state(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "index": self.index, "repeat": self.repeat, "per_step": self.per_step,
                "seed": self.seed}

    def set_state(self, state: dict[str, Any]) -> None:
        if state.get("per_step", self.per_step) != self.per_step or state.get("seed", self.seed) != self.seed:
            raise ValueError(f"the checkpoint's prompt order (per_step {state.get('per_step')}, seed "
                             f"{state.get('seed')}) is not this run's (per_step {self.per_step}, seed {self.seed})")
        self.epoch, self.index, self.repeat = int(state["epoch"]), int(state["index"]), int(state["repeat"])
