"""Create a model whose parameters are born sharded on a mesh.

``nnx.eval_shape`` gives the abstract parameters with their ``logical_axes``; the
real initialiser then runs under ``jax.jit`` with ``out_shardings``, so no device
ever holds an unsharded copy of a large tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from scaletrain.models.config import LlamaConfig, to_dtype
from scaletrain.parallel.mesh import create_mesh
from scaletrain.parallel.partition import shardings_for_state


def mesh_for_config(config: LlamaConfig, devices: list[jax.Device] | None = None) -> Mesh:
    """The mesh described by ``config.sharding_axis_dims`` / ``sharding_axis_names``."""
    return create_mesh(config.sharding_axis_dims, config.sharding_axis_names, devices)


def abstract_model(
    module_class: type,
    config: LlamaConfig,
    *,
    dtype: Any = "float32",
    param_dtype: Any = "float32",
    precision: Any = None,
    seed: int = 0,
    mesh: Mesh | None = None,
) -> nnx.Module:
    """``module_class(config, ...)`` with a ``jax.ShapeDtypeStruct`` for every array (``nnx.eval_shape``).

    The one abstract build: the sharded factory below, the HF loader and the Ray
    trainer's ``lazy`` models all start from it. With ``mesh`` it is traced under
    ``jax.set_mesh(mesh)``, exactly as the real initialiser runs.
    """
    make = _maker(module_class, config, dtype, param_dtype, precision, seed)
    if mesh is None:
        return nnx.eval_shape(make)
    with jax.set_mesh(mesh):
        return nnx.eval_shape(make)


def abstract_sharded_model(
    module_class: type,
    config: LlamaConfig,
    *,
    dtype: Any = "float32",
    param_dtype: Any = "float32",
    precision: Any = None,
    mesh: Mesh,
) -> tuple[Any, Any]:
    """``(graphdef, params)``: the model's static graph and its parameters as
    ``jax.ShapeDtypeStruct`` leaves that carry their shardings on ``mesh``.

    Nothing is allocated or computed, so it serves any mesh, including one of devices
    this host does not have: a step compiled from it ahead of time reports the memory a
    real run needs (``bench/aot.py``); the HF loader reads each tensor into its leaf's sharding.
    """
    model = abstract_model(module_class, config, dtype=dtype, param_dtype=param_dtype, precision=precision, mesh=mesh)
    graphdef, abstract_state, shardings = _split_sharded(model, config, mesh)
    params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                          nnx.to_pure_dict(abstract_state), shardings)
    return graphdef, params


def _maker(module_class: type, config: LlamaConfig, dtype: Any, param_dtype: Any, precision: Any,
           seed: int) -> Callable[[], nnx.Module]:
    dtype, param_dtype = to_dtype(dtype), to_dtype(param_dtype)
    return lambda: module_class(config, dtype=dtype, param_dtype=param_dtype, precision=precision,
                                rngs=nnx.Rngs(seed))


def _split_sharded(abstract: nnx.Module, config: LlamaConfig, mesh: Mesh) -> tuple[Any, Any, Any]:
    """The graph, abstract state and parameter shardings of an abstract model on ``mesh``."""
    graphdef, abstract_state = nnx.split(abstract)
    with jax.set_mesh(mesh):
        return graphdef, abstract_state, shardings_for_state(abstract_state, config.partition_axis, mesh)


def create_sharded_model(
    module_class: type,
    config: LlamaConfig,
    *,
    dtype: Any = "float32",
    param_dtype: Any = "float32",
    precision: Any = None,
    seed: int = 0,
    mesh: Mesh | None = None,
) -> tuple[nnx.Module, Mesh]:
    """Build ``module_class(config, ...)`` with sharded parameters; returns (model, mesh)."""
    mesh = mesh if mesh is not None else mesh_for_config(config)
    abstract = abstract_model(module_class, config, dtype=dtype, param_dtype=param_dtype, precision=precision,
                              seed=seed, mesh=mesh)
    graphdef, _, shardings = _split_sharded(abstract, config, mesh)
    make = _maker(module_class, config, dtype, param_dtype, precision, seed)
    with jax.set_mesh(mesh):
        @jax.jit
        def init() -> Any:
            return nnx.to_pure_dict(nnx.state(make()))

        state = jax.jit(init, out_shardings=shardings)()
    return nnx.merge(graphdef, state), mesh


def _mesh_of(model: nnx.Module) -> Mesh | None:
    """The mesh the model's parameters live on, if they carry NamedShardings."""
    for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return sharding.mesh
    return None


def place_model(model: nnx.Module, mesh: Mesh | None = None) -> tuple[nnx.Module, Mesh]:
    """Make sure every parameter is sharded on a mesh by its partition rules.

    A model built by :func:`create_sharded_model` is returned as is; one built
    eagerly on a single device (a user's own module, say) is moved onto the mesh of
    its config.
    """
    current = _mesh_of(model)
    if current is not None and (mesh is None or mesh == current):
        return model, current
    mesh = mesh or mesh_for_config(model.config)
    graphdef, state = nnx.split(model)
    shardings = shardings_for_state(state, model.config.partition_axis, mesh)
    params = jax.device_put(nnx.to_pure_dict(state), shardings)
    return nnx.merge(graphdef, params), mesh
