"""Matmuls whose backward XLA's CPU backend runs without large layout copies.

XLA CPU lowers a dot to YNNPACK only when the batch dimensions lead both operands
and the lhs contracts over its *last* dimension (``[B, M, K] x [B, K, N]`` or
``x [B, N, K]``, row-major); for any other dot it first copies an operand into a
transposed layout, or falls back to Eigen's matmul (about half YNNPACK's speed
here). The gradient of the rhs (a layer's weight, attention's keys and values)
contracts over M, the *leading* non-batch dimension of both operands, so JAX's
automatic transpose hands XLA a dot it can run only after a transposed copy, and
XLA picks the operand to copy without regard to size: the [tokens, vocab] logit
gradient (64 MB) for the LM head, d(gate) for each MLP, the [T, S] score gradient
for each attention layer.

:func:`matmul` computes the same values with a custom VJP whose backward copies
the *smallest* tensor that makes every dot YNNPACK-shaped (``optimization_barrier``
keeps XLA from folding that transpose back into the dot). It is used only when
tracing for the CPU backend: cuBLAS and the TPU take transposed operands for free,
so elsewhere it is the plain ``dot_general``.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from scaletrain.parallel.partition import active_platform

Array = jax.Array

#: ``checkpoint_name`` of a :func:`matmul` output on CPU, so that remat policies that save
#: dots can save it (the custom VJP hides the ``dot_general`` from them)
MATMUL = "cpu_matmul"
BATCHED_MATMUL = "cpu_batched_matmul"


def _dims(a: Array, b: Array, batch: int, rhs_transposed: bool) -> Any:
    """``dot_general`` numbers: ``a [*B, *M, K]`` by ``b [*B, K, N]`` (or ``[*B, N, K]``)."""
    bd = tuple(range(batch))
    return ((a.ndim - 1,), (batch + 1 if rhs_transposed else batch,)), (bd, bd)


def _last_to(x: Array, pos: int) -> Array:
    """``x`` with its last axis moved to ``pos``, materialised (not foldable into a dot)."""
    perm = (*range(pos), x.ndim - 1, *range(pos, x.ndim - 1))
    return lax.optimization_barrier(lax.transpose(x, perm))


def _contract_m(x: Array, y: Array, batch: int, precision: Any) -> Array:
    """``sum over M of x[*B, *M, i] * y[*B, *M, j]`` -> ``[*B, i, j]`` with YNNPACK-shaped dots.

    The contraction is over the leading non-batch dims of both, so one tensor has to
    be transposed in memory: ``x`` (then ``x^T y``), or ``y`` and the [i, j] result
    (``(y^T x)^T``), whichever moves fewer elements.
    """
    bd = tuple(range(batch))
    m = tuple(range(batch, x.ndim - 1))
    mt = tuple(d + 1 for d in m)  # M dims after the last axis moved in front of them
    size_i, size_j = x.shape[-1], y.shape[-1]
    rows = math.prod(x.shape[batch:-1])
    if rows * size_i <= rows * size_j + size_i * size_j:
        return lax.dot_general(_last_to(x, batch), y, ((mt, m), (bd, bd)), precision=precision)
    out_t = lax.dot_general(_last_to(y, batch), x, ((mt, m), (bd, bd)), precision=precision)
    return lax.optimization_barrier(out_t).swapaxes(-1, -2)


def _plain(a: Array, b: Array, batch: int, rhs_transposed: bool, precision: Any) -> Array:
    return lax.dot_general(a, b, _dims(a, b, batch, rhs_transposed), precision=precision)


_cpu_matmul = jax.custom_vjp(_plain, nondiff_argnums=(2, 3, 4))


def _cpu_matmul_fwd(a: Array, b: Array, batch: int, rhs_transposed: bool,
                    precision: Any) -> tuple[Array, tuple[Array, Array]]:
    return _cpu_matmul(a, b, batch, rhs_transposed, precision), (a, b)


def _cpu_matmul_bwd(batch: int, rhs_transposed: bool, precision: Any, res: tuple[Array, Array],
                    dc: Array) -> tuple[Array, Array]:
    a, b = res
    bd = tuple(range(batch))
    # da = dc b^T: dc [*B, *M, N] contracts its last dim with b's N (either layout is YNNPACK's)
    n_dim = batch if rhs_transposed else batch + 1
    da = lax.dot_general(dc, b, (((dc.ndim - 1,), (n_dim,)), (bd, bd)), precision=precision)
    db = _contract_m(dc, a, batch, precision) if rhs_transposed else _contract_m(a, dc, batch, precision)
    return da.astype(a.dtype), db.astype(b.dtype)


_cpu_matmul.defvjp(_cpu_matmul_fwd, _cpu_matmul_bwd)


_FORWARD_ONLY = contextvars.ContextVar("scaletrain_cpu_dots_forward_only", default=False)


@contextlib.contextmanager
def forward_only() -> Iterator[None]:
    """Trace :func:`matmul` as the plain ``dot_general`` inside: for programs nothing differentiates.

    Why: the custom VJP only shapes the backward, yet tracing each call through it costs ~1 ms of Python
    (a third of the continuous engine's decode trace for SmolLM2-135M's 271 matmuls, on the path to a first
    call's first token). The forward is the same ``dot_general`` either way, so the program's values are
    the same bits."""
    token = _FORWARD_ONLY.set(True)
    try:
        yield
    finally:
        _FORWARD_ONLY.reset(token)


def traced_forward_only(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` traced under :func:`forward_only` (wrap a function before ``jax.jit``).

    JAX caches a trace by function, not by context, so wrap only a function that nothing differentiates
    anywhere (a rollout program), never one a training step also traces."""
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with forward_only():
            return fn(*args, **kwargs)

    return run


def matmul(a: Array, b: Array, batch: int = 0, rhs_transposed: bool = False, precision: Any = None) -> Array:
    """``a [*B, *M, K] @ b [*B, K, N]`` (``b [*B, N, K]`` if ``rhs_transposed``) -> ``[*B, *M, N]``.

    ``batch`` leading dims are shared; any number of M dims. On the CPU backend the
    backward issues only YNNPACK-shaped dots (see the module docstring).
    """
    if active_platform() == "cpu" and not _FORWARD_ONLY.get():
        out = _cpu_matmul(a, b, batch, rhs_transposed, precision)
        return checkpoint_name(out, BATCHED_MATMUL if batch else MATMUL)
    return _plain(a, b, batch, rhs_transposed, precision)


def dot(a: Array, b: Array, rhs_transposed: bool = False, precision: Any = None) -> Array:
    """``a [*M, K] @ b [K, N]`` (``b [N, K]`` if ``rhs_transposed``): a plain ``dot_general``.

    For code that computes its own gradients (no autodiff through it), where the
    YNNPACK-shaped forward is all that matters.
    """
    return _plain(a, b, 0, rhs_transposed, precision)


def contract_rows(x: Array, y: Array, precision: Any = None) -> Array:
    """``sum over all leading dims of x[..., i] * y[..., j]`` -> ``[i, j]``: a weight gradient ``x^T y``.

    On CPU the smaller operand is transposed in memory first (see :func:`_contract_m`);
    elsewhere it is one ``dot_general``.
    """
    if active_platform() == "cpu":
        return _contract_m(x, y, 0, precision)
    m = tuple(range(x.ndim - 1))
    return lax.dot_general(x, y, ((m, m), ((), ())), precision=precision)
