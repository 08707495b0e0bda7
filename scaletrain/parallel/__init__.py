"""Device meshes, the PartitionAxis naming scheme and parameter partition rules."""

from scaletrain.parallel.mesh import AXIS_NAMES, create_mesh, resolve_axis_dims
from scaletrain.parallel.partition import (
    PartitionAxis,
    batch_spec,
    logical_to_spec,
    shardings_for_state,
)

__all__ = [
    "AXIS_NAMES",
    "PartitionAxis",
    "batch_spec",
    "create_mesh",
    "logical_to_spec",
    "resolve_axis_dims",
    "shardings_for_state",
]
