"""Pure train and eval steps.

``train_step(state, batch) -> (state, metrics)`` computes gradients over
``gradient_accumulation_steps`` micro-batches inside one jitted call
(``lax.scan``), normalises by the number of target tokens of the whole batch, and
applies the optimizer. Nothing here touches the host.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax import lax

from scaletrain.key_paths import key_names
from scaletrain.models.scanned_layers import stacked_axes
from scaletrain.parallel.partition import active_platform
from scaletrain.training.fused_loss import fused_head_loss
from scaletrain.training.loss import LossSums, cross_entropy_sums, target_mask
from scaletrain.training.router_losses import hidden_and_router_stats, router_metrics, router_objective, router_sums
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


def _forward(graphdef: Any, params: Any, batch: Batch, loss_chunk_size: int | None = None,
             z_loss: float = 0.0, frozen: Any = None) -> tuple[jax.Array, tuple[LossSums, dict[str, jax.Array]]]:
    """``(objective, (sums, router))``: the summed loss to differentiate (``loss + z_loss * z_loss``, plus a
    mixture of experts' router losses) and the metrics' sums (``router``: :func:`router_sums`, ``{}`` if dense).

    With ``loss_chunk_size`` the head and the loss run chunk by chunk with their
    gradient computed in the forward pass (:func:`fused_head_loss`: no whole logits).
    ``frozen``: a LoRA model's base, merged in but not differentiated (``TrainState.frozen``).
    """
    model = nnx.merge(graphdef, params, *(() if frozen is None else (frozen,)))
    mask = target_mask(batch["input_ids"], batch.get("segment_ids"), batch.get("loss_mask"))
    hidden, stats = hidden_and_router_stats(model, batch)
    if loss_chunk_size:
        kernel, transposed = model.lm_head_weight()
        pa = model.config.partition_axis
        objective, sums = fused_head_loss(hidden, kernel, batch["input_ids"], mask, model.dtype, loss_chunk_size,
                                          z_loss, model.precision, transposed, pa.batch_axis, pa.sequence_axis,
                                          model.logit_softcap())
    else:
        sums = cross_entropy_sums(model.compute_logits(hidden), batch["input_ids"], mask)
        objective = sums.loss + z_loss * sums.z_loss
    return objective + router_objective(model, stats, sums.tokens), (sums, router_sums(stats, sums.tokens))


def split_microbatches(batch: Batch, num: int) -> Batch:
    """[num * m, ...] -> [num, m, ...], micro-batch g taking rows g, g+num, ...

    Interleaving keeps each micro-batch's rows on the devices that already hold
    them when the batch axis is sharded, so no data moves between devices.
    """

    def split(x: jax.Array) -> jax.Array:
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


def _sum_tree(a: Any, b: Any) -> Any:
    return jax.tree.map(jnp.add, a, b)


def _zero_sums(graphdef: Any, params: Any, frozen: Any = None) -> tuple[LossSums, dict[str, jax.Array]]:
    """Float32 zeros shaped like :func:`_forward`'s metric sums, to start the accumulation.

    Shaped from what is known without tracing the forward (which ``jax.eval_shape`` of it
    would do once more per compile): the loss sums are scalars, and a mixture of experts'
    router sums follow from its router statistics' shapes (``router_stats_shape``).
    """
    model = nnx.merge(graphdef, params, *(() if frozen is None else (frozen,)))
    stats_shape = getattr(model, "router_stats_shape", None)
    tokens = jax.ShapeDtypeStruct((), jnp.float32)
    router = {} if stats_shape is None else jax.eval_shape(router_sums, stats_shape(), tokens)
    shapes = (LossSums(*(tokens for _ in LossSums._fields)), router)
    return jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), shapes)


def train_step(
    state: TrainState,
    batch: Batch,
    *,
    tx: optax.GradientTransformation,
    gradient_accumulation_steps: int = 1,
    z_loss: float = 0.0,
    guard_nonfinite: bool = True,
    log_grad_norms: bool = False,
    log_weight_stats: bool = False,
    loss_chunk_size: int | None = None,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer update from ``batch`` (the whole global batch).

    With ``guard_nonfinite`` an update whose loss or gradient norm is not finite is
    not applied (parameters and optimizer state stay as they were, the step counter
    still advances) and ``metrics["nonfinite"]`` is 1, so a bad batch never corrupts
    the state that later checkpoints save.
    """

    def objective(params: Any, micro: Batch) -> tuple[jax.Array, tuple[LossSums, dict[str, jax.Array]]]:
        return _forward(state.graphdef, params, micro, loss_chunk_size, z_loss, state.frozen)

    grad_fn = jax.grad(objective, has_aux=True)
    if gradient_accumulation_steps == 1:
        grads, (sums, router) = grad_fn(state.params, batch)
    else:
        micro = split_microbatches(batch, gradient_accumulation_steps)
        zeros = (
            jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params),
            _zero_sums(state.graphdef, state.params, state.frozen),
        )

        def body(carry: Any, mb: Batch) -> tuple[Any, None]:
            return _sum_tree(carry, grad_fn(state.params, mb)), None

        (grads, (sums, router)), _ = lax.scan(body, zeros, micro)
    denom = jnp.maximum(sums.tokens, 1.0)
    # Gradients are summed and normalised in float32 whatever the parameters' dtype
    # (bf16 parameters give bf16 gradients; the optimizer reads float32, see optim.in_float32).
    grads = jax.tree.map(lambda g: g.astype(jnp.float32) / denom, grads)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(sums.loss) & jnp.isfinite(grad_norm)

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
    new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
    metrics = {
        "loss": sums.loss / denom,
        "z_loss": sums.z_loss / denom,
        "accuracy": sums.correct / denom,
        "tokens": sums.tokens,
        "grad_norm": grad_norm,
        "nonfinite": 1.0 - finite.astype(jnp.float32),
        **router_metrics(router, denom),
    }
    if log_grad_norms:
        metrics.update(group_norms(grads, "grad_norm"))
    if log_weight_stats:
        metrics.update(group_norms(params, "weight_norm"))
    return new_state, metrics


