"""Which mesh axes shard which tensor dimension.

Every parameter is declared with *logical* axis names (``("embed", "mlp")``); a
:class:`PartitionAxis` maps those names onto mesh axes. Optimizer moments mirror
their parameter's shape, so they reuse the parameter's spec. A dimension that the
mapped mesh axes do not divide evenly is replicated instead of failing, so any
config runs on any mesh.
"""

from __future__ import annotations

import math
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from pydantic import BaseModel, ConfigDict

AxisSpec = str | tuple[str, ...] | None


class PartitionAxis(BaseModel):
    """Names the mesh axes that shard each kind of dimension.

    Defaults give FSDP over ``dp``/``fsdp`` for the batch and the parameters'
    hidden dimension, tensor parallelism over ``tp`` for heads, MLP and vocab, and
    sequence parallelism over ``sp`` for activations' sequence dimension.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    batch_axis: AxisSpec = ("dp", "fsdp")
    sequence_axis: AxisSpec = "sp"
    head_axis: AxisSpec = "tp"
    kv_head_axis: AxisSpec = "tp"
    hidden_axis: AxisSpec = "fsdp"
    mlp_axis: AxisSpec = "tp"
    vocab_axis: AxisSpec = "tp"
    expert_axis: AxisSpec = "ep"

    def logical_rules(self) -> dict[str, AxisSpec]:
        """Map each logical parameter/activation axis name to mesh axes."""
        return {
            "batch": self.batch_axis,
            "sequence": self.sequence_axis,
            "embed": self.hidden_axis,
            "heads": self.head_axis,
            "kv_heads": self.kv_head_axis,
            "mlp": self.mlp_axis,
            "vocab": self.vocab_axis,
            "expert": self.expert_axis,
            "norm": None,
        }


def axis_names(axes: AxisSpec) -> tuple[str, ...]:
    """A mesh-axis spec (``None``, one name, or several) as a tuple of names."""
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def _axis_size(mesh: Mesh, axes: AxisSpec) -> int:
    return math.prod(mesh.shape[n] for n in axis_names(axes))


def active_axis_size(axes: AxisSpec) -> int:
    """Devices along mesh axis (or axes) ``axes`` of the active mesh (``jax.set_mesh``); 1 outside one."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return 1
    sizes = dict(mesh.shape_tuple)
    return math.prod(sizes.get(a, 1) for a in axis_names(axes))


def active_platform() -> str:
    """``"cpu"``, ``"gpu"`` or ``"tpu"``: where the computation being traced will run.

    The active mesh's devices decide (``jax.set_mesh``), JAX's default backend only
    outside one. Code paths chosen per platform (CPU-shaped dots, the non-finite
    guard's form, cuDNN attention) then follow the devices the step is compiled for,
    which is not the default backend when a step is compiled ahead of time for a GPU
    topology on a CPU host (``bench/aot.py``) or a CPU mesh is used on a GPU host.
    """
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else mesh.abstract_device
    platform = device.platform if device is not None else jax.default_backend()
    return "gpu" if platform in ("cuda", "rocm") else platform


def active_sharding_axes(axes: AxisSpec, size: int) -> tuple[str, ...]:
    """The axes of ``axes`` that shard a dimension of ``size`` on the active mesh.

    Axes that are absent or of one device are dropped; if the rest do not divide
    ``size``, or no mesh is active, none shard it (the dimension stays replicated).
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    sizes = dict(mesh.shape_tuple)
    names = tuple(a for a in axis_names(axes) if sizes.get(a, 1) > 1)
    return names if names and size % active_axis_size(names) == 0 else ()


def logical_to_spec(
    logical_axes: tuple[str | None, ...],
    shape: tuple[int, ...],
    partition_axis: PartitionAxis,
    mesh: Mesh,
) -> PartitionSpec:
    """The PartitionSpec for one tensor, replicating dims the mesh does not divide."""
    rules = partition_axis.logical_rules()
    used: set[str] = set()
    spec: list[AxisSpec] = []
    for name, size in zip(logical_axes, shape, strict=True):
        axes = axis_names(rules.get(name) if name is not None else None)
        if axes:
            # drop mesh axes of size 1 and axes already used by an earlier dim
            axes = tuple(a for a in axes if a in mesh.shape and mesh.shape[a] > 1 and a not in used)
        if not axes or size % _axis_size(mesh, axes):
            spec.append(None)
            continue
        used.update(axes)
        spec.append(axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*spec)


def shardings_for_state(abstract_state: Any, partition_axis: PartitionAxis, mesh: Mesh) -> Any:
    """NamedShardings for an ``nnx.State`` whose Variables carry ``logical_axes`` metadata.

    Returns a pure pytree (same structure as ``nnx.to_pure_dict``) of shardings.
    Variables without metadata (scalars, counters) are replicated.
    """
    from flax import nnx

    def one(var: Any) -> NamedSharding:
        value = var.get_value() if isinstance(var, nnx.Variable) else var
        axes = var.get_metadata().get("logical_axes") if isinstance(var, nnx.Variable) else None
        if axes is None:
            return NamedSharding(mesh, PartitionSpec())
        return NamedSharding(mesh, logical_to_spec(tuple(axes), tuple(value.shape), partition_axis, mesh))

    tree = jax.tree.map(one, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.to_pure_dict(tree) if isinstance(tree, nnx.State) else tree


def batch_spec(partition_axis: PartitionAxis, mesh: Mesh, ndim: int = 2) -> PartitionSpec:
    """Spec of a ``[batch, sequence, ...]`` input array: batch over the batch axes, sequence over sp."""
    rules = partition_axis.logical_rules()

    def present(axes: AxisSpec) -> AxisSpec:
        names = tuple(a for a in axis_names(axes) if a in mesh.shape and mesh.shape[a] > 1)
        return None if not names else (names[0] if len(names) == 1 else names)

    parts: list[AxisSpec] = [present(rules["batch"]), present(rules["sequence"])]
    return PartitionSpec(*parts[:ndim], *([None] * max(0, ndim - 2)))
