"""Build the 5-axis device mesh ``(dp, fsdp, ep, tp, sp)``.

The dims follow EasyDeL's RayDistributedTrainer: one entry may be ``-1`` and is filled
with whatever the device count leaves, so ``(1, -1, 1, 1, 1)`` means "all devices on fsdp".
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from scaletrain.errors import ConfigError

AXIS_NAMES: tuple[str, ...] = ("dp", "fsdp", "ep", "tp", "sp")


def resolve_axis_dims(dims: Sequence[int], device_count: int, name: str = "sharding_axis_dims") -> tuple[int, ...]:
    """Replace a single ``-1`` in ``dims`` so that their product is ``device_count``.

    ``name``: the field the dims came from, as the user wrote it (a recipe's ``mesh.axis_dims``,
    the Python API's ``sharding_axis_dims``).
    """
    dims = tuple(int(d) for d in dims)
    free = [i for i, d in enumerate(dims) if d == -1]
    if len(free) > 1:
        raise ConfigError(f"{name} {list(dims)}: at most one axis may be -1")
    if any(d == 0 or d < -1 for d in dims):
        raise ConfigError(f"{name} {list(dims)}: every axis must be a positive size or -1")
    fixed = math.prod(d for d in dims if d != -1)
    if free:
        if device_count % fixed:
            raise ConfigError(f"{name} {list(dims)}: {_devices(device_count)} {'is' if device_count == 1 else 'are'} "
                              f"not divisible by the fixed axes' product {fixed}")
        dims = tuple(device_count // fixed if d == -1 else d for d in dims)
    if math.prod(dims) != device_count:
        raise ConfigError(f"{name} {list(dims)} uses {math.prod(dims)} devices but {_devices(device_count)} "
                          f"{'is' if device_count == 1 else 'are'} available")
    return dims


def _devices(count: int) -> str:
    return f"{count} device{'' if count == 1 else 's'}"


def create_mesh(
    axis_dims: Sequence[int] = (1, -1, 1, 1, 1),
    axis_names: Sequence[str] = AXIS_NAMES,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """Create a mesh over ``devices`` (all global devices by default).

    Axes are ``Auto`` (GSPMD propagation): parameters carry explicit shardings and
    the compiler places intermediate values.
    """
    devices = list(devices) if devices is not None else jax.devices()
    if len(axis_dims) != len(axis_names):
        raise ConfigError(
            f"sharding_axis_dims has {len(axis_dims)} entries but sharding_axis_names has {len(axis_names)}"
        )
    dims = resolve_axis_dims(axis_dims, len(devices))
    try:
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_device_mesh(dims, devices=devices, allow_split_physical_axes=True)
    except Exception:  # CPU or an unusual topology: plain row-major placement is correct, only slower
        grid = np.asarray(devices, dtype=object).reshape(dims)
    return Mesh(grid, tuple(axis_names), axis_types=(AxisType.Auto,) * len(axis_names))
