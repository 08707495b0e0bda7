"""Optimizer and learning-rate schedule from ``TrainingArguments`` (optax)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from scaletrain.arguments import TrainingArguments
from scaletrain.key_paths import dotted
from scaletrain.models.common.scanned_layers import stacked_axes


def resolved_learning_rate_end(args: TrainingArguments) -> float:
    """Final learning rate: explicit, else 10% of the peak for decaying schedules."""
    if args.learning_rate_end is not None:
        return args.learning_rate_end
    return args.learning_rate if args.scheduler == "constant" else 0.1 * args.learning_rate


def make_schedule(args: TrainingArguments, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0, then constant, linear or cosine decay to the end rate."""
    peak, end = args.learning_rate, resolved_learning_rate_end(args)
    warmup = min(args.warmup_steps, max(total_steps - 1, 0))
    decay_steps = max(total_steps - warmup, 1)
    if args.scheduler == "constant":
        main = optax.constant_schedule(peak)
    elif args.scheduler == "linear":
        main = optax.linear_schedule(peak, end, decay_steps)
    else:
        main = optax.cosine_decay_schedule(peak, decay_steps, alpha=end / peak if peak else 0.0)
    if warmup == 0:
        return main
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), main], [warmup])


def _decay_mask(params: Any) -> Any:
    """Weight decay on matrices only (not on norms or biases); a stacked layer axis does not count."""
    return jax.tree_util.tree_map_with_path(lambda path, p: p.ndim - stacked_axes(path) >= 2, params)


def _to_float32(tree: Any) -> Any:
    """Floating leaves as float32; anything else (integers, optax's placeholders) unchanged."""
    def cast(x: Any) -> Any:
        dtype = getattr(x, "dtype", None)
        if dtype is not None and jnp.issubdtype(dtype, jnp.floating) and dtype != jnp.float32:
            return x.astype(jnp.float32)
        return x
    return jax.tree.map(cast, tree)


def in_float32(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """``inner`` run in float32 whatever the parameters' dtype: the precision policy.

    With bfloat16 parameters (``param_dtype="bfloat16"``, RayDistributedTrainer's
    default) the optimizer moments, the gradient it reads and the update it returns are
    float32; only the final ``params + update`` is rounded to the parameters' dtype (by
    ``optax.apply_updates``). bf16 moments would lose Adam's second moment (8 bits of
    mantissa cannot hold ``b2 = 0.999``'s averaging) and bf16 updates round small steps
    to zero. With float32 parameters this wrapper changes nothing, and the state's
    structure is ``inner``'s own, so checkpoints are the same either way.
    """
    def init(params: Any) -> Any:
        return inner.init(_to_float32(params))

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        return inner.update(_to_float32(updates), state, _to_float32(params))

    return optax.GradientTransformation(init, update)


def parameter_path(path: tuple[Any, ...]) -> str:
    """A parameter's path as ``frozen_parameters`` matches it: ``model/layers/0/self_attn/q_proj/kernel``."""
    return dotted(path, sep="/")


def frozen_mask(pattern: str) -> Any:
    """``params -> tree of bools``: True where the parameter's path matches ``pattern`` (``re.search``)."""
    regex = re.compile(pattern)

    def mask(params: Any) -> Any:
        return jax.tree_util.tree_map_with_path(lambda path, _: bool(regex.search(parameter_path(path))), params)

    return mask


def freeze(inner: optax.GradientTransformation, pattern: str) -> optax.GradientTransformation:
    """``inner`` with the parameters matching ``pattern`` left untouched (EasyDeL's ``frozen_parameters``).

    Their gradients are zeroed before ``inner`` (so gradient clipping's global norm and
    the moments see only trained parameters) and their updates after it (so weight
    decay does not move them either). The optimizer state keeps its structure's leaves
    (the frozen moments stay zero), so shardings and checkpoints work unchanged.
    """
    zero = optax.masked(optax.set_to_zero(), frozen_mask(pattern))
    return optax.chain(zero, inner, zero)


def leave_out(inner: optax.GradientTransformation, mask: Callable[[Any], Any]) -> optax.GradientTransformation:
    """``inner`` over every parameter but those ``mask`` marks, which get a zero update and no optimizer state.

    Why not :func:`freeze`: these parameters are changed by the step itself, not by the optimizer
    (a router's correction bias, :mod:`scaletrain.training.router_bias`), so they hold no moments
    and take no part in clipping's global norm or weight decay.
    """
    def trained(params: Any) -> Any:
        return jax.tree.map(lambda marked: not marked, mask(params))

    return optax.chain(optax.masked(optax.set_to_zero(), mask), optax.masked(inner, trained))


def make_optimizer(args: TrainingArguments, schedule: optax.Schedule,
                   untrained: Callable[[Any], Any] | None = None) -> optax.GradientTransformation:
    """Gradient clipping (if set) followed by the chosen optimizer, in float32 (:func:`in_float32`),
    leaving ``frozen_parameters`` untouched (:func:`freeze`) and the parameters ``untrained`` marks
    out of it altogether (:func:`leave_out`)."""
    if args.optimizer == "adamw":
        opt = optax.adamw(schedule, b1=args.beta1, b2=args.beta2, eps=args.epsilon,
                          weight_decay=args.weight_decay, mask=_decay_mask)
    elif args.optimizer == "lion":
        opt = optax.lion(schedule, b1=args.beta1, b2=args.beta2, weight_decay=args.weight_decay,
                         mask=_decay_mask)
    elif args.optimizer == "adafactor":
        opt = optax.adafactor(schedule, weight_decay_rate=args.weight_decay or None,
                              weight_decay_mask=_decay_mask)
    else:
        opt = optax.chain(
            optax.add_decayed_weights(args.weight_decay, mask=_decay_mask),
            optax.sgd(schedule, momentum=args.momentum or None),
        )
    if args.clip_grad:
        opt = optax.chain(optax.clip_by_global_norm(args.clip_grad), opt)
    if args.frozen_parameters:
        opt = freeze(opt, args.frozen_parameters)
    if untrained is not None:
        opt = leave_out(opt, untrained)
    return in_float32(opt)
