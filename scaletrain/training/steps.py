"""Pure train and eval steps, generic over the objective they optimise.

``train_step(state, batch, objective=...) -> (state, metrics)`` computes gradients over
``gradient_accumulation_steps`` micro-batches inside one jitted call (``lax.scan``),
normalises by the objective's normaliser summed over the whole batch (target tokens for
the language-model objective), and applies the optimizer. What is computed per
micro-batch, and how its sums become metrics, is the objective's
(:class:`~scaletrain.objectives.Objective`). Nothing here touches the host.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from scaletrain.key_paths import key_names
from scaletrain.models.common.routing import bias_update_rate
from scaletrain.models.common.scanned_layers import stacked_axes
from scaletrain.objectives.base import Objective, Sums, check_batch, select_frozen, with_batch_totals
from scaletrain.parallel.partition import active_platform
from scaletrain.peft.lora import join_trainable
from scaletrain.training.router_bias import router_bias_metrics, update_router_biases
from scaletrain.training.state import TrainState

Batch = dict[str, jax.Array]

#: How the non-finite guard keeps the old state: ``"cond"`` runs the optimizer update inside
#: ``lax.cond``; ``"where"`` computes it and selects between new and old state leaf by leaf;
#: ``"auto"`` is ``cond`` on CPU and ``where`` elsewhere. On XLA CPU the select costs ~10% of
#: the benchmark step (it reads and writes params and both Adam moments once more, and the
#: old state must outlive the in-place update, so XLA copies it): ``bench/variant_ab.py``
#: gave 1.096x wall for ``cond``, the same as no guard at all. On GPU a conditional copies
#: its predicate to the host mid-step, while the select is one fused pass over HBM.
GUARD = "auto"


def _model(state: TrainState, params: Any) -> nnx.Module:
    """The module of ``params`` (and, for LoRA, the frozen base merged in but not differentiated)."""
    return join_trainable(state.graphdef, params, state.frozen)


def _frozen(state: TrainState, objective: Objective) -> dict[str, Any]:
    """The frozen models ``objective`` reads, as modules (merged from ``TrainState.frozen_models``)."""
    return {name: frozen.model for name, frozen in select_frozen(objective, state.frozen_models).items()}


def objective_fn(state: TrainState, objective: Objective) -> Callable[[Any, Batch], tuple[jax.Array, Sums]]:
    """``f(params, micro_batch) -> (summed loss, sums)``: what the step differentiates with respect to ``params``
    only (the LoRA base and the frozen models are read from ``state``, outside the differentiated argument)."""
    frozen = _frozen(state, objective)

    def f(params: Any, micro: Batch) -> tuple[jax.Array, Sums]:
        return objective.loss_and_sums(_model(state, params), micro, frozen)

    return f


def split_microbatches(batch: Batch, num: int) -> Batch:
    """[num * m, ...] -> [num, m, ...], micro-batch g taking rows g, g+num, ...

    Interleaving keeps each micro-batch's rows on the devices that already hold
    them when the batch axis is sharded, so no data moves between devices. A scalar
    (a whole-batch total, ``objectives.base.with_batch_totals``) goes to every micro-batch.
    """

    def split(x: jax.Array) -> jax.Array:
        if x.ndim == 0:
            return jnp.broadcast_to(x, (num,))
        m = x.shape[0] // num
        return jnp.swapaxes(x.reshape(m, num, *x.shape[1:]), 0, 1)

    return jax.tree.map(split, batch)


def group_norms(tree: Any, prefix: str) -> dict[str, jax.Array]:
    """L2 norm per parameter group: the embedding, each decoder layer, the final norm, the head."""
    groups: dict[str, list[jax.Array]] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        keys = key_names(path)
        square = jnp.square(leaf.astype(jnp.float32))
        if stacked_axes(path):  # model.layers.stack.*: [layers, ...], one group per layer as unrolled
            per_layer = jnp.sum(square, axis=tuple(range(1, leaf.ndim)))
            for i in range(leaf.shape[0]):
                groups.setdefault(f"layer_{i}", []).append(per_layer[i])
            continue
        if len(keys) >= 3 and keys[0] == "model" and keys[1] == "layers":
            name = f"layer_{keys[2]}"
        else:
            name = keys[1] if keys[0] == "model" and len(keys) > 1 else keys[0]
        groups.setdefault(name, []).append(jnp.sum(square))
    return {f"{prefix}/{k}": jnp.sqrt(sum(v)) for k, v in groups.items()}


def data_fingerprint(batch: Batch) -> jax.Array:
    """A 24-bit hash of the batch's token ids (every ``*input_ids`` key), as a float32 that holds it exactly.

    Why this form: a position-weighted sum in uint32 wraps the same way however the batch
    is split over devices and processes (integer addition is associative), so N processes
    and M processes give the same value for the same tokens in the same places; the top 24
    bits fit a float32 metric exactly. Its cost is one multiply-add per token.
    """
    total = jnp.uint32(0)
    for k, key in enumerate(sorted(k for k in batch if k.endswith("input_ids"))):
        ids = batch[key].astype(jnp.uint32)
        flat = jnp.arange(ids.size, dtype=jnp.uint32).reshape(ids.shape)
        weights = (flat + jnp.uint32(k * 7919 + 1)) * jnp.uint32(2654435761) | jnp.uint32(1)
        total = total + jnp.sum((ids + jnp.uint32(1)) * weights, dtype=jnp.uint32)
    return (total >> jnp.uint32(8)).astype(jnp.float32)


def _sum_tree(a: Any, b: Any) -> Any:
    return jax.tree.map(jnp.add, a, b)


def train_step(
    state: TrainState,
    batch: Batch,
    *,
    tx: optax.GradientTransformation,
    objective: Objective,
    gradient_accumulation_steps: int = 1,
    guard_nonfinite: bool = True,
    log_grad_norms: bool = False,
    log_weight_stats: bool = False,
    log_data_fingerprint: bool = False,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer update of ``objective`` from ``batch`` (the whole global batch).

    Gradients and sums are added over the micro-batches, then divided once by the summed
    normaliser (``objective.normaliser``), so accumulation is exact whatever each
    micro-batch holds. With ``guard_nonfinite`` an update whose loss or gradient norm is
    not finite is not applied (parameters and optimizer state stay as they were, the
    step counter still advances) and ``metrics["nonfinite"]`` is 1, so a bad batch never
    corrupts the state that later checkpoints save.
    """
    check_batch(objective, batch)
    batch = with_batch_totals(objective, batch)
    grad_fn = jax.grad(objective_fn(state, objective), has_aux=True)
    if gradient_accumulation_steps == 1:
        grads, sums = grad_fn(state.params, batch)
    else:
        micro = split_microbatches(batch, gradient_accumulation_steps)
        zeros = (
            jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params),
            objective.zero_sums(_model(state, state.params)),
        )

        def body(carry: Any, mb: Batch) -> tuple[Any, None]:
            return _sum_tree(carry, grad_fn(state.params, mb)), None

        (grads, sums), _ = lax.scan(body, zeros, micro)
    denom = jnp.maximum(sums[objective.normaliser], 1.0)
    # Gradients are summed and normalised in float32 whatever the parameters' dtype
    # (bf16 parameters give bf16 gradients; the optimizer reads float32, see optim.in_float32).
    grads = jax.tree.map(lambda g: g.astype(jnp.float32) / denom, grads)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(sums["loss"]) & jnp.isfinite(grad_norm)

    def update() -> tuple[Any, Any]:
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        return optax.apply_updates(state.params, updates), opt_state

    if not guard_nonfinite:
        params, opt_state = update()
    elif GUARD == "cond" or (GUARD == "auto" and active_platform() == "cpu"):
        params, opt_state = lax.cond(finite, update, lambda: (state.params, state.opt_state))
    else:
        params, opt_state = jax.tree.map(
            lambda new, old: jnp.where(finite, new, old), update(), (state.params, state.opt_state)
        )
    rate = bias_update_rate(_model(state, state.params).config)
    if rate > 0:  # DeepSeek's balancing: the routers' biases follow this step's loads
        params = update_router_biases(params, sums, rate, finite if guard_nonfinite else jnp.bool_(True))
    new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
    metrics = {
        **objective.step_metrics(sums, denom),
        "grad_norm": grad_norm,
        "nonfinite": 1.0 - finite.astype(jnp.float32),
    }
    if rate > 0:
        metrics.update(router_bias_metrics(params))
    if log_grad_norms:
        metrics.update(group_norms(grads, "grad_norm"))
    if log_weight_stats:
        metrics.update(group_norms(params, "weight_norm"))
    if log_data_fingerprint:
        metrics["data/fingerprint"] = data_fingerprint(batch)
    return new_state, metrics


