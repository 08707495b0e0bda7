"""Per-sequence log-probabilities and logit statistics from one forward, for preference objectives.

Why one module: DPO, ORPO, CPO/SimPO and KTO all score whole completions, and TRL's figures
they are compared against (``logps/*``, ``logits/*``, ``entropy``, ``mean_token_accuracy``,
ORPO's and CPO's ``nll_loss``) are all per-row sums over some mask of the same per-token
quantities. :func:`sequence_stats` computes them for every row of a batch in one forward;
:func:`paired_forward` concatenates chosen and rejected rows ([2B, L]) so the pair goes
through the model once, as TRL's ``concatenated_forward`` does.

Every figure is a *sum* per row (with the count it is averaged by), so objectives can add
them over micro-batches and divide once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from scaletrain.objectives.chunked_logps import token_stats
from scaletrain.objectives.loss import resolve_chunk_size, target_mask

Array = jax.Array
Batch = Mapping[str, Array]

#: the per-row figures :func:`sequence_stats` returns
#: - ``logps`` / ``tokens``: log-probability summed over completion targets, and their number
#: - ``logit_sum``: the vocabulary-mean logit summed over the positions predicting a completion target
#: - ``entropy_sum``, ``top1_sum``: the predictive entropy and "target is the first argmax" over the same positions
#: - ``seq_logps`` / ``seq_tokens``: the log-probability over every real target (prompt and completion), their number
#: - ``seq_logit_sum``: the vocabulary-mean logit over the positions predicting a real token (``[:, :-1]`` of a row)
#: - ``all_logit_sum`` / ``positions``: the vocabulary-mean logit over every real position, and their number
STATS = ("logps", "tokens", "logit_sum", "entropy_sum", "top1_sum", "seq_logps", "seq_tokens", "seq_logit_sum",
         "all_logit_sum", "positions")


#: whole float32 logits up to this size (bytes); larger ones go chunk by chunk. On CPU at SmolLM2's 49k
#: vocabulary, [8, 96, V] whole logits measured ~12% faster per head forward + backward than chunks (the
#: chunked backward recomputes each chunk's logits: one more head matmul), so chunks are for memory only
WHOLE_LOGITS_BYTES = 1 << 30


def sequence_stats(model: Any, input_ids: Array, segment_ids: Array, loss_mask: Array,
                   positions: Array | None = None, whole_logits_bytes: int = WHOLE_LOGITS_BYTES) -> dict[str, Array]:
    """The :data:`STATS` of each row ([N] float32 each) of right-padded rows scored by ``model``.

    ``segment_ids`` is 1 on real tokens and 0 on padding, ``loss_mask`` 1 on completion tokens.
    Positions default to ``0..L-1`` per row (the rows are right-padded, one sequence each).
    Logits are computed whole, in float32, while ``[N, L, V]`` of them fit ``whole_logits_bytes``;
    above that the head runs chunk by chunk (:func:`~scaletrain.objectives.chunked_logps.token_stats`,
    chunks sized as the LM loss's ``auto``), and only the log-probabilities carry a gradient.
    """
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(input_ids.shape[1], dtype=jnp.int32), input_ids.shape)
    n, length = input_ids.shape
    if n * length * model.config.vocab_size * 4 > whole_logits_bytes:
        return _chunked_stats(model, input_ids, segment_ids, loss_mask, positions)
    hidden, _ = model.hidden_states_and_aux(input_ids, positions=positions, segment_ids=segment_ids)
    logits = model.compute_logits(hidden).astype(jnp.float32)  # [N, L, V]
    head = logits[:, :-1]
    log_z = jax.nn.logsumexp(head, axis=-1)
    target = jnp.take_along_axis(head, input_ids[:, 1:, None], axis=-1)[..., 0]
    probs = jnp.exp(head - log_z[..., None])
    entropy = log_z - jnp.sum(probs * head, axis=-1)
    top1 = (jnp.argmax(head, axis=-1) == input_ids[:, 1:]).astype(jnp.float32)
    return _row_sums(input_ids, segment_ids, loss_mask, target - log_z, jax.lax.stop_gradient(entropy), top1,
                     jnp.mean(logits, axis=-1))


def _chunked_stats(model: Any, input_ids: Array, segment_ids: Array, loss_mask: Array,
                   positions: Array) -> dict[str, Array]:
    """:func:`sequence_stats` with the head chunk by chunk: no whole ``[N, L, V]`` logits."""
    hidden, _ = model.hidden_states_and_aux(input_ids, positions=positions, segment_ids=segment_ids)
    length = input_ids.shape[1]
    kernel, transposed = model.lm_head_weight()
    pa = model.config.partition_axis
    targets = jnp.pad(input_ids[:, 1:], ((0, 0), (0, 1)))  # position t scores token t+1; the last is dropped
    stats = token_stats(hidden, kernel, targets, model.dtype,
                        resolve_chunk_size("auto", model.config.vocab_size, length) or length, model.precision,
                        transposed, pa.batch_axis, pa.sequence_axis, model.logit_softcap())
    return _row_sums(input_ids, segment_ids, loss_mask, stats.logp[:, :-1], stats.entropy[:, :-1],
                     stats.top1[:, :-1], stats.mean_logit)


def _row_sums(input_ids: Array, segment_ids: Array, loss_mask: Array, logp: Array, entropy: Array, top1: Array,
              mean_logit: Array) -> dict[str, Array]:
    """The :data:`STATS` from per-position figures: ``logp``, ``entropy``, ``top1`` [N, L-1] (position t
    predicting token t+1) and the vocabulary-mean logit [N, L]."""
    completion = target_mask(input_ids, segment_ids, loss_mask)  # [N, L-1]: position t predicts token t+1
    real_targets = target_mask(input_ids, segment_ids, None)
    real = (segment_ids != 0).astype(jnp.float32)
    return {
        "logps": jnp.sum(logp * completion, axis=-1),
        "tokens": jnp.sum(completion, axis=-1),
        "logit_sum": jnp.sum(mean_logit[:, :-1] * completion, axis=-1),
        "entropy_sum": jnp.sum(entropy * completion, axis=-1),
        "top1_sum": jnp.sum(top1 * completion, axis=-1),
        "seq_logps": jnp.sum(logp * real_targets, axis=-1),
        "seq_tokens": jnp.sum(real_targets, axis=-1),
        "seq_logit_sum": jnp.sum(mean_logit[:, :-1] * real_targets, axis=-1),
        "all_logit_sum": jnp.sum(mean_logit * real, axis=-1),
        "positions": jnp.sum(real, axis=-1),
    }


def _positions(batch: Batch, prefix: str) -> Array | None:
    return batch.get(f"{prefix}positions")


def concatenated(batch: Batch, first: str, second: str) -> tuple[Array, Array, Array, Array | None]:
    """``(input_ids, segment_ids, loss_mask, positions)`` of the ``first`` rows then the ``second`` rows
    (key prefixes such as ``"chosen_"`` / ``"rejected_"``): [2B, L], one forward for both."""
    def cat(name: str) -> Array:
        return jnp.concatenate([batch[f"{first}{name}"], batch[f"{second}{name}"]], axis=0)

    have_positions = _positions(batch, first) is not None and _positions(batch, second) is not None
    return cat("input_ids"), cat("segment_ids"), cat("loss_mask"), cat("positions") if have_positions else None


def halves(stats: Mapping[str, Array]) -> tuple[dict[str, Array], dict[str, Array]]:
    """Split [2B] figures into the first B rows' and the last B rows'."""
    first, second = {}, {}
    for key, value in stats.items():
        first[key], second[key] = jnp.split(value, 2, axis=0)
    return first, second


def paired_forward(model: Any, batch: Batch) -> tuple[dict[str, Array], dict[str, Array]]:
    """``(chosen, rejected)`` :data:`STATS` of a pair batch, from one forward of the concatenated rows."""
    return halves(sequence_stats(model, *concatenated(batch, "chosen_", "rejected_")))


def row_logps(model: Any, input_ids: Array, segment_ids: Array, loss_mask: Array,
              positions: Array | None = None) -> Array:
    """Completion log-probabilities [N] of ``model`` (a reference: never differentiated)."""
    return jax.lax.stop_gradient(sequence_stats(model, input_ids, segment_ids, loss_mask, positions)["logps"])


def real_rows(segment_ids: Array) -> Array:
    """1.0 for rows holding a sequence, 0.0 for the empty rows that pad a last eval batch."""
    return (jnp.max(segment_ids, axis=-1) > 0).astype(jnp.float32)
