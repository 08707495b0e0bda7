"""LM head + cross-entropy whose gradient is computed in the forward pass, chunk by chunk.

The gradient of token cross-entropy with respect to the logits is known as soon as
the forward pass has them: ``softmax(logits) - onehot(target)`` (plus
``2 log Z softmax`` for the z-loss), times the mask. So, while a chunk of positions'
logits is still in cache, :func:`fused_head_loss` also turns it into that chunk's
gradients for the hidden states (``dlogits @ W^T``) and for the head weight
(accumulated ``h^T dlogits``), and keeps only those. Compared with computing whole
logits and letting autodiff do the rest, this

- never holds ``[B, T, V]`` logits or their gradient in memory (only one chunk's:
  a 128k vocabulary at 8 x 2048 tokens is 8 GB of float32 logits, 1 GB per 256-token
  chunk), and
- does so without the extra head matmul that recomputing chunks in the backward pass
  (``jax.checkpoint`` over a chunked loss) would cost, and with the softmax passes
  over each chunk while it is in cache.

The backward pass only scales the stored gradients by the incoming cotangent (the
objective is linear in them).

Soft-capped logits (Gemma's ``c * tanh(z / c)`` over the head's output ``z``) are capped
chunk by chunk too; the chain rule adds the factor ``1 - tanh(z / c)^2`` to ``dlogits``.

When the batch or the sequence is sharded over devices (``batch_axes`` /
``sequence_axes`` of an active mesh), each device's share of ``h^T dlogits`` is a
partial sum over its positions. Accumulated into one ``[H, V]`` carry, XLA would
all-reduce that whole matrix after every chunk (it cannot carry a pending reduction
through a loop); so the carry gets leading per-shard axes ``[Sb, P, H, V]``, sharded
like the batch and the sequence (each device holds one ``[H, V]``, as before), and the
sum over shards is taken once, after the loop.

The objective is ``sum(loss) + z_weight * sum(z_loss)``; the :class:`LossSums`
returned beside it are metrics and carry no gradient. Outside differentiation
(evaluation) only the loss is computed, chunk by chunk.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from scaletrain.models.kernels.cpu_dots import contract_rows, dot
from scaletrain.parallel.partition import active_axis_size, active_sharding_axes
from scaletrain.objectives.loss import LossSums, next_token_targets, token_sums_and_log_z

Array = jax.Array


def fused_head_loss(hidden: Array, kernel: Array, input_ids: Array, mask: Array, dtype: Any, chunk_size: int,
                    z_weight: float = 0.0, precision: Any = None, transposed: bool = False,
                    batch_axes: Any = None, sequence_axes: Any = None,
                    softcap: float | None = None) -> tuple[Array, LossSums]:
    """``(sum(loss) + z_weight * sum(z_loss), LossSums)`` of the head ``kernel`` on ``hidden`` [B, T, H].

    ``kernel`` is [H, V], or [V, H] (a tied embedding) if ``transposed``; ``mask``
    [B, T-1] is :func:`~scaletrain.objectives.loss.target_mask`'s. The sequence is cut into
    chunks of ``chunk_size`` positions (all rows of the batch in each, so a batch
    axis sharded over devices stays where it is); a chunk longer than the sequence (or
    than one device's share of it) is cut to that length.
    ``batch_axes`` / ``sequence_axes``: the mesh axes the batch and sequence dimensions
    are sharded over (the model's ``partition_axis``). With the sequence sharded over P
    devices, each of them chunks its own T/P positions (a chunk is P pieces, one per
    device), so no chunk's logits cross devices; and the head's weight gradient is
    reduced over all of these axes once rather than once per chunk. ``softcap``: the
    model's :meth:`~scaletrain.models.llama.LlamaForCausalLM.logit_softcap` (None: uncapped).
    """
    layout = ChunkLayout.of(hidden.shape[0], hidden.shape[1], chunk_size, batch_axes, sequence_axes)
    targets, full_mask = next_token_targets(input_ids, mask)
    split = layout.split
    return _fused(split(hidden.astype(dtype)), kernel.astype(dtype), split(targets), split(full_mask),
                  float(z_weight), precision, transposed, layout.axes, None if softcap is None else float(softcap))


Axes = tuple[tuple[str, ...], tuple[str, ...]]  # (batch axes, sequence axes), each possibly empty


class ChunkLayout(NamedTuple):
    """How [N, T, ...] rows are cut into chunks of positions: each device's share of the sequence (one of
    P pieces when the sequence is sharded) cut into ``chunks`` of ``chunk_size`` positions, the last one
    padded by ``pad``. Shared by every chunked head (the fused loss, per-token log-probs)."""

    n: int
    t: int
    pieces: int
    local: int
    chunk_size: int
    chunks: int
    pad: int
    axes: Axes

    @classmethod
    def of(cls, n: int, t: int, chunk_size: int, batch_axes: Any, sequence_axes: Any) -> ChunkLayout:
        """The layout of ``n`` rows of ``t`` positions; a chunk longer than a device's share is cut to it."""
        axes = (active_sharding_axes(batch_axes, n), active_sharding_axes(sequence_axes, t))
        pieces = active_axis_size(axes[1])
        local = t // pieces
        chunk_size = min(chunk_size, local)
        chunks = -(-local // chunk_size)
        return cls(n, t, pieces, local, chunk_size, chunks, chunks * chunk_size - local, axes)

    def split(self, x: Array) -> Array:
        """[N, T, ...] -> [chunks, N, P, chunk, ...]"""
        x = x.reshape(self.n, self.pieces, self.local, *x.shape[2:])
        if self.pad:
            x = jnp.pad(x, ((0, 0), (0, 0), (0, self.pad)) + ((0, 0),) * (x.ndim - 3))
        return jnp.moveaxis(x.reshape(self.n, self.pieces, self.chunks, self.chunk_size, *x.shape[3:]), 2, 0)

    def join(self, x: Array) -> Array:
        """[chunks, N, P, chunk] -> [N, T]: :meth:`split`'s inverse for per-position figures."""
        x = jnp.moveaxis(x, 0, 2).reshape(self.n, self.pieces, self.chunks * self.chunk_size)
        return x[:, :, :self.local].reshape(self.n, self.t)


def _on_shards(x: Array, axes: Axes, p_dim: int) -> Array:
    """``x`` with axis 0 sharded over the batch axes and axis ``p_dim`` (the P pieces of the
    sequence) over the sequence axes; the other axes are left to XLA."""
    spec = [PartitionSpec.UNCONSTRAINED] * x.ndim
    spec[0], spec[p_dim] = axes[0] or None, axes[1] or None
    return lax.with_sharding_constraint(x, PartitionSpec(*spec))


def head_grad_carry(hidden_size: int, vocab: int, axes: Axes) -> Array:
    """The zero float32 accumulator of :func:`head_grad` over a loop of chunks: [H, V], or one [H, V] per
    shard ([Sb, P, H, V], sharded like the batch and the sequence) so that no reduction runs per chunk."""
    if not any(axes):
        return jnp.zeros((hidden_size, vocab), jnp.float32)
    shards = (active_axis_size(axes[0]), active_axis_size(axes[1]))
    return _on_shards(jnp.zeros((*shards, hidden_size, vocab), jnp.float32), axes, 1)


def finish_head_grad(dw: Array, axes: Axes, transposed: bool, dtype: Any) -> Array:
    """The head's gradient from :func:`head_grad_carry`'s accumulated value: the one reduction over the
    shards, laid out like the head ([V, H] when ``transposed``) in its dtype."""
    if any(axes):
        dw = dw.sum((0, 1))
    return (dw.T if transposed else dw).astype(dtype)


def head_grad(h: Array, dlogits: Array, axes: Axes, precision: Any) -> Array:
    """``h^T dlogits`` [B, P, chunk, ·] in float32: [H, V], or [Sb, P, H, V] per shard when the batch or
    sequence is sharded (summed over shards once, after the loop)."""
    if not any(axes):
        return contract_rows(h, dlogits, precision).astype(jnp.float32)
    sb = active_axis_size(axes[0])
    hs = _on_shards(h.reshape(sb, -1, *h.shape[1:]), axes, 2)  # [Sb, B/Sb, P, chunk, H]
    ds = _on_shards(dlogits.reshape(sb, -1, *dlogits.shape[1:]), axes, 2)
    out = lax.dot_general(hs, ds, (((1, 3), (1, 3)), ((0, 2), (0, 2))), precision=precision,
                          preferred_element_type=jnp.float32)  # [Sb, P, H, V]
    return _on_shards(out, axes, 1)


def chunk_logits(h: Array, w: Array, precision: Any, transposed: bool,
                  softcap: float | None) -> tuple[Array, Array | None]:
    """``(logits, dlogits/dz)`` in float32 of the head's output ``z``, soft-capped when ``softcap`` is set
    (the derivative is None without a cap)."""
    z = dot(h, w, rhs_transposed=transposed, precision=precision).astype(jnp.float32)
    if softcap is None:
        return z, None
    t = jnp.tanh(z / softcap)
    return t * softcap, 1.0 - t * t


def _add(a: LossSums, b: LossSums) -> LossSums:
    return LossSums(*(x + y for x, y in zip(a, b)))


def _zeros() -> LossSums:
    return LossSums(*(jnp.zeros((), jnp.float32) for _ in LossSums._fields))


def _objective(s: LossSums, z_weight: float) -> Array:
    return s.loss + z_weight * s.z_loss


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _fused(hs: Array, w: Array, ts: Array, ms: Array, z_weight: float, precision: Any,
           transposed: bool, axes: Axes, softcap: float | None) -> tuple[Array, LossSums]:
    def body(carry: LossSums, xs: tuple[Array, Array, Array]) -> tuple[LossSums, None]:
        h, t, m = xs
        logits = chunk_logits(h, w, precision, transposed, softcap)[0]
        return _add(carry, token_sums_and_log_z(logits, t, m)[0]), None

    sums, _ = lax.scan(body, _zeros(), (hs, ts, ms))
    return _objective(sums, z_weight), sums


def _fused_fwd(hs: Array, w: Array, ts: Array, ms: Array, z_weight: float, precision: Any, transposed: bool,
               axes: Axes, softcap: float | None) -> tuple[tuple[Array, LossSums], tuple[Array, Array]]:
    vocab = w.shape[0] if transposed else w.shape[1]

    def body(carry: tuple[LossSums, Array], xs: tuple[Array, Array, Array]) -> tuple[tuple[LossSums, Array], Array]:
        sums, dw = carry
        h, t, m = xs
        logits, dcap = chunk_logits(h, w, precision, transposed, softcap)
        chunk, log_z = token_sums_and_log_z(logits, t, m)
        # d objective / d logits = m * ((1 + 2 z log Z) softmax - onehot(t))
        scale = (m * (1.0 + 2.0 * z_weight * log_z))[..., None]
        onehot = lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1) == t[..., None]
        dlogits = jnp.exp(logits - log_z[..., None]) * scale - jnp.where(onehot, m[..., None], 0.0)
        dlogits = (dlogits if dcap is None else dlogits * dcap).astype(w.dtype)
        dh = dot(dlogits, w, rhs_transposed=not transposed, precision=precision)
        dw = dw + head_grad(h, dlogits, axes, precision)
        return (_add(sums, chunk), dw), dh.astype(h.dtype)

    (sums, dw), dhs = lax.scan(body, (_zeros(), head_grad_carry(hs.shape[-1], vocab, axes)), (hs, ts, ms))
    dw = finish_head_grad(dw, axes, transposed, w.dtype)
    return (_objective(sums, z_weight), sums), (dhs, dw)


def _fused_bwd(z_weight: float, precision: Any, transposed: bool, axes: Axes, softcap: float | None,
               res: tuple[Array, Array], cotangents: tuple[Array, LossSums]) -> tuple[Array, Array, None, None]:
    dhs, dw = res
    g = cotangents[0]  # the sums are metrics: their cotangents are ignored
    return (g * dhs).astype(dhs.dtype), (g * dw).astype(dw.dtype), None, None


_fused.defvjp(_fused_fwd, _fused_bwd)