def eval_step(state: TrainState, batch: Batch, *, objective: Objective,
              gradient_accumulation_steps: int = 1) -> Sums:
    """``objective``'s sums for ``batch`` (no update), in micro-batches like the train step;
    ``objective.eval_metrics`` turns their total over the eval set into figures."""
    check_batch(objective, batch)
    batch = with_batch_totals(objective, batch)
    f = objective_fn(state, objective)
    if gradient_accumulation_steps == 1:
        return f(state.params, batch)[1]
    micro = split_microbatches(batch, gradient_accumulation_steps)

    def body(carry: Sums, mb: Batch) -> tuple[Sums, None]:
        return _sum_tree(carry, f(state.params, mb)[1]), None

    sums, _ = lax.scan(body, objective.zero_sums(_model(state, state.params)), micro)
    return sums


def rank_sharding(sharding: Any, ndim: int) -> Any:
    """``sharding`` for an array of rank ``ndim``: a named sharding's spec cut to that rank.

    A batch's ``[B, L]`` arrays take the step partition spec (batch axes, then sequence
    axes); a per-row ``[B]`` value (a KTO label, a precomputed reference log-prob) takes
    its batch axes alone, so every key is split over the batch axis alike. Any other
    sharding is used as it is.
    """
    if not isinstance(sharding, NamedSharding):
        return sharding
    return NamedSharding(sharding.mesh, PartitionSpec(*tuple(sharding.spec)[:ndim]))


