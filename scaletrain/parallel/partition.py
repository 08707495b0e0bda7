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
from pydantic import ConfigDict, model_serializer, model_validator

from scaletrain.config_keys import ConfigModel, key_errors, unknown_key_message

AxisSpec = str | tuple[str, ...] | None


class PartitionAxis(ConfigModel):
    """Names the mesh axes that shard each kind of dimension (eformer's fields, plus ``hidden_axis``).

    EasyDeL's ``PartitionAxis`` (eformer) fields are all accepted, so its saved dicts
    load. The five mesh-axis names (``data_parallel_axis`` ``"dp"``,
    ``fully_sharded_data_parallel_axis`` ``"fsdp"``, ``tensor_parallel_axis`` ``"tp"``,
    ``sequence_parallel_axis`` ``"sp"``, ``expert_parallel_axis`` ``"ep"``) give the
    defaults of the fields left out, as in eformer: batch over dp and fsdp, heads, MLP
    and vocab over tp, sequence over sp, experts over ep, the decode axes like their
    train axes. Which fields take effect here is :data:`USED_FIELDS`; the others are
    kept and saved so a config round-trips (docs/from-easydel.md).

    ``hidden_axis`` is ours: the parameters' hidden (embed) dimension, FSDP over
    ``fully_sharded_data_parallel_axis`` by default (EasyDeL shards parameters by
    per-model rules instead, and eformer's ``hidden_state_axis`` is the activations'
    hidden dimension, which we keep replicated). It is saved only when it is not its
    default, so the saved dict is one eformer's ``PartitionAxis(**d)`` reads too.
    ``mlp_axis``, our former name of ``mlp_intermediate_axis``, is still accepted.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    # names of the mesh axes: the defaults of the fields below derive from them
    data_parallel_axis: str = "dp"
    fully_sharded_data_parallel_axis: str = "fsdp"
    tensor_parallel_axis: str = "tp"
    sequence_parallel_axis: str = "sp"
    expert_parallel_axis: str = "ep"
    # training axes (used: see USED_FIELDS)
    batch_axis: AxisSpec = ("dp", "fsdp")
    sequence_axis: AxisSpec = "sp"
    query_sequence_axis: AxisSpec = "sp"
    head_axis: AxisSpec = "tp"
    kv_head_axis: AxisSpec = "tp"
    key_sequence_axis: AxisSpec = "sp"
    hidden_state_axis: AxisSpec = "tp"
    mlp_intermediate_axis: AxisSpec = "tp"
    vocab_axis: AxisSpec = "tp"
    expert_axis: AxisSpec = "ep"
    expert_gate_axis: AxisSpec = None
    attention_dim_axis: AxisSpec = None
    attention_kv_dim_axis: AxisSpec = None
    bias_head_sequence_axis: AxisSpec = None
    bias_key_sequence_axis: AxisSpec = None
    # decoding axes (kept, not used yet: generation runs on the training layout)
    decode_batch_axis: AxisSpec = ("dp", "fsdp")
    decode_query_sequence_axis: AxisSpec = None
    decode_head_axis: AxisSpec = "tp"
    decode_kv_head_axis: AxisSpec = "tp"
    decode_key_sequence_axis: AxisSpec = "sp"
    decode_attention_dim_axis: AxisSpec = None
    decode_attention_kv_dim_axis: AxisSpec = None
    # ours: the parameters' hidden dimension
    hidden_axis: AxisSpec = "fsdp"

    @model_validator(mode="before")
    @classmethod
    def _eformer_names(cls, data: Any) -> Any:
        """Check the keys, take ``mlp_axis``, fill left-out fields from the mesh-axis names as eformer does."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if "mlp_axis" in data and "mlp_intermediate_axis" not in data:
            data["mlp_intermediate_axis"] = data.pop("mlp_axis")
        unknown = [k for k in data if k not in cls.model_fields]
        if unknown:
            raise key_errors(cls.__name__, [(k, unknown_key_message(str(k), cls.model_fields), data[k])
                                            for k in unknown])
        # JSON gives lists where the axes were tuples
        data = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
        dp, fsdp, tp, sp, ep = (data.get(k, cls.model_fields[k].default) for k in MESH_AXIS_FIELDS)
        derived: dict[str, Any] = {
            "batch_axis": (dp, fsdp), "sequence_axis": sp, "query_sequence_axis": sp, "key_sequence_axis": sp,
            "head_axis": tp, "kv_head_axis": tp, "hidden_state_axis": tp, "mlp_intermediate_axis": tp,
            "vocab_axis": tp, "expert_axis": ep, "hidden_axis": fsdp,
        }
        for key, value in derived.items():
            data.setdefault(key, value)
        for train, decode in DECODE_FIELDS.items():
            data.setdefault(decode, data.get(train, cls.model_fields[train].default))
        return data

    @model_serializer(mode="wrap")
    def _dump(self, handler: Any) -> dict[str, Any]:
        """Leave ``hidden_axis`` out when it is its default, so eformer reads the dict too."""
        out = handler(self)
        if self.hidden_axis == self.fully_sharded_data_parallel_axis:
            out.pop("hidden_axis", None)
        return out

    @property
    def mlp_axis(self) -> AxisSpec:
        """Our former name of ``mlp_intermediate_axis``."""
        return self.mlp_intermediate_axis

    def logical_rules(self) -> dict[str, AxisSpec]:
        """Map each logical parameter/activation axis name to mesh axes."""
        return {
            "batch": self.batch_axis,
            "sequence": self.sequence_axis,
            "embed": self.hidden_axis,
            "heads": self.head_axis,
            "kv_heads": self.kv_head_axis,
            "mlp": self.mlp_intermediate_axis,
            "vocab": self.vocab_axis,
            "expert": self.expert_axis,
            "norm": None,
            "layers": None,  # the leading axis of stacked layers (scan_layers): every device holds every layer
        }


