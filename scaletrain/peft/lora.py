"""LoRA and QLoRA on any family built from :class:`~scaletrain.models.llama.Dense`.

:func:`apply_lora` replaces the targeted ``Dense`` layers of a model in place by
:class:`LoRADense`: the same ``kernel`` (and bias) plus ``lora_a`` [in, r] and
``lora_b`` [r, out], so ``y = x W + scaling * (x A) B``. A starts random (PEFT's
Kaiming-uniform bound ``1/sqrt(in)``) and B at zero, so before its first step the model
computes exactly what its base does. With ``quantize`` every linear layer but the LM
head keeps its weight as int8 / NF4 blocks (:mod:`scaletrain.peft.quantize`),
dequantised where it is used, inside the jitted step.

The adapters are their own variable type, :class:`LoRAParam`, so
:func:`split_trainable` separates them (and the embeddings / norms when asked) from the
frozen base with one ``nnx.split``: the trainer differentiates and optimises only that
part, and checkpoints hold only it (the base is named and digested instead).
Parameter paths stay those of the base (``model.layers.0.self_attn.q_proj.kernel``),
so the HF export, partition rules and loaders see the model they know.

With ``model.scan_layers`` a targeted projection of the stack is one ``LoRADense`` whose
arrays carry the layer axis first (``lora_a`` [L, in, r], ``lora_b`` [L, r, out], codes
[L, ...]); the scanned body sees one layer's slice, the 2-D layer above. Targets are
chosen, and adapters drawn, per unrolled path (``model.layers.<i>.<rest>``), so a stacked
model gets the unrolled model's adapters, value for value.
"""

from __future__ import annotations

import math
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from scaletrain.errors import ConfigError
from scaletrain.models.kernels.cpu_dots import matmul
from scaletrain.models.common.dense import Dense
from scaletrain.peft.lora_config import LoRAConfig
from scaletrain.peft.quantize import dequantize, quantize
from scaletrain.models.common.scanned_layers import LAYER_AXIS, per_layer_names
from scaletrain.parallel.partition import shardings_for_state

__all__ = ["LoRAConfig", "LoRADense", "LoRAParam", "QuantizedWeight", "apply_lora", "dense_layers", "linear_paths",
           "join_trainable", "lora_config_of", "merge_lora", "split_trainable", "target_paths", "trainable_count", "unrolled_paths"]

#: Linear layers that never get an adapter or a quantised weight (PEFT's all-linear skips the output layer).
OUTPUT_LAYER = "lm_head"


class LoRAParam(nnx.Param):
    """A trainable adapter matrix (``lora_a`` / ``lora_b``)."""


class QuantizedWeight(nnx.Variable):
    """Int8 / NF4 codes or block absmax of a frozen kernel: state, but never a parameter to train."""


