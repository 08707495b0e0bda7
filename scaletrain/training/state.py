"""The train state: one pytree of step, parameters, optimizer state and RNG key.

Parameters are kept as a pure nested dict (``nnx.to_pure_dict``) so optax, orbax
and ``jax.jit`` see plain arrays; ``graphdef`` (static) turns them back into a
module with ``state.model``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from scaletrain.peft.lora import join_trainable, split_trainable
from scaletrain.parallel.host import BLOCK_BYTES, host_blocks


@struct.dataclass
class FrozenModel:
    """A model an objective reads but never trains (a reference model): its graph and its arrays.

    Kept apart from ``TrainState.params`` so that it is never differentiated, never given
    optimizer moments and never checkpointed (it is rebuilt from where it came from).
    """

    params: Any
    graphdef: Any = struct.field(pytree_node=False)

    @property
    def model(self) -> nnx.Module:
        return nnx.merge(self.graphdef, self.params)


@struct.dataclass
class TrainState:
    """Everything the pure train step reads and writes."""

    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array
    graphdef: Any = struct.field(pytree_node=False)
    # LoRA: the frozen base (never differentiated, optimised or checkpointed); None otherwise
    frozen: Any = None
    # models an objective reads (``Objective.frozen_models``), by name: never differentiated, optimised
    # or checkpointed, like ``frozen``; passed through the step unchanged
    frozen_models: dict[str, FrozenModel] = struct.field(default_factory=dict)

    @property
    def model(self) -> nnx.Module:
        """The module with this state's parameters (cheap: shares the arrays)."""
        return join_trainable(self.graphdef, self.params, self.frozen)

    @property
    def num_params(self) -> int:
        return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(self.params))


def create_train_state(
    model: nnx.Module, tx: optax.GradientTransformation, mesh: Mesh, seed: int = 0
) -> TrainState:
    """Split ``model`` and create the optimizer state with explicit shardings.

    Each optimizer moment gets its parameter's sharding (``optax.tree_map_params``);
    scalars such as counters are replicated. Without explicit shardings a donated
    step can fail with incompatible devices.

    A LoRA model (:func:`scaletrain.peft.lora.apply_lora`) is split into its adapters,
    which are ``params`` (the only part differentiated and given optimizer moments), and
    its frozen base, ``frozen``.
    """
    graphdef, params, frozen = split_trainable(model)
    replicated = NamedSharding(mesh, PartitionSpec())
    with jax.set_mesh(mesh):
        opt_state = jax.jit(tx.init, out_shardings=optimizer_shardings(tx, params, mesh))(params)
        step = jax.device_put(jnp.zeros((), jnp.int32), replicated)
        rng = jax.device_put(jax.random.key_data(jax.random.key(seed)), replicated)
    return TrainState(step=step, params=params, opt_state=opt_state, rng=rng, graphdef=graphdef, frozen=frozen)


def adopt_state(given: TrainState, built: TrainState) -> TrainState:
    """``built`` (placed on the trainer's mesh) in ``given``'s class, with ``given``'s step, RNG and extras.

    A ``state_class`` given to ``RayDistributedTrainer`` (a subclass of TrainState with
    fields and methods of its own) must be what the trainer trains and returns, so the
    trainer keeps the class: the core fields come from ``built`` (or, for step, RNG and
    a matching optimizer state, from ``given``, placed like ``built``'s), extra pytree
    fields from ``given``, placed replicated on the mesh unless already on it (the
    jitted step needs a sharding for every leaf). Extra fields go through the step
    unchanged; a step or callback of the user's may replace them. ``frozen_models`` (the
    models an objective reads) is kept from ``given`` the same way.
    """
    mesh = jax.tree.leaves(built.params)[0].sharding.mesh
    replicated = NamedSharding(mesh, PartitionSpec())
    same_opt = jax.tree.structure(given.opt_state) == jax.tree.structure(built.opt_state)
    core = {
        "step": jax.device_put(given.step, built.step.sharding),
        "params": built.params,
        "opt_state": jax.device_put(given.opt_state, state_shardings(built.opt_state)) if same_opt
        else built.opt_state,
        "rng": jax.device_put(given.rng, built.rng.sharding),
        "graphdef": built.graphdef,
        "frozen": built.frozen,
    }
    extra = {}
    for field in dataclasses.fields(given):
        if field.name in core:
            continue
        value = getattr(given, field.name)
        if field.metadata.get("pytree_node", True):
            value = jax.tree.map(lambda x: x if _on_mesh(x, mesh) else jax.device_put(x, replicated), value)
        extra[field.name] = value
    return type(given)(**core, **extra)


