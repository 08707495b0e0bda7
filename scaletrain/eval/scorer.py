"""Batched, jitted log-likelihoods of continuations: what lm-eval's requests reduce to.

Why shape buckets: lm-eval sends thousands of requests of every length; a jitted forward per
request length would compile for each. Requests are sorted longest first, cut into batches of
a fixed number of rows (the last one filled with a copy), and each batch is right-padded to
the next power of two (capped at the context length), so a task compiles a handful of
shapes, once. Right padding needs no mask: with causal attention a position never sees the
padding after it. The forward runs on the model's own mesh, rows split over ``dp``/``fsdp``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from scaletrain.compile_cache import ProgramCache, model_key
from scaletrain.generation.buckets import round_up_pow2

#: the shortest bucket: shorter rows cost no more than this to pad, and a task gets fewer shapes
MIN_BUCKET = 16

#: one jitted scorer per model graph (:func:`model_key`): a new state of the same model (in-loop evaluation)
#: reuses it
_SCORERS: ProgramCache[Any] = ProgramCache(8)


def bucket(length: int, cap: int) -> int:
    """The padded length of a batch whose longest row is ``length``: the next power of two (the rollout
    engine's bucketing), capped."""
    return max(min(round_up_pow2(length, MIN_BUCKET), cap), length)


def _scorer(graphdef: Any) -> Any:
    """``f(state, ids [B, T], targets [B, T]) -> (log p(target) [B, T], target is the argmax [B, T])``, jitted
    (then compiled once per shape)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    def score(state: Any, ids: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
        model = nnx.merge(graphdef, state)
        hidden, _ = model.hidden_states_and_aux(ids)
        logits = model.compute_logits(hidden).astype(jnp.float32)
        # log p(target) = logit - logsumexp: no second [B, T, V] array (a log-softmax) beside the logits
        target = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        picked = target - jax.nn.logsumexp(logits, axis=-1)
        return picked, jnp.argmax(logits, axis=-1) == targets

    return jax.jit(score)


class TokenScorer:
    """Scores ``(tokens, n)`` requests: the summed log-probability of the last ``n`` tokens of ``tokens`` given
    those before them, and whether greedy decoding would have produced exactly them."""

    def __init__(self, model: Any, batch_size: int = 8, max_length: int | None = None):
        import jax
        from flax import nnx

        from scaletrain.models.factory import place_model

        self.model, self.mesh = place_model(model)
        rows = int(np.prod([self.mesh.shape.get(a, 1) for a in ("dp", "fsdp")]))
        self.batch_size = -(-max(int(batch_size), 1) // rows) * rows  # a whole number of rows per device
        self.max_length = int(max_length or getattr(self.model.config, "max_position_embeddings", 2048))
        graphdef, self.state = nnx.split(self.model)
        self._fn = _SCORERS.get(model_key(self.model), lambda: _scorer(graphdef))
        self._sharding = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec(("dp", "fsdp")))
        self.shapes_seen: set[tuple[int, int]] = set()

    def score(self, requests: Sequence[tuple[Sequence[int], int]], progress: Any = None) -> list[tuple[float, bool]]:
        """One ``(log-likelihood, is_greedy)`` per request, in the order given.

        A request longer than ``max_length + 1`` tokens keeps its last ``max_length + 1`` (the context is cut
        from the left, as lm-eval's own models do)."""
        import jax

        cut = [(list(t)[-(self.max_length + 1):], n) for t, n in requests]
        order = sorted(range(len(cut)), key=lambda i: -len(cut[i][0]))
        out: list[tuple[float, bool]] = [(0.0, False)] * len(cut)
        for lo in range(0, len(order), self.batch_size):
            chosen = order[lo: lo + self.batch_size]
            rows = [cut[i] for i in chosen]
            t = bucket(max(len(r[0]) - 1 for r in rows), self.max_length)
            ids = np.zeros((self.batch_size, t), np.int32)
            targets = np.zeros((self.batch_size, t), np.int32)
            for j in range(self.batch_size):
                tokens = rows[min(j, len(rows) - 1)][0]
                ids[j, : len(tokens) - 1] = tokens[:-1]
                targets[j, : len(tokens) - 1] = tokens[1:]
            self.shapes_seen.add(ids.shape)
            with jax.set_mesh(self.mesh):
                logp, greedy = self._fn(self.state, jax.device_put(ids, self._sharding),
                                        jax.device_put(targets, self._sharding))
            logp, greedy = np.asarray(logp, np.float64), np.asarray(greedy)
            for j, i in enumerate(chosen):
                tokens, n = cut[i]
                end = len(tokens) - 1
                out[i] = (float(logp[j, end - n: end].sum()), bool(greedy[j, end - n: end].all()))
            if progress is not None:
                progress.update(len(chosen))
        return out
