"""A rollout's rows on several processes: which rows this process holds and scores; gathering the few per-row
values every process needs.

Why: with ``jax.distributed`` every process runs the same rollout program over the global mesh, and each
holds only the rows its devices hold. Reading the whole rollout on every host would gather every token;
running every reward on every host would multiply the (possibly expensive) reward calls by the process
count. So each process reads the rows of its own devices (``held``), scores a disjoint share of them
(``owned``: a row several processes hold, when the batch is replicated over an axis that spans processes,
is scored once, by the lowest of them), and the small per-row results (rewards, lengths, ...) are gathered so
that every process forms the same batch-wide advantages and figures. Row sets come from the sharding
alone (``devices_indices_map``), so every process knows every other's without asking. Values cross as
raw bytes: float64 and NaN arrive bit for bit. One process: no collective, every row is held and owned.
"""

from __future__ import annotations

import pickle
import sys
from collections.abc import Collection, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from scaletrain.errors import DataError
from scaletrain.training.stopping import StepInterrupted
from scaletrain.user_calls import StopRequested


def _row_span(index: tuple[slice, ...], n: int) -> range:
    start, stop, _ = index[0].indices(n) if index else (0, n, 1)
    return range(start, stop)


class RowLayout:
    """The rows of an ``n``-row batch laid out by ``sharding`` (rows over its first dimension), per process."""

    def __init__(self, sharding: NamedSharding, n: int):
        self.n, self.sharding = n, sharding
        count = jax.process_count()
        holders: list[set[int]] = [set() for _ in range(n)]
        for device, index in sharding.devices_indices_map((n,)).items():
            for row in _row_span(index, n):
                holders[row].add(device.process_index)
        me = jax.process_index()
        self.held_by = [np.array([r for r in range(n) if p in holders[r]], np.int64) for p in range(count)]
        self.owned_by = [np.array([r for r in range(n) if min(holders[r]) == p], np.int64) for p in range(count)]
        self.held, self.owned = self.held_by[me], self.owned_by[me]

    def read(self, x: jax.Array) -> np.ndarray:
        """This process's rows (``held``) of ``x`` laid out by this layout's sharding, from its own devices."""
        if x.is_fully_addressable:
            return np.asarray(x)[self.held]
        out = np.empty((len(self.held), *x.shape[1:]), x.dtype)
        where = {int(r): i for i, r in enumerate(self.held)}
        for shard in x.addressable_shards:
            span = _row_span(shard.index, x.shape[0])
            data = np.asarray(shard.data)
            for j, row in enumerate(span):
                out[where[row]] = data[j]
        return out

    def gather(self, values: np.ndarray, rows: str = "owned") -> np.ndarray:
        """The [n, ...] array of every process's ``values`` for its ``rows`` (``"owned"`` or ``"held"``), on
        every process: a collective, so all processes call it at the same point."""
        sets = self.owned_by if rows == "owned" else self.held_by
        mine = sets[jax.process_index()]
        values = np.ascontiguousarray(values)
        if len(values) != len(mine):
            raise ValueError(f"{len(values)} values for this process's {len(mine)} {rows} rows")
        if len(sets) == 1:
            out = np.empty((self.n, *values.shape[1:]), values.dtype)
            out[mine] = values
            return out
        from jax.experimental import multihost_utils

        width = max(len(s) for s in sets)
        row_bytes = values.dtype.itemsize * int(np.prod(values.shape[1:], dtype=np.int64))
        raw = np.zeros((width, row_bytes), np.uint8)
        raw[:len(mine)] = values.view(np.uint8).reshape(len(mine), row_bytes)
        every = np.asarray(multihost_utils.process_allgather(raw))  # [processes, width, row_bytes]
        out = np.empty((self.n, row_bytes), np.uint8)
        for p, rows_p in enumerate(sets):
            out[rows_p] = every[p, :len(rows_p)]
        return out.view(values.dtype).reshape(self.n, *values.shape[1:])