def _on_mesh(x: Any, mesh: Mesh) -> bool:
    return isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh


def optimizer_shardings(tx: optax.GradientTransformation, params: Any, mesh: Mesh) -> Any:
    """The shardings of ``tx.init(params)``: each moment its parameter's, everything else replicated.

    A moment whose shape is not its parameter's (Adafactor's factored row and column
    statistics) is replicated: it is a vector, and the parameter's spec does not fit it.
    A parameter an ``optax.masked`` part leaves out has no moment there (its ``MaskedNode``
    is kept as it is: :func:`scaletrain.training.optim.leave_out`).
    """
    replicated = NamedSharding(mesh, PartitionSpec())

    def moment(leaf: Any, sharding: Any, param: Any) -> Any:
        if isinstance(leaf, optax.MaskedNode):
            return leaf
        return sharding if tuple(leaf.shape) == tuple(param.shape) else replicated

    return optax.tree_map_params(
        tx,
        moment,
        jax.eval_shape(tx.init, params),
        jax.tree.map(lambda x: x.sharding, params),
        params,
        transform_non_params=lambda _: replicated,
        is_leaf=lambda x: isinstance(x, (NamedSharding, optax.MaskedNode)),
    )


def abstract_train_state(graphdef: Any, params: Any, tx: optax.GradientTransformation, mesh: Mesh) -> TrainState:
    """The TrainState of ``params`` (``ShapeDtypeStruct`` leaves with shardings, see
    :func:`scaletrain.models.factory.abstract_sharded_model`) as shapes only: what a
    train step is lowered and compiled against without allocating anything."""
    def sds(x: Any, sharding: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    replicated = NamedSharding(mesh, PartitionSpec())
    opt_state = jax.tree.map(sds, jax.eval_shape(tx.init, params), optimizer_shardings(tx, params, mesh))
    rng = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))
    return TrainState(step=jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated), params=params,
                      opt_state=opt_state, rng=sds(rng, replicated), graphdef=graphdef)


def state_shardings(state: Any) -> Any:
    """A TrainState (or any pytree) whose leaves are the shardings of ``state``'s arrays."""
    return jax.tree.map(lambda x: x.sharding, state)


def params_sha256(params: Any, block_bytes: int = BLOCK_BYTES) -> str:
    """Digest of parameter values in a fixed key order: equal for bit-identical runs.

    The values stream through the host a block at a time (:func:`host_blocks`, at most
    ``block_bytes``) and are hashed in place: every run's summary computes it, so it must not
    hold the parameters on the host (a GPU run's 1B model would keep 4.9 GB there).
    With several processes every one must call it (the gather is a collective).
    """
    digest = hashlib.sha256()
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    for path, leaf in sorted(flat, key=lambda kv: jax.tree_util.keystr(kv[0])):
        blocks = host_blocks(leaf, block_bytes)
        first = next(blocks)  # there is always one, empty for an empty leaf
        digest.update(jax.tree_util.keystr(path).encode())
        digest.update(str(first.dtype).encode())
        for block in itertools.chain([first], blocks):
            digest.update(np.ascontiguousarray(block).reshape(-1).view(np.uint8))  # the bytes, not a copy
    return digest.hexdigest()
