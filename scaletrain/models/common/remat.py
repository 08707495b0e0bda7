"""Remat (gradient checkpointing) policies: what a decoder layer keeps from its forward for the backward.

Every layer runs under ``nnx.remat`` with the policy ``config.gradient_checkpointing``
names (:data:`scaletrain.models.options.REMAT` maps other tools' names onto these).
The policies save by name where a custom VJP hides an op from JAX's own rules:
:func:`scaletrain.models.kernels.cpu_dots.matmul` names its outputs, and the Pallas flash
kernel names its output and row log-sum-exp (:data:`~scaletrain.models.kernels.flash_attention.ATTENTION_OUTPUT`,
:data:`~scaletrain.models.kernels.flash_attention.ATTENTION_LSE`), its only residuals besides q, k
and v. Saving those two makes the backward's attention a single pass of the two
gradient kernels instead of a forward kernel first; cuDNN's statistics stay hidden
in JAX's custom VJP, so with cuDNN attention these policies still recompute its forward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from scaletrain.models.kernels.cpu_dots import BATCHED_MATMUL, MATMUL
from scaletrain.models.kernels.flash_attention import ATTENTION_LSE, ATTENTION_OUTPUT
from scaletrain.models.options import REMAT_POLICIES

_policies = jax.checkpoint_policies

#: policy name (:data:`~scaletrain.models.options.REMAT_POLICIES` but ``none``) -> the jax
#: remat policy (``full``: save nothing)
POLICIES: dict[str, Any] = {
    "full": None,
    "dots": _policies.save_from_both_policies(
        _policies.checkpoint_dots, _policies.save_only_these_names(MATMUL, BATCHED_MATMUL)),
    # the projections' outputs: the attention scores and the MLP's activations are recomputed
    "dots_with_no_batch_dims": _policies.save_from_both_policies(
        _policies.checkpoint_dots_with_no_batch_dims, _policies.save_only_these_names(MATMUL)),
    # the attention output (and the Pallas kernel's log-sum-exp): the projections are recomputed
    "save_attention": _policies.save_only_these_names(ATTENTION_OUTPUT, ATTENTION_LSE),
    # long sequences: the projections and the attention kept, only elementwise work recomputed
    "dots_and_attention": _policies.save_from_both_policies(
        _policies.checkpoint_dots_with_no_batch_dims,
        _policies.save_only_these_names(MATMUL, ATTENTION_OUTPUT, ATTENTION_LSE)),
}
if set(POLICIES) != set(REMAT_POLICIES) - {"none"}:  # a name config accepts must have a policy, and back
    raise ImportError(f"scaletrain.models.common.remat.POLICIES builds {sorted(POLICIES)}, but "
                      f"options.REMAT_POLICIES names {sorted(REMAT_POLICIES)} (all but 'none' must be built)")


def run_layer(layer: nnx.Module, policy: str, *args: Any, call: Callable[..., Any] | None = None) -> Any:
    """``layer(*args)`` (or ``call(layer, *args)``), rematerialised in the backward pass under
    ``policy`` (``none``: not at all)."""
    call = call or (lambda lyr, *a: lyr(*a))
    if policy == "none":
        return call(layer, *args)
    return nnx.remat(call, policy=POLICIES[policy])(layer, *args)