class LoRADense(Dense):
    """A ``Dense`` whose kernel is frozen (maybe quantised), plus an optional low-rank update.

    Built from an existing ``Dense`` by :func:`apply_lora`, never directly; ``rank`` 0
    means no adapter (a quantised layer that is not a target).
    """

    @property
    def fp8(self) -> bool:
        """Never: an adapted layer's dots are not FP8 (``model.fp8`` with LoRA is refused by :func:`apply_lora`)."""
        return False

    def __init__(self, base: Dense, *, rank: int, scaling: float, quant: str | None, block_size: int,
                 key: jax.Array):
        """``key``: one key, or for a stacked layer (kernel [L, in, out]) one per layer, shape [L]."""
        kernel = base.kernel
        axes = tuple(kernel.get_metadata()["logical_axes"])
        *lead, n_in, n_out = kernel.shape
        self.bias, self.dtype, self.precision = base.bias, base.dtype, base.precision
        self.quant, self.rank, self.scaling = quant, rank, scaling
        self.base_dtype = jnp.dtype(kernel.dtype)
        if quant is None:
            self.kernel = kernel
            self.kernel_codes = self.kernel_absmax = None
        else:
            if n_in % block_size:
                raise ConfigError(f"lora.block_size={block_size} does not divide the input size {n_in} of a "
                                  f"{axes} layer; pick a block size that divides every linear layer's input")
            codes, absmax = _per_layer(lambda w: quantize(w, kind=quant, block_size=block_size), len(lead))(
                kernel[...])
            self.kernel = None
            self.kernel_codes = QuantizedWeight(codes, logical_axes=axes)
            self.kernel_absmax = QuantizedWeight(absmax, logical_axes=axes)
        if rank:
            bound = 1.0 / math.sqrt(n_in)
            draw = _per_layer(lambda k: jax.random.uniform(k, (n_in, rank), jnp.float32, -bound, bound), len(lead))
            self.lora_a = LoRAParam(draw(key), logical_axes=(*axes[:-1], None))
            self.lora_b = LoRAParam(jnp.zeros((*lead, rank, n_out), jnp.float32),
                                    logical_axes=(*axes[:-2], None, axes[-1]))
        else:
            self.lora_a = self.lora_b = None

    def base_kernel(self) -> jax.Array:
        """The frozen kernel [in, out] ([L, in, out] stacked; dequantised for QLoRA) in its stored dtype."""
        if self.kernel is not None:
            return self.kernel[...]
        codes = self.kernel_codes[...]
        return _per_layer(lambda c, a: dequantize(c, a, self.quant, self.base_dtype), codes.ndim - 2)(
            codes, self.kernel_absmax[...])

    def delta(self) -> jax.Array:
        """``scaling * A @ B`` [in, out] ([L, in, out] stacked) in float32: what merging adds to the kernel."""
        return self.scaling * (self.lora_a[...].astype(jnp.float32) @ self.lora_b[...].astype(jnp.float32))

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.astype(self.dtype)
        y = matmul(x, self.base_kernel().astype(self.dtype), precision=self.precision)
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        if self.lora_a is None:
            return y
        low = matmul(x, self.lora_a[...].astype(self.dtype), precision=self.precision)
        return y + self.scaling * matmul(low, self.lora_b[...].astype(self.dtype), precision=self.precision)


def _per_layer(fn: Any, lead: int) -> Any:
    """``fn`` of one layer's arrays mapped over ``lead`` leading (layer) axes."""
    for _ in range(lead):
        fn = jax.vmap(fn)
    return fn


def lora_config_of(model: nnx.Module) -> LoRAConfig | None:
    """The config :func:`apply_lora` gave ``model``, or None for a plain model."""
    return getattr(model, "lora_config", None)


def dense_layers(model: nnx.Module) -> list[tuple[str, nnx.Module, Any, Dense]]:
    """``(dotted path, parent, key in parent, layer)`` for every Dense, in the model's order."""
    found = []
    for path, module in nnx.iter_modules(model):
        for key, child in list(vars(module).items()):
            if isinstance(child, Dense):
                found.append((".".join(str(p) for p in (*path, key)), module, key, child))
    return sorted(found, key=lambda item: _natural(item[0]))


def unrolled_paths(path: str, layer: Dense) -> tuple[str, ...]:
    """The per-layer paths one Dense stands for: ``model.layers.<i>.<rest>`` for each layer of a
    ``scan_layers`` stack (``model.layers.stack.<rest>``), else the path itself."""
    return per_layer_names(path, _stored_kernel(layer).shape[0]) or (path,)


def _stored_kernel(layer: Dense) -> nnx.Variable:
    """The variable holding a layer's weight: its kernel, or QLoRA's codes (same leading axes and logical axes)."""
    return layer.kernel if layer.kernel is not None else layer.kernel_codes


def linear_paths(model: nnx.Module) -> list[str]:
    """Every linear layer's path as the unrolled model names it, in its order (what PEFT's paths are)."""
    return sorted((p for path, _, _, layer in dense_layers(model) for p in unrolled_paths(path, layer)), key=_natural)


def _natural(path: str) -> list[Any]:
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in path.split(".")]