def read_whole(x: jax.Array) -> np.ndarray:
    """All of ``x`` on this host: its value when this process addresses every shard, else gathered from every
    process (a collective, so all processes call it at the same point). A multi-turn rollout reads each turn's
    few sampled ids whole, since every process builds every row's next context."""
    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def gather_bytes(blob: bytes) -> list[bytes]:
    """Every process's ``blob``, in process order: a collective (two: the sizes, then the bytes padded to the
    largest), so all processes call it at the same point. One process: ``[blob]``, no collective."""
    if jax.process_count() == 1:
        return [blob]
    from jax.experimental import multihost_utils

    sizes = np.asarray(multihost_utils.process_allgather(np.array([len(blob)], np.int32))).reshape(-1)
    raw = np.zeros(max(int(sizes.max()), 1), np.uint8)
    raw[:len(blob)] = np.frombuffer(blob, np.uint8)
    every = np.asarray(multihost_utils.process_allgather(raw)).reshape(len(sizes), -1)
    return [every[p, :int(n)].tobytes() for p, n in enumerate(sizes)]


class OwnedCalls:
    """The rows whose tool calls and environment steps this process runs in a multi-turn rollout (``owned``: the
    rows it scores, ``RowLayout.owned``, since a reward such as ``get_reward`` reads the environment the calls
    changed), and the exchange of their outcomes, so that every process appends the same results to every row
    and builds the same next-turn contexts.

    Why: every process runs the same rollout over the global mesh, so each could run every row's calls (correct,
    as environments are seeded by ``(seed, step, row)``), but that repeats the work once per process, and a tool
    with effects outside the process would act once per process. The outcomes are small (tool results' text,
    an environment's reply, reward and flags), so they cross as pickled bytes (:func:`gather_bytes`).
    """

    def __init__(self, owned: Collection[int]):
        self.owned = frozenset(int(r) for r in owned)

    def mine(self, pending: Mapping[int, Any]) -> dict[int, Any]:
        """The part of ``pending`` (row -> what it waits for) that this process runs."""
        return {row: want for row, want in pending.items() if row in self.owned}

    def share(self, outcomes: Mapping[int, Any]) -> dict[int, Any]:
        """Every process's ``outcomes`` (row -> what its calls gave) merged: a collective, once a round."""
        merged: dict[int, Any] = {}
        for blob in gather_bytes(pickle.dumps(dict(outcomes), protocol=pickle.HIGHEST_PROTOCOL)):
            merged.update(pickle.loads(blob))  # our own processes' bytes, written just above
        return merged


def process_codes(code: int) -> list[int]:
    """Every process's ``code`` (0: all is well; a cause of stopping otherwise), in process order: a collective,
    so a process whose own step fails tells the others, which would otherwise wait for it in their next one."""
    if jax.process_count() == 1:
        return [code]
    from jax.experimental import multihost_utils

    return [int(c) for c in np.asarray(multihost_utils.process_allgather(np.array([code], np.int32))).reshape(-1)]


def raise_agreed(failure: Exception | None) -> None:
    """After each process scored its own rows, every process learns how the others fared and all raise together
    (a collective, as :meth:`RowLayout.gather`), so none waits in a collective for one that has left.

    ``failure``: this process's DataError (a reward raised or returned a bad value: raised as it is, and
    the others say where it was), a :class:`~scaletrain.user_calls.StopRequested` (a signal while
    waiting for a reward: every process raises :class:`~scaletrain.training.stopping.StepInterrupted`,
    the step is given up before its update), or None. A reward error wins over a stop: it needs a fix
    before the run can go on.
    """
    codes = process_codes(0 if failure is None else 2 if isinstance(failure, StopRequested) else 1)
    if isinstance(failure, DataError):
        if len(codes) > 1:  # say it now: the others stop at once, and a collective on the way out may find them gone
            print(f"scaletrain: error: {failure}", file=sys.stderr, flush=True)  # (a lost peer ends this process)
            failure.reported = True  # type: ignore[attr-defined]  (cli.report_user_error prints it once)
        raise failure
    if 1 in codes:
        raise DataError(f"a reward function raised in process {codes.index(1)} (its log names it and the row); "
                        f"process {jax.process_index()} stops too")
    if 2 in codes:
        raise StepInterrupted(str(failure) if failure is not None else
                              f"a signal reached process {codes.index(2)} while it waited for a reward function")
