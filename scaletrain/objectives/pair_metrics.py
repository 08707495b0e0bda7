"""The figures preference objectives log, under TRL's names, as sums with the counts they are averaged by.

Why sums: a step adds an objective's sums over its micro-batches and divides once, and an
evaluation adds them over every eval batch, so each figure is exactly its value over the
whole batch (or eval set). A figure is declared once, as ``name -> (sum key, count key)``;
:func:`step_figures` (inside the jitted step) and :func:`eval_figures` (on the host, with
TRL's ``eval_`` prefix) read the same table.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

Array = jax.Array
Table = Mapping[str, tuple[str, str]]

#: the reward figures of every paired objective (DPO, ORPO, CPO/SimPO), averaged per pair
PAIR_FIGURES: dict[str, tuple[str, str]] = {
    "rewards/chosen": ("rewards_chosen", "pairs"),
    "rewards/rejected": ("rewards_rejected", "pairs"),
    "rewards/accuracies": ("rewards_accuracies", "pairs"),
    "rewards/margins": ("rewards_margins", "pairs"),
    "logps/chosen": ("logps_chosen", "pairs"),
    "logps/rejected": ("logps_rejected", "pairs"),
}


def reward_sums(chosen_rewards: Array, rejected_rewards: Array, chosen_logps: Array, rejected_logps: Array,
                rows: Array) -> dict[str, Array]:
    """The sums behind :data:`PAIR_FIGURES` over the real rows (``rows`` 1.0) of a micro-batch; rewards are
    never differentiated (they are figures, not losses)."""
    c, r = jax.lax.stop_gradient(chosen_rewards), jax.lax.stop_gradient(rejected_rewards)
    return {
        "pairs": jnp.sum(rows),
        "rewards_chosen": jnp.sum(c * rows),
        "rewards_rejected": jnp.sum(r * rows),
        "rewards_accuracies": jnp.sum((c > r).astype(jnp.float32) * rows),
        "rewards_margins": jnp.sum((c - r) * rows),
        "logps_chosen": jnp.sum(jax.lax.stop_gradient(chosen_logps) * rows),
        "logps_rejected": jnp.sum(jax.lax.stop_gradient(rejected_logps) * rows),
    }


def step_figures(sums: Mapping[str, Array], table: Table) -> dict[str, Array]:
    """Each figure of ``table`` as its sum over its count (0 where the count is 0), inside jit."""
    return {name: sums[s] / jnp.maximum(sums[c], 1.0) for name, (s, c) in table.items()}


def eval_figures(totals: Mapping[str, Any], table: Table) -> dict[str, float]:
    """Each figure of ``table`` from totals over an eval set, named ``eval_<name>`` as TRL names them."""
    return {f"eval_{name}": float(totals[s]) / max(float(totals[c]), 1.0) for name, (s, c) in table.items()}


def zeros(keys: tuple[str, ...] | list[str]) -> dict[str, Array]:
    """Float32 scalar zeros for ``keys`` (every preference sum is a scalar)."""
    return {k: jnp.zeros((), jnp.float32) for k in keys}