def _is_target(path: str, targets: tuple[str, ...] | str) -> bool:
    """PEFT's rule: a string is ``all-linear`` or a regex over the whole path; a list matches path ends."""
    if path.split(".")[-1] == OUTPUT_LAYER:
        return False
    if targets == "all-linear":
        return True
    if isinstance(targets, str):
        return re.fullmatch(targets, path) is not None
    return any(path == t or path.endswith("." + t) for t in targets)


def target_paths(model: nnx.Module, config: LoRAConfig) -> list[str]:
    """The (unrolled) paths of the linear layers ``config.target_modules`` selects (ConfigError if none)."""
    layers = linear_paths(model)
    chosen = [p for p in layers if _is_target(p, config.target_modules)]
    head = [p for p in layers if p.split(".")[-1] == OUTPUT_LAYER]
    if head and not isinstance(config.target_modules, str) and OUTPUT_LAYER in config.target_modules:
        raise ConfigError("lora.target_modules names lm_head: an adapter on the output layer is not supported; "
                          "train it in full with lora.train_embeddings: true instead")
    if not chosen:
        names = sorted({p.split(".")[-1] for p in layers if p not in head})
        raise ConfigError(f"lora.target_modules={config.target_modules!r} matches no linear layer of this model; "
                          f"its linear layers are named {names} (or use 'all-linear')")
    return chosen


def apply_lora(model: nnx.Module, config: LoRAConfig) -> nnx.Module:
    """Give ``model`` adapters (and a quantised / cast base) in place, as ``config`` says; returns it.

    The new arrays are placed by the model's partition rules on the mesh its parameters
    live on (adapters: A sharded like the kernel's input axis, B like its output axis).
    Adapter ``i`` of the unrolled model (its :func:`linear_paths` order) draws from
    ``fold_in(key(seed), i)``, in either layout.
    """
    if lora_config_of(model) is not None:
        raise ConfigError("this model already has LoRA adapters; build a fresh base model to apply another config")
    if getattr(getattr(model, "config", None), "fp8", False):  # LoRADense's dots are not FP8: refuse, not mix
        raise ConfigError("model.fp8 is not supported with LoRA/QLoRA (the adapted layers would not run in FP8); "
                          "set model.fp8: false or train without the lora section")
    targets = set(target_paths(model, config))
    index = {p: i for i, p in enumerate(linear_paths(model))}
    key = jax.random.key(config.seed)
    for path, parent, name, layer in dense_layers(model):
        per_layer = unrolled_paths(path, layer)
        chosen = [p in targets for p in per_layer]
        if any(chosen) and not all(chosen):  # one stacked array cannot hold adapters for some layers only
            raise ConfigError(f"lora.target_modules={config.target_modules!r} selects {path.rsplit('.', 1)[-1]} in "
                              f"some layers only, which model.scan_layers cannot hold (one array for all layers); "
                              "target every layer, or set model.scan_layers: false")
        is_head = path.split(".")[-1] == OUTPUT_LAYER
        quant = None if is_head else config.quantize
        if not all(chosen) and quant is None:
            continue
        keys = [jax.random.fold_in(key, index[p]) for p in per_layer]
        new = LoRADense(layer, rank=config.rank if all(chosen) else 0, scaling=config.scaling, quant=quant,
                        block_size=config.block_size, key=jnp.stack(keys) if per_layer != (path,) else keys[0])
        setattr(parent, name, new)
    model.lora_config = config
    if config.base_dtype is not None:
        dtype = jnp.dtype(config.base_dtype)
        for _, var in nnx.iter_graph(model):
            if type(var) is nnx.Param and not _trainable_var(config, var) and jnp.issubdtype(var.dtype, jnp.floating):
                var.set_value(var[...].astype(dtype))
    _place_like_base(model)
    return model


def _place_like_base(model: nnx.Module) -> None:
    """Shard every array by the partition rules on the mesh the base already lives on (if any)."""
    mesh = None
    for leaf in jax.tree.leaves(nnx.state(model)):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, jax.sharding.NamedSharding):
            mesh = sharding.mesh
            break
    if mesh is None:
        return
    state = nnx.state(model)
    shardings = shardings_for_state(state, model.config.partition_axis, mesh)
    nnx.update(model, jax.device_put(nnx.to_pure_dict(state), shardings))


