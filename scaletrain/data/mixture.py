"""Weighted, staged mixtures of sources: the rows (``MixtureRows``), their batches, per-source eval rows.

Why the rows of every source live in one :class:`PackedRows`: the loader, the trainer and
a checkpoint then see one dataset, gathered like any other; only *which* rows form each
global batch differs, and that is :class:`MixtureBatchIterator`'s job. It asks
:class:`~scaletrain.data.mixture_schedule.MixtureSchedule` which source fills each slot and
how many rows of it came before (pure functions of the batch index), and reads that
source in order through a permutation of its rows drawn per pass from ``(seed, source,
pass)``: without replacement within a pass. A source that runs out starts a new pass
(``on_exhausted: repeat``, logged) or ends the training data at the batch that would need a
row past its end (``on_exhausted: stop``, logged). The iterator's state is the number of
batches served, so a resume restores it in O(1) (plus one permutation per source).

Sources of the two language-model kinds (``pretrain``, ``chat``) mix; pre-training rows get
a loss mask of ones on their tokens when a chat source brings one, so every batch has the
same keys and the same objective trains on both.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from scaletrain.data.loader import _check_layout, _GatherRows
from scaletrain.data.mixture_schedule import MixtureSchedule, Weights, stage_starts, weight_at
from scaletrain.data.packing import PackedRows
from scaletrain.data.splits import LMSplits
from scaletrain.errors import ConfigError, DataError, ScaletrainError

logger = logging.getLogger("scaletrain")


@dataclass(frozen=True)
class RowsPart:
    """Rows ``start:stop`` of a concatenation belong to source ``name``.

    ``weights`` and ``on_exhausted`` say how a training mixture draws it;
    ``bytes_per_token`` is an eval part's (NaN: unknown, no bits per byte).
    """

    name: str
    start: int
    stop: int
    weights: Weights = ((0, 1.0),)
    on_exhausted: str = "repeat"
    bytes_per_token: float = float("nan")

    @property
    def num_rows(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True, eq=False)
class NamedRows(PackedRows):
    """Packed rows made of named parts (a mixture's eval rows): evaluated part by part."""

    parts: tuple[RowsPart, ...] = ()

    def part_rows(self, part: RowsPart) -> PackedRows:
        """The rows of one part (views, no copy)."""
        lm = None if self.loss_mask is None else self.loss_mask[part.start:part.stop]
        return PackedRows(self.input_ids[part.start:part.stop], self.segment_ids[part.start:part.stop],
                          self.positions[part.start:part.stop], pad_id=self.pad_id, loss_mask=lm)

    def named_parts(self) -> list[tuple[str, PackedRows, float | None]]:
        """``(name, rows, bytes per token or None)`` for each non-empty part."""
        return [(p.name, self.part_rows(p), p.bytes_per_token if np.isfinite(p.bytes_per_token) else None)
                for p in self.parts if p.num_rows > 0]


@dataclass(frozen=True, eq=False)
class MixtureRows(NamedRows):
    """A training mixture: the sources' rows, one after another, served by :class:`MixtureBatchIterator`."""

    def batch_iterator(self, global_batch_size: int, *, seed: int, shuffle: bool, num_epochs: int | None,
                       process_index: int, process_count: int) -> MixtureBatchIterator:
        """What :func:`scaletrain.data.loader.make_batch_iterator` returns for these rows."""
        return MixtureBatchIterator(self, global_batch_size, seed=seed, shuffle=shuffle, num_epochs=num_epochs,
                                    process_index=process_index, process_count=process_count)

    def fingerprint(self) -> str:
        """A digest of the sources, their sizes and weights: a resume with another mixture is warned about."""
        spec = [(p.name, p.num_rows, p.weights, p.on_exhausted) for p in self.parts]
        return hashlib.sha256(json.dumps(spec).encode()).hexdigest()[:16]


def concatenate_parts(parts: Mapping[str, PackedRows], cls: type[NamedRows] = NamedRows,
                      **per_part: Mapping[str, Any]) -> NamedRows:
    """One ``cls`` holding ``parts`` in order; ``per_part`` gives each part's :class:`RowsPart` fields by name."""
    rows = list(parts.values())
    if not rows:
        raise DataError("a mixture needs at least one source")
    pad_ids = {r.pad_id for r in rows}
    if len(pad_ids) > 1:
        raise DataError(f"the mixture's sources pad with different ids {sorted(pad_ids)}; use one tokenizer")
    lengths = {r.max_length for r in rows}
    if len(lengths) > 1:
        raise DataError(f"the mixture's sources have rows of different lengths {sorted(lengths)}")
    any_mask = any(r.loss_mask is not None for r in rows)
    masks = [r.loss_mask if r.loss_mask is not None else (r.segment_ids > 0).astype(np.int32) for r in rows]
    bounds = np.cumsum([0, *(r.num_rows for r in rows)])
    described = tuple(
        RowsPart(name, int(bounds[i]), int(bounds[i + 1]), **{k: v[name] for k, v in per_part.items() if name in v})
        for i, name in enumerate(parts)
    )
    return cls(
        np.concatenate([r.input_ids for r in rows]), np.concatenate([r.segment_ids for r in rows]),
        np.concatenate([r.positions for r in rows]), pad_id=rows[0].pad_id,
        loss_mask=np.concatenate(masks) if any_mask else None, parts=described,
    )


def as_weights(weight: float | Mapping[int, float]) -> Weights:
    """A recipe's ``weight`` (a number, or ``{first step: weight}``) as sorted ``(step, weight)`` pairs."""
    if isinstance(weight, Mapping):
        return tuple(sorted((int(s), float(w)) for s, w in weight.items()))
    return ((0, float(weight)),)


def mix_rows(parts: Mapping[str, PackedRows], weights: Mapping[str, float | Mapping[int, float]],
             on_exhausted: Mapping[str, str] | None = None) -> MixtureRows:
    """A training mixture of ``parts`` (name -> packed rows), each drawn by its token ``weights``.

    A weight is a number or ``{first step: weight}`` (a staged mixture; before a source's first
    step its weight is 0). ``on_exhausted[name]`` is ``repeat`` (default) or ``stop``.
    """
    on_exhausted = dict(on_exhausted or {})
    for name in parts:
        if name not in weights:
            raise ConfigError(f"mixture source {name!r} has no weight")
        check_weight(as_weights(weights[name]), f"the weight of mixture source {name!r}")
        if on_exhausted.setdefault(name, "repeat") not in ("repeat", "stop"):
            raise ConfigError(f"on_exhausted of mixture source {name!r} must be repeat or stop")
        if parts[name].num_rows == 0:
            raise DataError(f"mixture source {name!r} has no training rows")
    if unknown := set(weights) - set(parts):
        raise ConfigError(f"weights name unknown mixture sources {sorted(unknown)}; the sources are {list(parts)}")
    staged = [as_weights(weights[n]) for n in parts]
    for start in stage_starts(staged):
        if not any(weight_at(w, start) > 0 for w in staged):
            raise ConfigError(f"no mixture source has a positive weight at step {start}")
    return concatenate_parts(parts, MixtureRows, weights={n: as_weights(w) for n, w in weights.items()},
                             on_exhausted=on_exhausted)  # type: ignore[return-value]


def check_weight(weights: Weights, what: str) -> None:
    """A weight is positive, or a ``{step: weight}`` of steps >= 0 and weights >= 0, one of them positive."""
    if any(step < 0 for step, _ in weights):
        raise ConfigError(f"{what}: stage steps must be >= 0")
    if any(not np.isfinite(w) or w < 0 for _, w in weights) or not any(w > 0 for _, w in weights):
        raise ConfigError(f"{what} must be positive (a staged weight may be 0 in some stages, not in all)")


class MixtureBatchIterator:
    """This process's share of each global batch of a mixture; state ``{"next_index": batches served}``.

    ``data_metrics(step)`` gives the real tokens each source put into the batch of ``step`` and
    since the start of training, their shares and each source's passes (rows read / rows held).
    """

    def __init__(self, rows: MixtureRows, global_batch_size: int, *, seed: int, shuffle: bool,
                 num_epochs: int | None, process_index: int, process_count: int):
        _check_layout(rows.num_rows, global_batch_size, seed, num_epochs, process_index, process_count)
        self.rows = rows
        self.parts = rows.parts
        self._seed, self._shuffle = seed, shuffle
        self._sizes = np.array([p.num_rows for p in self.parts], dtype=np.int64)
        self._starts = np.array([p.start for p in self.parts], dtype=np.int64)
        self._row_tokens = np.count_nonzero(rows.segment_ids, axis=1).astype(np.int64)
        self._totals = [int(self._row_tokens[p.start:p.stop].sum()) for p in self.parts]
        self.schedule = MixtureSchedule([p.weights for p in self.parts],
                                        [max(t / n, 1e-9) for t, n in zip(self._totals, self._sizes)],
                                        global_batch_size)
        per_process = global_batch_size // process_count
        self._slice = slice(process_index * per_process, (process_index + 1) * per_process)
        self._gather = _GatherRows(rows)
        self._passes: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        self._fingerprint = rows.fingerprint()
        self.limit, self._stopper = self._batch_limit(num_epochs, global_batch_size)
        self._next = 0
        self._ended = False

    def _batch_limit(self, num_epochs: int | None, global_batch_size: int) -> tuple[int | None, int | None]:
        """Batches there are: ``num_epochs`` passes of the concatenation, and before a ``stop`` source runs out."""
        limit = None if num_epochs is None else num_epochs * (self.rows.num_rows // global_batch_size)
        stopper = None
        for k, part in enumerate(self.parts):
            if part.on_exhausted == "stop":
                end = self.schedule.first_batch_reading(k, part.num_rows)
                if end is not None and (limit is None or end < limit):
                    limit, stopper = end, k
        return limit, stopper

    # ---- rows of each source, pass by pass --------------------------------------------
    def _pass(self, k: int, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """Source ``k``'s row order in pass ``epoch`` and its real tokens before each position (cached)."""
        key = (k, epoch)
        if key not in self._passes:
            n = int(self._sizes[k])
            order = (np.random.default_rng([self._seed, k, epoch]).permutation(n) if self._shuffle
                     else np.arange(n))
            tokens = self._row_tokens[self._starts[k] + order]
            before = np.concatenate([[0], np.cumsum(tokens)])
            if len(self._passes) >= 4 * len(self.parts):
                self._passes.pop(next(iter(self._passes)))
            self._passes[key] = (order, before)
        return self._passes[key]

    def _rows_of(self, source: np.ndarray, position: np.ndarray) -> np.ndarray:
        """Row indices (into the concatenation) of each slot's source and position."""
        out = np.empty(source.size, dtype=np.int64)
        for k in np.unique(source):
            mine = source == k
            epoch, i = np.divmod(position[mine], self._sizes[k])
            rows = np.empty(i.size, dtype=np.int64)
            for e in np.unique(epoch):
                rows[epoch == e] = self._pass(int(k), int(e))[0][i[epoch == e]]
            out[mine] = self._starts[k] + rows
        return out

    def _tokens_before(self, k: int, position: int) -> int:
        """Real tokens in source ``k``'s first ``position`` rows read (across passes)."""
        epoch, i = divmod(int(position), int(self._sizes[k]))
        return epoch * self._totals[k] + int(self._pass(k, epoch)[1][i])

    # ---- the iterator protocol ----------------------------------------------------------
    def __iter__(self) -> MixtureBatchIterator:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        b = self._next
        if self.limit is not None and b >= self.limit:
            self._log_end(b)
            raise StopIteration
        source, position = self.schedule.batch_slots(b)
        self._log_new_passes(b, source, position)
        index = self._rows_of(source, position)
        self._next = b + 1
        return self._gather(index[self._slice])

    def get_state(self) -> dict[str, Any]:
        return {"next_index": self._next, "mixture": self._fingerprint}

    def set_state(self, state: Mapping[str, Any]) -> None:
        if not isinstance(state, Mapping) or not isinstance(state.get("next_index"), int) or state["next_index"] < 0:
            raise DataError(f"not a mixture position: {state!r}")
        if state.get("mixture") != self._fingerprint:
            logger.warning("resuming with another data.mixture than the checkpoint's (sources, sizes or weights "
                           "changed): the rows read from here on are not the ones the original run would have read")
        self._next = int(state["next_index"])

    # ---- what the run logs --------------------------------------------------------------
    def _log_new_passes(self, batch: int, source: np.ndarray, position: np.ndarray) -> None:
        """Log a source starting a new pass (its 2nd, 3rd and 4th, then every power of two: a small source
        repeated every step would flood the log)."""
        for k in np.unique(source):
            positions, n = position[source == k], int(self._sizes[k])
            first_new = max(1, -(-int(positions.min()) // n))
            for p in range(first_new, int(positions.max()) // n + 1):
                if p + 1 <= 4 or ((p + 1) & p) == 0:
                    part = self.parts[int(k)]
                    logger.info("data.mixture: source %r has been read whole (%d rows); it starts pass %d at step "
                                "%d (on_exhausted: repeat, rows reshuffled)", part.name, n, p + 1, batch + 1)

    def _log_end(self, batch: int) -> None:
        if self._ended:
            return
        self._ended = True
        if self._stopper is not None and batch == self.limit:
            part = self.parts[self._stopper]
            logger.warning("data.mixture: source %r has been read whole (%d rows) after step %d and has "
                           "on_exhausted: stop, so the training data ends there", part.name, part.num_rows, batch)

    def data_metrics(self, step: int) -> dict[str, float]:
        """``data/<name>/tokens`` (real tokens in step ``step``'s batch), ``.../total_tokens`` (since step 1),
        ``.../share`` (of all tokens since step 1) and ``.../passes`` (rows read / rows held)."""
        now = self.schedule.taken_through(step - 1)
        before = self.schedule.taken_through(step - 2)
        totals = [self._tokens_before(k, int(now[k])) for k in range(len(self.parts))]
        earlier = [self._tokens_before(k, int(before[k])) for k in range(len(self.parts))]
        everything = max(sum(totals), 1)
        out: dict[str, float] = {}
        for k, part in enumerate(self.parts):
            out[f"data/{part.name}/tokens"] = float(totals[k] - earlier[k])
            out[f"data/{part.name}/total_tokens"] = float(totals[k])
            out[f"data/{part.name}/share"] = totals[k] / everything
            out[f"data/{part.name}/passes"] = float(now[k]) / float(self._sizes[k])
        return out


def build_mixture(data: Any, tokenizer: Any, *, max_length: int, seed: int, truncation_mode: str,
                  build: Callable[..., LMSplits]) -> LMSplits:
    """Build each ``data.mixture`` entry with ``build`` (``build_datasets``) and mix the results.

    An error building an entry is raised again with the entry named (``data.mixture[1] ('chat')``).
    """
    trains: dict[str, PackedRows] = {}
    evals: dict[str, PackedRows] = {}
    per_source: dict[str, dict[str, Any]] = {}
    bytes_per_token: dict[str, float] = {}
    for i, entry in enumerate(data.mixture):
        try:
            splits = build(entry, tokenizer, max_length=max_length, seed=seed, truncation_mode=truncation_mode)
        except ScaletrainError as err:
            raise type(err)(f"data.mixture[{i}] ({entry.name!r}): {err}") from None
        trains[entry.name], evals[entry.name] = splits.train, splits.eval
        bytes_per_token[entry.name] = splits.eval_bytes_per_token
        per_source[entry.name] = {**splits.stats, "weight": entry.weight, "on_exhausted": entry.on_exhausted}
    train = mix_rows(trains, {e.name: e.weight for e in data.mixture},
                     {e.name: e.on_exhausted for e in data.mixture})
    held = concatenate_parts(evals, bytes_per_token=bytes_per_token)
    eval_bytes = sum(s.get("eval_bytes", 0) for s in per_source.values())
    eval_targets = sum(s.get("eval_target_tokens", 0) for s in per_source.values())
    known = all(np.isfinite(b) for name, b in bytes_per_token.items() if evals[name].num_rows)
    overall = eval_bytes / eval_targets if known and eval_targets else float("nan")
    stats = {"kind": "mixture", "train_rows": train.num_rows, "eval_rows": held.num_rows,
             "train_tokens": train.num_tokens, "sources": per_source}
    return LMSplits(train=train, eval=held, eval_bytes_per_token=overall, stats=stats)


__all__ = ["MixtureBatchIterator", "MixtureRows", "NamedRows", "RowsPart", "build_mixture", "concatenate_parts",
           "mix_rows"]
