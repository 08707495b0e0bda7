"""A rollout's rows on several processes: which rows this process holds, scores and places; gathering the few
per-row values every process needs.

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

from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import NamedSharding


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

    def place(self, values: np.ndarray, sharding_of: Callable[[int], NamedSharding]) -> jax.Array:
        """The global array of this process's ``held`` rows ``values`` under ``sharding_of(ndim)`` (rows as this
        layout's sharding lays them out, every other dimension whole)."""
        values = np.asarray(values)
        where = {int(r): i for i, r in enumerate(self.held)}

        def rows(index: tuple[slice, ...]) -> np.ndarray:
            return values[[where[r] for r in _row_span(index, self.n)]]

        return jax.make_array_from_callback((self.n, *values.shape[1:]), sharding_of(values.ndim), rows)


def failed_processes(failed: bool) -> list[int]:
    """The processes that say ``failed`` (a collective, as :meth:`RowLayout.gather`): a process whose own step
    fails tells the others, which would otherwise wait for it in their next collective."""
    if jax.process_count() == 1:
        return [0] if failed else []
    from jax.experimental import multihost_utils

    flags = np.asarray(multihost_utils.process_allgather(np.array([int(failed)], np.int32))).reshape(-1)
    return [int(p) for p in np.flatnonzero(flags)]
