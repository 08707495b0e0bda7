"""``config_variables`` in JSON that both EasyDeL and we read, and EasyDeL's own saved form.

Why: a ``RayDistributedConfig`` JSON saved by EasyDeL must load here, and one saved
here should load in EasyDeL where it can. EasyDeL writes dtypes as ``"bf16"``,
``jax.lax.Precision`` as its number, tuples as lists and ``partition_axis`` as a plain
dict of eformer's fields; it reads that dict back with ``PartitionAxis(**d)``. We
write our tagged values (:mod:`scaletrain.compat.easydel.codec`: exact types), except
``partition_axis``, written as the plain eformer dict both read, and the attention and
remat enums, written as their string values with their classes noted beside
(``enum_types``, a field EasyDeL ignores). A file without our ``encoding`` mark is
EasyDeL's and is read by EasyDeL's rules.
"""

from __future__ import annotations

import enum
from typing import Any

import jax
import jax.numpy as jnp

from scaletrain.compat.easydel import codec
from scaletrain.compat.easydel.enums import AttentionMechanisms, EasyDeLGradientCheckPointers
from scaletrain.parallel.partition import PartitionAxis

ENCODING = "scaletrain"
ENUMS: dict[str, type[enum.Enum]] = {
    cls.__name__: cls for cls in (AttentionMechanisms, EasyDeLGradientCheckPointers)
}
# EasyDeL's DTYPE_TO_STRING_MAP values (the float8 ones have no use here)
EASYDEL_DTYPES: dict[str, Any] = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32,
                                  "fp64": jnp.float64}
# variables EasyDeL holds as tuples and JSON turns into lists
TUPLE_KEYS = ("sharding_axis_names", "sharding_axis_dims", "sharding_dcn_axis_dims")


def encode_variables(variables: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str] | None]:
    """``(JSON-safe variables, enum_types)`` for a ``RayDistributedConfig`` file."""
    enum_types = {k: type(v).__name__ for k, v in variables.items()
                  if isinstance(v, enum.Enum) and type(v).__name__ in ENUMS}
    plain = {k: (v.value if k in enum_types else v) for k, v in variables.items()}
    axis = plain.pop("partition_axis", None)
    out = codec.encode(plain, "config_variables")
    if "partition_axis" in variables:
        # eformer's field names, lists for tuples: EasyDeL's PartitionAxis(**d) reads it
        out["partition_axis"] = (axis.model_dump(mode="json") if isinstance(axis, PartitionAxis)
                                 else codec.encode(axis, "config_variables.partition_axis"))
    return {k: out[k] for k in variables}, enum_types or None


def decode_variables(variables: dict[str, Any], enum_types: dict[str, str] | None,
                     encoding: str | None) -> dict[str, Any]:
    """Invert :func:`encode_variables`; a file without ``encoding`` is read by EasyDeL's rules."""
    out = codec.decode(variables) if encoding == ENCODING else _from_easydel(variables)
    if isinstance(out.get("partition_axis"), dict):
        out["partition_axis"] = PartitionAxis(**out["partition_axis"])
    for key, name in (enum_types or {}).items():
        if key in out and name in ENUMS:
            out[key] = ENUMS[name](out[key])
    return out


def _from_easydel(variables: dict[str, Any]) -> dict[str, Any]:
    """EasyDeL's saved form: dtype strings, Precision numbers, lists for tuples (our tags still read)."""
    out = codec.decode(variables)
    for key, value in out.items():
        if isinstance(value, str) and value in EASYDEL_DTYPES:
            out[key] = EASYDEL_DTYPES[value]
        elif key == "precision" and isinstance(value, int) and not isinstance(value, bool):
            out[key] = jax.lax.Precision(value)
        elif key in TUPLE_KEYS and isinstance(value, list):
            out[key] = tuple(value)
    return out
