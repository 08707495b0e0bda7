"""Distillation from a teacher: the generalised Jensen-Shannon divergence between the student's and the teacher's
next-token distributions over every completion token, TRL 1.16's ``DistillationTrainer`` and ``GKDTrainer`` loss.

Why the whole distribution and not the teacher's log-probability of the sampled token: TRL's two trainers compare
the full vocabulary at each position (the teacher's dense distribution), and so do we, so ``beta`` means what it
means there: 0 the forward KL(teacher || student), 1 the reverse KL(student || teacher), otherwise
``beta * KL(teacher || m) + (1 - beta) * KL(student || m)`` with the mixture ``m = (1 - beta) student + beta
teacher``. The teacher is a frozen model (``frozen["teacher"]``, ``training/frozen.py``) read inside the jitted
step: its forward runs on the same rows, on the same mesh, under ``stop_gradient``; nothing crosses to the host.

``temperature`` divides both models' logits before the softmax (``DistillationTrainer`` applies its sampling
temperature there; ``GKDTrainer`` samples at its temperature but computes the loss at 1, and its builder says so).
The loss is summed over completion tokens and divided by their count over the whole batch (TRL's
``num_items_in_batch``), so gradient accumulation is exact; ``entropy`` is the student's mean per-token entropy at
the same temperature, TRL's logged figure.

Rows are laid out as the rollout engine returns them (``objectives/token_logps.py``): the prompt left-padded, then
the completion; only the positions that predict a completion token are projected to the vocabulary.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from scaletrain.generation.sampling import inverse_temperature
from scaletrain.objectives.base import Batch, ObjectiveBase, Sums

Array = jax.Array
ROW_KEYS = ("input_ids", "segment_ids", "positions", "completion_mask")
TEACHER = "teacher"


def completion_log_probs(model: Any, batch: Batch, width: int, temperature: float) -> Array:
    """``log_softmax(logits / temperature)`` [N, C, V] (float32) at the positions predicting the last ``width``
    tokens of each row."""
    ids = batch["input_ids"]
    p = ids.shape[1] - width
    hidden = model.hidden_states(ids, positions=batch["positions"], segment_ids=batch["segment_ids"])
    logits = model.compute_logits(hidden[:, p - 1:-1]).astype(jnp.float32)
    inv_t = inverse_temperature(temperature)
    if inv_t != 1.0:
        logits = logits * inv_t
    return jax.nn.log_softmax(logits, axis=-1)


def generalized_jsd(student: Array, teacher: Array, beta: float) -> Array:
    """Per-position divergence [...] between log-distributions ``student`` and ``teacher`` [..., V] (see the module
    docstring for what ``beta`` selects)."""
    ps, pt = jnp.exp(student), jnp.exp(teacher)
    if beta == 0.0:
        return jnp.sum(pt * (teacher - student), axis=-1)
    if beta == 1.0:
        return jnp.sum(ps * (student - teacher), axis=-1)
    mixture = jnp.logaddexp(student + math.log1p(-beta), teacher + math.log(beta))
    return (beta * jnp.sum(pt * (teacher - mixture), axis=-1)
            + (1.0 - beta) * jnp.sum(ps * (student - mixture), axis=-1))


@dataclasses.dataclass(frozen=True)
class DistillationObjective(ObjectiveBase):
    """The generalised JSD to ``frozen["teacher"]`` over completion tokens (see the module docstring)."""

    beta: float = 1.0
    temperature: float = 1.0

    name: ClassVar[str] = "distillation"
    batch_keys: ClassVar[tuple[str, ...]] = ROW_KEYS
    frozen_models: ClassVar[tuple[str, ...]] = (TEACHER,)
    normaliser: ClassVar[str] = "tokens"
    logged_metrics: ClassVar[tuple[str, ...]] = ("entropy",)

    def loss_and_sums(self, model: Any, batch: Batch, frozen: Mapping[str, Any]) -> tuple[Array, Sums]:
        mask = batch["completion_mask"].astype(jnp.float32)
        width = mask.shape[1]
        student = completion_log_probs(model, batch, width, self.temperature)
        teacher = jax.lax.stop_gradient(completion_log_probs(frozen[TEACHER], batch, width, self.temperature))
        divergence = generalized_jsd(student, teacher, self.beta)
        entropy = -jnp.sum(jnp.exp(student) * student, axis=-1)
        loss = jnp.sum(divergence * mask)
        return loss, {"loss": jax.lax.stop_gradient(loss), "tokens": jnp.sum(mask),
                      "entropy": jax.lax.stop_gradient(jnp.sum(entropy * mask))}

    def zero_sums(self, model: Any) -> Sums:
        return {k: jnp.zeros((), jnp.float32) for k in ("loss", "tokens", "entropy")}

    def step_metrics(self, sums: Sums, denom: Array) -> dict[str, Array]:
        return {"loss": sums["loss"] / denom, "entropy": sums["entropy"] / denom}

    def eval_metrics(self, totals: Mapping[str, Any], bytes_per_token: float | None = None) -> dict[str, float]:
        denom = max(float(totals["tokens"]), 1.0)
        return {"eval_loss": float(totals["loss"]) / denom, "eval_entropy": float(totals["entropy"]) / denom}