def _trainable_var(config: LoRAConfig, var: nnx.Variable) -> bool:
    """Adapters always; embeddings / LM head and norm weights when the config says so (by logical axes)."""
    if isinstance(var, LoRAParam):
        return True
    if type(var) is not nnx.Param:
        return False
    axes = tuple(var.get_metadata().get("logical_axes") or ())
    if config.train_embeddings and "vocab" in axes:
        return True
    return config.train_norms and axes in (("norm",), (LAYER_AXIS, "norm"))  # a norm, or a stack of them


def split_trainable(model: nnx.Module) -> tuple[Any, Any, Any]:
    """``(graphdef, trainable, frozen)`` as pure dicts; ``frozen`` is None for a model without LoRA.

    :func:`join_trainable` rebuilds the model.
    """
    config = lora_config_of(model)
    if config is None:
        graphdef, state = nnx.split(model)
        return graphdef, nnx.to_pure_dict(state), None
    graphdef, trainable, frozen = nnx.split(model, lambda _, var: _trainable_var(config, var), ...)
    return graphdef, nnx.to_pure_dict(trainable), nnx.to_pure_dict(frozen)


def join_trainable(graphdef: Any, trainable: Any, frozen: Any = None) -> nnx.Module:
    """The module of ``trainable`` and, for LoRA, its frozen base (None without LoRA): the inverse of
    :func:`split_trainable`. The adapters stay unmerged (:func:`merge_lora` folds them in); it shares the
    arrays, so it is cheap inside a jitted function. Why one function: the trainer, the rollout engine and
    the export all rebuild the model this way, and a second spelling could drop the base."""
    return nnx.merge(graphdef, trainable, *(() if frozen is None else (frozen,)))


def trainable_count(model: nnx.Module) -> int:
    """How many numbers training changes (PEFT's ``get_nb_trainable_parameters()[0]`` for the same setup)."""
    _, trainable, _ = split_trainable(model)
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(trainable))


def _plain_dense(layer: LoRADense, kernel: jax.Array, model: nnx.Module) -> Dense:
    """A ``Dense`` holding ``kernel`` [in, out] or a stack's [L, in, out] (built abstractly, so no random
    kernel is ever allocated; a stacked layer's own ``axes`` are one layer's, as the stack built them)."""
    axes = tuple(_stored_kernel(layer).get_metadata()["logical_axes"])
    dense = nnx.eval_shape(lambda: Dense(kernel.shape[-2], kernel.shape[-1], axes[-2:], use_bias=False,
                                         config=model.config, dtype=layer.dtype, param_dtype=kernel.dtype,
                                         precision=layer.precision, rngs=nnx.Rngs(0)))
    dense.kernel = nnx.Param(kernel, logical_axes=axes)
    dense.bias = layer.bias
    return dense


def merge_lora(model: nnx.Module, dtype: Any = None) -> nnx.Module:
    """A plain model (same class, no adapters) with ``W + scaling * A B`` in every adapted layer.

    Quantised layers are dequantised; merged kernels take ``dtype`` (default: the
    model's ``param_dtype``). ``model`` itself is left as it is.
    """
    if lora_config_of(model) is None:
        return model
    graphdef, state = nnx.split(model)
    merged = nnx.merge(graphdef, state)  # a new module graph sharing the arrays
    dtype = jnp.dtype(dtype or merged.param_dtype)
    for _, parent, name, layer in dense_layers(merged):
        if isinstance(layer, LoRADense):
            kernel = layer.base_kernel().astype(jnp.float32)
            if layer.lora_a is not None:
                kernel = kernel + layer.delta()
            setattr(parent, name, _plain_dense(layer, kernel.astype(dtype), merged))
    for _, var in nnx.iter_graph(merged):  # a base cast to lora.base_dtype goes back to the model's dtype
        if type(var) is nnx.Param and jnp.issubdtype(var.dtype, jnp.floating) and var.dtype != dtype:
            var.set_value(var[...].astype(dtype))
    merged.lora_config = None
    return merged