MESH_AXIS_FIELDS = ("data_parallel_axis", "fully_sharded_data_parallel_axis", "tensor_parallel_axis",
                    "sequence_parallel_axis", "expert_parallel_axis")
# eformer's: a decoding axis left out is its training axis
DECODE_FIELDS = {"batch_axis": "decode_batch_axis", "head_axis": "decode_head_axis",
                 "kv_head_axis": "decode_kv_head_axis", "key_sequence_axis": "decode_key_sequence_axis"}
# the fields that change where arrays go here (the mesh-axis names through the defaults they give)
USED_FIELDS = (*MESH_AXIS_FIELDS, "batch_axis", "sequence_axis", "head_axis", "kv_head_axis",
               "mlp_intermediate_axis", "vocab_axis", "expert_axis", "hidden_axis")


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


def batch_problems(spec: tuple[AxisSpec, ...], mesh_shape: dict[str, int], *, total_batch_size: int,
                   max_length: int) -> list[str]:
    """What keeps a global batch from being split by ``step_partition_spec`` (batch axes, then sequence
    axes) over a mesh of ``mesh_shape``, one clause per problem naming the training field; [] if it fits.

    Read by the trainer (on its mesh) and by the recipe's checks before any data is read.
    """
    unknown = [a for axes in spec for a in axis_names(axes) if a not in mesh_shape]
    if unknown:
        return [f"training.step_partition_spec names mesh axis {unknown[0]!r}; the mesh has {list(mesh_shape)}"]
    out = []
    batch_shards = math.prod(mesh_shape[a] for a in axis_names(spec[0])) if spec else 1
    if total_batch_size % batch_shards:
        out.append(f"training.total_batch_size={total_batch_size} must be divisible by the batch mesh "
                   f"axes {spec[0]} (size {batch_shards})")
    if len(spec) > 1 and max_length % math.prod(mesh_shape[a] for a in axis_names(spec[1])):
        out.append(f"training.max_length={max_length} must be divisible by the sequence axes {spec[1]}")
    return out
