"""Which pages of the paged cache are in use, kept on the device as one reference count per page.

Why counts and not a free list: a prompt's pages are shared by its G samples (each sample's page
table points at them), so a page is free only when the last sequence holding it has stopped. A
count per page makes both moves one vectorised scatter inside the decode program, with no host
round trip: taking pages hands out the lowest-numbered free ones (a prefix sum over ``count == 0``),
giving them back subtracts one per holder. Which physical page a sequence gets depends on its
neighbours, but nothing it computes does: attention reads its pages by id, in sequence order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def take_pages(counts: Array, need: Array, holders: Array) -> tuple[Array, Array, Array]:
    """Hand out one free page to each requester with ``need`` [M] True, held ``holders`` [M] times.

    Returns ``(page ids [M], counts, short)``: a requester that needs none gets ``num_pages`` (out
    of range: writes to it are dropped), and ``short`` is True when the pool ran out (the pages
    of the requesters past the last free one are then out of range too).
    """
    num_pages = counts.shape[0]
    free = counts == 0
    rank = jnp.cumsum(free.astype(jnp.int32))  # rank[p]: free pages at or below p
    ordinal = jnp.cumsum(need.astype(jnp.int32))  # the n-th requester takes the n-th free page
    ids = jnp.searchsorted(rank, ordinal, side="left").astype(jnp.int32)
    ids = jnp.where(need, ids, num_pages)
    short = jnp.any(need & (ids >= num_pages))
    counts = counts.at[ids].add(holders.astype(counts.dtype), mode="drop")
    return ids, counts, short


def give_back(counts: Array, table: Array, lengths: Array, stopping: Array, page_size: int) -> Array:
    """``counts`` after the slots with ``stopping`` [slots] True let go of their pages: the first
    ``ceil(lengths / page_size)`` entries of their rows of ``table`` [slots, max_pages]."""
    num_pages = counts.shape[0]
    held = jnp.arange(table.shape[1])[None, :] < ((lengths + page_size - 1) // page_size)[:, None]
    ids = jnp.where(held & stopping[:, None], table, num_pages)
    return counts.at[ids.reshape(-1)].add(-1, mode="drop")


def pool_pages(slots: int, max_pages: int, cache_pages: int | None = None, cache_fraction: float = 0.75) -> int:
    """How many pages the pool of one call holds: ``cache_pages`` where given, else ``cache_fraction`` of the
    worst case (every slot at its longest, ``slots * max_pages``); never fewer than ``2 * max_pages``.

    Why a budget below the worst case: rows of a long-tailed batch stop at all lengths, so at any moment
    most slots hold a row partway through (measured on the chat workload of bench/rollout.py: the pages held
    peaked at 0.6x of the worst case), and a pool for the worst case is mostly empty. When a budgeted pool
    does run short the engine preempts the youngest row and runs it again later, so a small pool costs
    time, never a wrong token. The floor: the oldest live row at its longest, plus the whole pages of the
    prompt whose samples are still being placed, always fit, so the oldest row always makes progress.
    """
    floor = 2 * max_pages
    if cache_pages is None:
        cache_pages = -(-int(cache_fraction * slots * max_pages * 1000) // 1000)
    return max(int(cache_pages), floor)
