"""Which source fills each slot of each global batch of a mixture: a pure function of the slot.

Why a pure function of the batch index rather than a sampler with state: resuming must
give the batches an uninterrupted run would have seen, on any number of processes. Here
the position of every source after batch ``b`` is integer arithmetic on ``b``, so the
iterator's state is one integer (``next_index``) and a restore replays nothing.

How the slots are laid out. Each stage (a range of steps with fixed weights) turns the
token weights into row rates (``weight / mean real tokens per row``: a source whose rows
are less full gets more of them, so the *token* shares match the weights), rounds the
rates to whole rows out of a cycle of :data:`CYCLE` rows (largest remainder, at least one
row for every positive weight) and interleaves them evenly: source ``k`` with ``n_k``
rows per cycle gets the slots whose times ``(2i + 1) / (2 n_k)`` come first (Webster's
sequence; ties go to the lower source index). Among the first ``j`` slots of a stage a
source then has within ``1.5 (K + 1)`` rows of ``j n_k / CYCLE`` (``K`` sources): its
events up to the ``j``-th slot's time ``T`` number ``floor(n_k T + 1/2)``, give or take one
tied event, and the ``K`` sources' counts add up to ``j``. Each source is read in order
through a permutation of its rows drawn per pass (see :mod:`scaletrain.data.mixture`):
sampling is without replacement within a pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

#: slots in one interleaving cycle: row rates are resolved to 1 / CYCLE
CYCLE = 10_000

#: a source's weights as ``(first step, weight)`` pairs, sorted by step; before the first step its weight is 0
Weights = tuple[tuple[int, float], ...]


def cycle_counts(rates: np.ndarray, cycle: int = CYCLE) -> np.ndarray:
    """Rows per cycle for each source: ``rates`` (summing to 1) rounded by largest remainder, none
    positive rounded to 0 (a row is taken from the largest count for each such source)."""
    exact = np.asarray(rates, dtype=np.float64) * cycle
    counts = np.floor(exact).astype(np.int64)
    short = cycle - int(counts.sum())
    order = np.lexsort((np.arange(exact.size), -(exact - counts)))  # largest remainder first, then index
    counts[order[:short]] += 1
    for k in np.flatnonzero((counts == 0) & (exact > 0)):
        counts[int(np.argmax(counts))] -= 1
        counts[k] = 1
    return counts


def interleave(counts: np.ndarray) -> np.ndarray:
    """The source of each slot of a cycle: source ``k``'s ``i``-th row at time ``(2i + 1) / (2 n_k)``, in time order.

    Equal rationals divide to the same float (IEEE division is correctly rounded), so a tie
    is a tie on every machine and goes to the lower index.
    """
    ks = np.repeat(np.arange(counts.size), counts)
    starts = np.cumsum(counts) - counts
    i = np.arange(ks.size) - np.repeat(starts, counts)
    times = (2 * i + 1) / (2 * counts[ks]).astype(np.float64)
    return ks[np.lexsort((ks, times))]


@dataclass(frozen=True)
class Stage:
    """Steps ``start ..`` (batch indices) with fixed rates: the cycle and each source's rows before the stage."""

    start: int
    counts: np.ndarray  # [K] rows per cycle
    pattern: np.ndarray  # [CYCLE] source of each slot
    before: np.ndarray  # [CYCLE + 1, K] rows of each source in the slots before j (exclusive prefix)
    base: np.ndarray  # [K] rows of each source taken by the earlier stages

    def taken(self, slots: int) -> np.ndarray:
        """Rows of each source in the stage's first ``slots`` slots."""
        q, r = divmod(slots, self.counts.sum())
        return q * self.counts + self.before[r]


def stage_starts(weights: Sequence[Weights]) -> list[int]:
    """Every step at which some source's weight changes, from 0."""
    return sorted({0, *(step for w in weights for step, _ in w)})


def weight_at(weights: Weights, step: int) -> float:
    """The weight in force at batch index ``step``: the last one set at or before it (0 before the first)."""
    value = 0.0
    for first, w in weights:
        if first <= step:
            value = w
    return value


class MixtureSchedule:
    """Source and row position of every slot, for ``K`` sources and a global batch of ``G`` rows.

    ``weights[k]`` are source ``k``'s token weights by stage, ``tokens_per_row[k]`` its mean
    real tokens per row (the rates are ``weight / tokens_per_row``, normalised per stage).
    """

    def __init__(self, weights: Sequence[Weights], tokens_per_row: Sequence[float], global_batch_size: int,
                 cycle: int = CYCLE):
        self.num_sources = len(weights)
        self.global_batch_size = global_batch_size
        self.stages: list[Stage] = []
        base = np.zeros(self.num_sources, dtype=np.int64)
        starts = stage_starts(weights)
        for s, start in enumerate(starts):
            w = np.array([weight_at(wk, start) for wk in weights], dtype=np.float64)
            rates = w / np.asarray(tokens_per_row, dtype=np.float64)
            counts = cycle_counts(rates / rates.sum(), cycle)
            pattern = interleave(counts)
            before = np.zeros((cycle + 1, self.num_sources), dtype=np.int64)
            before[np.arange(1, cycle + 1), pattern] = 1
            before = np.cumsum(before, axis=0)
            stage = Stage(start, counts, pattern, before, base)
            self.stages.append(stage)
            if s + 1 < len(starts):
                base = base + stage.taken((starts[s + 1] - start) * global_batch_size)

    def stage_of(self, batch: int) -> Stage:
        stage = self.stages[0]
        for candidate in self.stages:
            if candidate.start <= batch:
                stage = candidate
        return stage

    def batch_slots(self, batch: int) -> tuple[np.ndarray, np.ndarray]:
        """``(source, position)`` of each of the ``G`` slots of global batch ``batch``.

        ``position`` counts the source's rows from the start of training (0-based), across passes.
        """
        stage = self.stage_of(batch)
        cycle = int(stage.counts.sum())
        j = (batch - stage.start) * self.global_batch_size + np.arange(self.global_batch_size, dtype=np.int64)
        q, r = np.divmod(j, cycle)
        source = stage.pattern[r]
        position = stage.base[source] + q * stage.counts[source] + stage.before[r, source]
        return source, position

    def taken_through(self, batch: int) -> np.ndarray:
        """Rows of each source in global batches ``0 .. batch`` (none for ``batch < 0``)."""
        if batch < 0:
            return np.zeros(self.num_sources, dtype=np.int64)
        stage = self.stage_of(batch)
        return stage.base + stage.taken((batch + 1 - stage.start) * self.global_batch_size)

    def first_batch_reading(self, source: int, position: int) -> int | None:
        """The global batch that takes row ``position`` of ``source`` (None: never, its weight ends at 0)."""
        G = self.global_batch_size
        for s, stage in enumerate(self.stages):
            last = s + 1 == len(self.stages)
            end = None if last else stage.base + stage.taken((self.stages[s + 1].start - stage.start) * G)
            if end is not None and end[source] <= position:
                continue
            if stage.counts[source] == 0:
                return None
            q, r = divmod(position - int(stage.base[source]), int(stage.counts[source]))
            slot = q * int(stage.counts.sum()) + int(np.flatnonzero(stage.pattern == source)[r])
            return stage.start + slot // G
        return None