def batch_shardings(batch: Mapping[str, Any], sharding: Any) -> dict[str, Any]:
    """Each key of ``batch`` (arrays or shape structs) with :func:`rank_sharding` of its rank
    (``sharding`` given per key already, as a mapping, is used as it is)."""
    if isinstance(sharding, Mapping):
        return dict(sharding)
    return {k: rank_sharding(sharding, len(v.shape)) for k, v in batch.items()}


class LayoutJit:
    """A step jitted once per batch layout (its keys and their ranks), the batch sharded per key.

    Why not one ``jax.jit`` with the batch sharding as a prefix: a prefix gives every key
    the same sharding, which a ``[B]`` key cannot take when the ``[B, L]`` keys are also
    split over the sequence. The keys are only known when a batch arrives (they are the
    data kind's), so the in-shardings are built then; the usual batch (the same keys every
    step) compiles once.
    """

    def __init__(self, fn: Callable, state_sharding: Any, batch_sharding: Any, out_shardings: Any,
                 donate_argnums: tuple[int, ...] = ()):
        self._fn = fn
        self._state_sharding = state_sharding
        self._batch_sharding = batch_sharding
        self._out_shardings = out_shardings
        self._donate = donate_argnums
        self._jitted: dict[tuple[tuple[str, int], ...], Any] = {}

    def jitted(self, batch: Mapping[str, Any]) -> Any:
        """The ``jax.jit`` of the step for ``batch``'s layout (built on first use)."""
        layout = tuple(sorted((k, len(v.shape)) for k, v in batch.items()))
        if layout not in self._jitted:
            self._jitted[layout] = jax.jit(
                self._fn, in_shardings=(self._state_sharding, batch_shardings(batch, self._batch_sharding)),
                out_shardings=self._out_shardings, donate_argnums=self._donate,
            )
        return self._jitted[layout]

    def __call__(self, state: Any, batch: Mapping[str, Any]) -> Any:
        return self.jitted(batch)(state, batch)

    def lower(self, state: Any, batch: Mapping[str, Any]) -> Any:
        return self.jitted(batch).lower(state, batch)


def make_step_functions(
    tx: optax.GradientTransformation,
    state_sharding: Any,
    batch_sharding: Any,
    replicated: Any,
    objective: Objective,
    gradient_accumulation_steps: int = 1,
    guard_nonfinite: bool = True,
    log_grad_norms: bool = False,
    log_weight_stats: bool = False,
    log_data_fingerprint: bool = False,
) -> tuple[LayoutJit, LayoutJit]:
    """Jit the steps of ``objective`` with explicit in/out shardings; the train state is donated.

    ``batch_sharding`` is that of a ``[B, L]`` batch array; each key of a batch gets it
    cut to its rank (:func:`rank_sharding`), so ``[B]`` keys are split over the batch axes.
    """
    train = LayoutJit(
        functools.partial(train_step, tx=tx, objective=objective,
                          gradient_accumulation_steps=gradient_accumulation_steps, guard_nonfinite=guard_nonfinite,
                          log_grad_norms=log_grad_norms, log_weight_stats=log_weight_stats,
                          log_data_fingerprint=log_data_fingerprint),
        state_sharding, batch_sharding, (state_sharding, replicated), donate_argnums=(0,),
    )
    evaluate = LayoutJit(
        functools.partial(eval_step, objective=objective, gradient_accumulation_steps=gradient_accumulation_steps),
        state_sharding, batch_sharding, replicated,
    )
    return train, evaluate
