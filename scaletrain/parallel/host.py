"""Bringing sharded arrays back to the host, written once for the HF export and the state digest.

Why not plain ``np.asarray(x)`` / ``jax.device_get(x)``: JAX keeps the host copy it makes
cached on the array (``_npy_value``) for as long as the array lives, whenever the copy is
not a view of a CPU buffer (any GPU/TPU array, or one sharded over several devices).
Reading a model's parameters that way keeps all of them on the host until the train state
is freed: 4.9 GB for a 1B model on a GPU, after the run summary's digest. Here every read
goes through a new Array object over the same device buffers, so the copy dies with it.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import Any

import jax
import numpy as np

#: the most bytes :func:`host_blocks` brings to the host at once (unless one row is larger)
BLOCK_BYTES = 64 * 2**20


def to_host(x: Any) -> np.ndarray:
    """The full value of ``x`` as a numpy array on this host, not kept cached on ``x``.

    An array split over several processes is gathered first (``process_allgather``):
    a collective, so every process must make the same calls in the same order. An
    array every process holds whole (fully replicated) is read locally, without one;
    numpy arrays and scalars pass through.
    """
    if not isinstance(x, jax.Array):
        return np.asarray(x)
    if x.is_fully_replicated:  # read one device's copy, through a new Array: the host copy is cached on that
        return np.asarray(jax.device_get(_fresh(x.addressable_shards[0].data)))
    if not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(_fresh(x)))


def _fresh(x: jax.Array) -> jax.Array:
    """A new Array object over ``x``'s own device buffers (no device copy), so nothing gets cached on ``x``."""
    return jax.make_array_from_single_device_arrays(x.shape, x.sharding, [s.data for s in x.addressable_shards])


def host_blocks(x: Any, max_bytes: int = BLOCK_BYTES) -> Iterator[np.ndarray]:
    """``x``'s value as consecutive blocks of rows (leading axis), each at most ``max_bytes`` (or one row).

    Their bytes in order are ``x``'s in C order, so a digest or a writer can stream a
    tensor with one block on the host at a time instead of the whole (1 GB for a 1B
    model's embedding on one GPU). An array whose whole value one device holds (one
    device, or replicated) is cut there by a jitted slice (two compiles per shape); one
    split over several devices comes whole, one array at a time, as :func:`to_host`
    gives it (cutting a sharded dimension would gather it on the devices).
    """
    if not isinstance(x, jax.Array) or not x.ndim or x.nbytes <= max_bytes or not x.is_fully_replicated:
        yield to_host(x)
        return
    source = x.addressable_shards[0].data  # this process's whole copy, on one device
    rows = max(1, max_bytes // (x.nbytes // x.shape[0]))
    for start in range(0, x.shape[0], rows):
        yield to_host(_rows(source, start, min(rows, x.shape[0] - start)))


@partial(jax.jit, static_argnums=2)
def _rows(x: jax.Array, start: jax.Array, count: int) -> jax.Array:
    return jax.lax.dynamic_slice_in_dim(x, start, count, axis=0)
