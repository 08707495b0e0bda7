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
from jax.sharding import Mesh

from scaletrain.models.config import LlamaConfig, to_dtype
from scaletrain.parallel.mesh import create_mesh
from scaletrain.parallel.partition import shardings_for_state


def mesh_for_config(config: LlamaConfig, devices: list[jax.Device] | None = None) -> Mesh:
    """The mesh described by ``config.sharding_axis_dims`` / ``sharding_axis_names``."""
    return create_mesh(config.sharding_axis_dims, config.sharding_axis_names, devices)


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
    real run needs (``bench/aot.py``).
    """
    make = _maker(module_class, config, dtype, param_dtype, precision, seed=0)
    graphdef, abstract_state, shardings = _abstract(make, config, mesh)
    params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                          nnx.to_pure_dict(abstract_state), shardings)
    return graphdef, params


def _maker(module_class: type, config: LlamaConfig, dtype: Any, param_dtype: Any, precision: Any,
           seed: int) -> Callable[[], nnx.Module]:
    dtype, param_dtype = to_dtype(dtype), to_dtype(param_dtype)
    return lambda: module_class(config, dtype=dtype, param_dtype=param_dtype, precision=precision,
                                rngs=nnx.Rngs(seed))


def _abstract(make: Callable[[], nnx.Module], config: LlamaConfig, mesh: Mesh) -> tuple[Any, Any, Any]:
    """The graph, abstract state and parameter shardings of ``make()``, computing nothing."""
    with jax.set_mesh(mesh):
        graphdef, abstract_state = nnx.split(nnx.eval_shape(make))
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
    make = _maker(module_class, config, dtype, param_dtype, precision, seed)
    graphdef, _, shardings = _abstract(make, config, mesh)
    with jax.set_mesh(mesh):
        @jax.jit
        def init() -> Any:
            return nnx.to_pure_dict(nnx.state(make()))

        state = jax.jit(init, out_shardings=shardings)()
    return nnx.merge(graphdef, state), mesh
