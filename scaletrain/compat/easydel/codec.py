"""Tagged JSON encoding for trainer configs: types survive the round trip.

Why tags: EasyDeL's ``RayDistributedConfig`` wrote ``precision`` as ``0`` and
tuples as lists, so a reloaded config crashed the first step. Here every value
that plain JSON would change is written as a one-key object naming its type
(``{"__dtype__": "bfloat16"}``, ``{"__tuple__": [...]}``, ...), and decoding
gives back an object equal to (and of the same type as) the original.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from scaletrain.compat.easydel.enums import TaskType
from scaletrain.errors import ConfigError
from scaletrain.parallel.partition import PartitionAxis

# jax.numpy scalar types (``jnp.bfloat16`` ...) by name; ``np.dtype`` objects are tagged apart
_JNP_TYPES: dict[str, Any] = {
    name: getattr(jnp, name)
    for name in ("bfloat16", "float16", "float32", "float64", "int8", "int16", "int32", "int64",
                 "uint8", "uint32", "bool_", "complex64")
}
_TAGS = ("__dtype__", "__np_dtype__", "__precision__", "__partition_axis__", "__tuple__", "__task_type__")


def encode(value: Any, where: str = "value") -> Any:
    """A JSON-safe version of ``value``; :func:`decode` inverts it exactly."""
    if value is None or isinstance(value, (bool, int, float, str)) and not isinstance(value, TaskType):
        return value
    if isinstance(value, jax.lax.Precision):
        return {"__precision__": value.name}
    if isinstance(value, PartitionAxis):
        return {"__partition_axis__": {k: encode(v, f"{where}.{k}") for k, v in value.model_dump().items()}}
    if isinstance(value, type):
        for name, t in _JNP_TYPES.items():
            if value is t:
                return {"__dtype__": name}
    if isinstance(value, np.dtype):
        return {"__np_dtype__": value.name}
    if isinstance(value, TaskType):
        return {"__task_type__": value.value}
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise ConfigError(f"{where}: only string keys can be saved to JSON, got {bad[0]!r}")
        return {k: encode(v, f"{where}.{k}") for k, v in value.items()}
    raise ConfigError(f"{where}: {type(value).__name__} value {value!r} cannot be saved to JSON; "
                      "use a number, string, dtype, jax.lax.Precision, PartitionAxis, tuple, list or dict")


def decode(value: Any) -> Any:
    """Invert :func:`encode`."""
    if isinstance(value, list):
        return [decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        (tag, inner), = value.items()
        if tag == "__dtype__":
            return _JNP_TYPES[inner]
        if tag == "__np_dtype__":
            return np.dtype(inner)
        if tag == "__precision__":
            return jax.lax.Precision[inner]
        if tag == "__partition_axis__":
            return PartitionAxis(**{k: decode(v) for k, v in inner.items()})
        if tag == "__tuple__":
            return tuple(decode(v) for v in inner)
        if tag == "__task_type__":
            return TaskType(inner)
    return {k: decode(v) for k, v in value.items()}
