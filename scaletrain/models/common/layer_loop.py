"""The loop over a decoder's layers, unrolled or scanned, each layer run as its kind.

Why one loop: training, evaluation and decoding walk the layers the same way (the
cache, when there is one, travels with the layers: a list beside a list of layers, a
``[L, ...]`` stack beside a stack), and a family whose layers come in kinds (Gemma 3's
local and global) gets each layer its kind's inputs in both layouts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from scaletrain.models.kernels.attention import KVCache
from scaletrain.models.common.scanned_layers import StackedLayers

Array = jax.Array
#: ``step(layer, h, kind, layer_cache) -> (h, aux, layer_cache)``; ``kind`` a Python int (unrolled) or a traced one
LayerStep = Callable[[nnx.Module, Array, Any, Any], tuple[Array, Any, Any]]


def by_kind(layer: nnx.Module, kind: int | Array, count: int, branch: Callable[[nnx.Module, int], Any]) -> Any:
    """``branch(layer, kind)`` with ``kind`` static: a plain call for a Python int or a single kind, else
    a ``lax.switch`` over the kinds for a stacked layer, whose kind is data.

    Why a switch and not one body with the mask as data: each branch keeps its kind's own
    attention (the flash kernel's static window, cuDNN's mask-free causal path for global
    layers), so a stacked layer computes exactly what its unrolled self does. JAX shares the
    branches' saved residuals where their shapes agree, and the kinds save the same shapes, so
    the backward holds one set per layer, not one per kind. The layer enters the switch as an
    operand (its state), so remat inside a branch updates a module of the branch's own trace.
    """
    if isinstance(kind, int):
        return branch(layer, kind)
    if count == 1:
        return branch(layer, 0)
    graphdef, state = nnx.split(layer)
    branches = [lambda st, k=k: branch(nnx.merge(graphdef, st), k) for k in range(count)]
    return lax.switch(kind, branches, state)


def loop_layers(layers: Any, kinds: list[int], step: LayerStep, x: Array,
                cache: list[KVCache] | KVCache | None) -> tuple[Array, Any, list[KVCache] | KVCache | None]:
    """``(h, aux, cache)`` after every layer in order: ``aux`` each layer's auxiliary outputs stacked
    along a new leading layer axis, ``cache`` the updated caches (None without)."""
    if isinstance(layers, StackedLayers):
        def body(layer: nnx.Module, h: Array, xs: tuple[Any, Array]) -> tuple[Array, tuple[Any, Any]]:
            h, aux, layer_cache = step(layer, h, xs[1], xs[0])
            return h, (aux, layer_cache)

        x, (aux, cache) = layers.scan(body, x, (cache, jnp.asarray(kinds, jnp.int32)))
        return x, aux, cache
    auxes, caches = [], []
    for i, layer in enumerate(layers):
        x, aux, layer_cache = step(layer, x, kinds[i], None if cache is None else cache[i])
        auxes.append(aux)
        caches.append(layer_cache)
    return x, jax.tree.map(lambda *a: jnp.stack(a), *auxes), None if cache is None else caches
