"""Create a model whose parameters are born sharded on a mesh.

``nnx.eval_shape`` gives the abstract parameters with their ``logical_axes``; the
real initialiser then runs under ``jax.jit`` with ``out_shardings``, so no device
ever holds an unsharded copy of a large tensor.
"""

from __future__ import annotations

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
    dtype, param_dtype = to_dtype(dtype), to_dtype(param_dtype)

    def make() -> nnx.Module:
        return module_class(config, dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=nnx.Rngs(seed))

    with jax.set_mesh(mesh):
        abstract = nnx.eval_shape(make)
        graphdef, abstract_state = nnx.split(abstract)
        shardings = shardings_for_state(abstract_state, config.partition_axis, mesh)

        @jax.jit
        def init() -> Any:
            return nnx.to_pure_dict(nnx.state(make()))

        state = jax.jit(init, out_shardings=shardings)()
    return nnx.merge(graphdef, state), mesh
