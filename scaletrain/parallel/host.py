"""Bringing sharded arrays back to the host, written once for the HF export and the state digest."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def to_host(x: Any) -> np.ndarray:
    """The full value of ``x`` as a numpy array on this host.

    An array split over several processes is gathered first (``process_allgather``):
    a collective, so every process must make the same calls in the same order. An
    array every process holds whole (fully replicated) is read locally, without one;
    numpy arrays and scalars pass through.
    """
    if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))