def eval_step(state: TrainState, batch: Batch, *, gradient_accumulation_steps: int = 1,
              loss_chunk_size: int | None = None) -> LossSums:
    """Loss sums for ``batch`` (no update), in micro-batches like the train step."""
    if gradient_accumulation_steps == 1:
        return _forward(state.graphdef, state.params, batch, loss_chunk_size, frozen=state.frozen)[1][0]
    micro = split_microbatches(batch, gradient_accumulation_steps)
    zeros = LossSums(*(jnp.zeros((), jnp.float32) for _ in LossSums._fields))

    def body(carry: LossSums, mb: Batch) -> tuple[LossSums, None]:
        return _sum_tree(carry, _forward(state.graphdef, state.params, mb, loss_chunk_size,
                                         frozen=state.frozen)[1][0]), None

    sums, _ = lax.scan(body, zeros, micro)
    return sums


def make_step_functions(
    tx: optax.GradientTransformation,
    state_sharding: Any,
    batch_sharding: Any,
    replicated: Any,
    gradient_accumulation_steps: int,
    z_loss: float,
    guard_nonfinite: bool = True,
    log_grad_norms: bool = False,
    log_weight_stats: bool = False,
    loss_chunk_size: int | None = None,
) -> tuple[Callable, Callable]:
    """Jit the steps with explicit in/out shardings; the train state is donated."""
    train = jax.jit(
        functools.partial(train_step, tx=tx, gradient_accumulation_steps=gradient_accumulation_steps, z_loss=z_loss,
                          guard_nonfinite=guard_nonfinite, log_grad_norms=log_grad_norms,
                          log_weight_stats=log_weight_stats, loss_chunk_size=loss_chunk_size),
        in_shardings=(state_sharding, batch_sharding),
        out_shardings=(state_sharding, replicated),
        donate_argnums=(0,),
    )
    evaluate = jax.jit(
        functools.partial(eval_step, gradient_accumulation_steps=gradient_accumulation_steps,
                          loss_chunk_size=loss_chunk_size),
        in_shardings=(state_sharding, batch_sharding),
        out_shardings=replicated,
    )
    return train, evaluate
