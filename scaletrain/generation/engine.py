"""The rollout engine: batched sampling from the live training parameters, with the log-probabilities.

Why it samples from the training state itself: a second copy of the weights (a vLLM or
sglang server beside the trainer) needs a weight sync after every update and computes
log-probabilities with other kernels, so "on-policy" quietly drifts off-policy. Here the
rollout is one jitted program over the very arrays the optimizer updates (``TrainState.params``
and, for LoRA, the frozen base: the adapters run unmerged, as in training), on the mesh
they already live on: no copy, no host round trip, nothing to sync. Its tokens run through
the model's one forward (``CausalLM.forward`` with a KV cache), so a token's log-probability
here and in the trainer's forward differ only by summation order (see
:mod:`scaletrain.generation.sampling` for which distribution it is).

One program per shape bucket (:mod:`scaletrain.generation.buckets` says what is padded):
the prefill of the left-padded prompts is one forward, then a ``lax.while_loop`` of
one-token decode steps that ends when every row has stopped or ``max_completion_length``
tokens are out. The KV cache is allocated inside the program and sharded like the model's
activations (rows over the batch axes, dp/fsdp; key/value heads over tp), and the loop
updates it in place: nothing crosses to the host until the caller reads the result.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from scaletrain.compile_cache import ProgramCache, model_key
from scaletrain.generation.buckets import PaddedBatch, as_rows, bucket
from scaletrain.generation.sampling import inverse_temperature, pick_tokens, row_keys, sampling_problem
from scaletrain.models.common.decoder import constrain
from scaletrain.models.kernels.attention import KVCache
from scaletrain.models.kernels.cpu_dots import traced_forward_only
from scaletrain.parallel.partition import active_axis_size
from scaletrain.peft.lora import join_trainable

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample: TRL's names (``max_completion_length``, ``temperature``, ``top_k``, ``top_p``).

    ``temperature`` 0 is greedy. ``stop_token_ids`` end a row (the stop token is part of the
    completion, as TRL's mask counts it); its later columns hold ``pad_token_id``.
    """

    max_completion_length: int
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    stop_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        problem = (("max_completion_length", f"must be at least 1, got {self.max_completion_length}")
                   if self.max_completion_length < 1 else
                   sampling_problem(self.max_completion_length, self.temperature, self.top_k, self.top_p))
        if problem is not None:
            raise ValueError(" ".join(problem))
        object.__setattr__(self, "stop_token_ids", tuple(int(i) for i in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature is None or float(self.temperature) <= 0.0


class Rollout(NamedTuple):
    """One rollout's device arrays, one row per completion (prompt ``i``'s generations at rows
    ``i * G .. i * G + G - 1``).

    ``prompt_ids`` / ``prompt_mask`` [B, P]: the prompts left-padded to their bucket, as the model
    read them. ``completion_ids`` [B, N] (N = ``max_completion_length``), ``completion_mask`` [B, N]
    (1 up to and including the stop token), ``log_probs`` [B, N] float32 (0 under a mask of 0),
    ``lengths`` [B], ``truncated`` [B] (no stop token within N), ``steps`` the number of decode
    steps run (the columns any row needed).
    """

    prompt_ids: Array
    prompt_mask: Array
    completion_ids: Array
    completion_mask: Array
    log_probs: Array
    lengths: Array
    truncated: Array
    steps: Array


def _mesh_of(tree: Any) -> Any:
    """The mesh the first array of ``tree`` is laid out on (None for single-device arrays)."""
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return sharding.mesh
    return None


class StaticBatchProgram:
    """The compiled rollout program of one model graph; :func:`rollout` finds or builds it.

    ``traces`` counts how often the program was traced, i.e. compiled: once per bucket
    (prompt bucket, batch bucket, ``max_completion_length``, greedy or not, top-k, top-p on/off).
    """

    def __init__(self, graphdef: Any, batch_axis: Any = ("dp", "fsdp")):
        self.graphdef = graphdef
        self.batch_axis = batch_axis
        self.traces = 0
        self._program = jax.jit(traced_forward_only(self._program_body),
                                static_argnames=("new", "greedy", "top_k", "use_top_p"))

    def run(self, params: Any, frozen: Any, batch: PaddedBatch, sampling: SamplingParams, seed: int | Array,
            step: int | Array, rows: Sequence[int] | None = None) -> Rollout:
        """Sample ``batch`` (see :func:`rollout`); the padding rows are cut off the result."""
        greedy = sampling.greedy
        stop = np.asarray(sampling.stop_token_ids, np.int32).reshape(-1)
        keyed = np.arange(batch.live.shape[0], dtype=np.int32)
        if rows is not None:
            keyed[:len(rows)] = np.asarray(rows, np.int32)
        out = self._program(
            params, frozen, batch.input_ids, batch.attention_mask, batch.live, keyed,
            jnp.asarray(seed, jnp.uint32), jnp.asarray(step, jnp.int32),
            np.float32(1.0 if greedy else sampling.temperature), inverse_temperature(sampling.temperature),
            np.float32(1.0 if sampling.top_p is None else sampling.top_p),
            stop, np.int32(sampling.pad_token_id),
            new=int(sampling.max_completion_length), greedy=greedy,
            top_k=None if greedy or sampling.top_k is None else int(sampling.top_k),
            use_top_p=not greedy and sampling.top_p is not None,
        )
        if batch.rows == batch.live.shape[0]:
            return out
        return Rollout(*(x[: batch.rows] for x in out[:-1]), out[-1])

    def _program_body(self, params: Any, frozen: Any, input_ids: Array, attention_mask: Array, live: Array,
                      keyed: Array, seed: Array, step: Array, temperature: Array, inv_temperature: Array, top_p: Array,
                      stop_ids: Array, fill: Array, *,
                      new: int, greedy: bool, top_k: int | None, use_top_p: bool) -> Rollout:
        """Prefill, then decode until every row stopped or ``new`` tokens are out; row ``r`` draws with the key of
        ``(seed, step, keyed[r])``."""
        self.traces += 1  # runs only while tracing: one per compilation
        model = join_trainable(self.graphdef, params, frozen)
        pa = model.config.partition_axis
        b, p = input_ids.shape
        input_ids = constrain(input_ids, (pa.batch_axis, None))
        mask = attention_mask.astype(jnp.int32)
        kv_valid = jnp.zeros((b, p + new), bool).at[:, :p].set(mask.astype(bool))
        positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0).astype(jnp.int32)
        cache = sharded_cache(model, b, p + new)
        hidden, cache = model.forward_with_cache(input_ids, positions, cache, 0, kv_valid)  # 0: a prefill
        pick = functools.partial(pick_tokens, keys=row_keys(seed, step, keyed), greedy=greedy,
                                 temperature=temperature, inv_temperature=inv_temperature, top_k=top_k,
                                 top_p=top_p if use_top_p else None)

        def is_stop(tok: Array) -> Array:
            return jnp.any(tok[:, None] == stop_ids[None, :], axis=-1)

        def write(t: Array, tok: Array, lp: Array, done: Array, outs: tuple[Array, Array, Array]) -> tuple[Any, ...]:
            alive = ~done
            tok = jnp.where(alive, tok, fill)
            cols = (tok, alive.astype(jnp.int32), jnp.where(alive, lp, 0.0))
            outs = tuple(jax.lax.dynamic_update_slice_in_dim(o, c[:, None], t, axis=1) for o, c in zip(outs, cols))
            return tok, done | (alive & is_stop(tok)), outs

        outs = (jnp.full((b, new), fill, jnp.int32), jnp.zeros((b, new), jnp.int32), jnp.zeros((b, new), jnp.float32))
        tok, lp = pick(model.compute_logits(hidden[:, -1]), position=jnp.int32(0))
        tok, done, outs = write(jnp.int32(0), tok, lp, ~live, outs)

        def cond(carry: tuple[Any, ...]) -> Array:
            t, _, _, _, _, done, _ = carry
            return (t < new) & ~jnp.all(done)

        def body(carry: tuple[Any, ...]) -> tuple[Any, ...]:
            t, tok, cache, kv_valid, pos, done, outs = carry
            slot = p + t - 1  # the previous token's slot
            kv_valid = jax.lax.dynamic_update_slice_in_dim(kv_valid, jnp.ones((b, 1), bool), slot, axis=1)
            hidden, cache = model.forward_with_cache(tok[:, None], pos[:, None], cache, slot, kv_valid)
            nxt, lp = pick(model.compute_logits(hidden[:, 0]), position=t)
            nxt, done, outs = write(t, nxt, lp, done, outs)
            return t + 1, nxt, cache, kv_valid, pos + 1, done, outs

        carry = (jnp.int32(1), tok, cache, kv_valid, jnp.sum(mask, axis=1).astype(jnp.int32), done, outs)
        steps, _, _, _, _, done, (tokens, comp_mask, log_probs) = jax.lax.while_loop(cond, body, carry)
        return Rollout(input_ids, attention_mask, tokens, comp_mask, log_probs, jnp.sum(comp_mask, axis=1),
                       live & ~done, steps)


def sharded_cache(model: nnx.Module, batch: int, length: int) -> Any:
    """``model``'s empty KV cache, rows over the batch axes and key/value heads over the head axis (the
    training layout of the activations; a dimension the axes do not divide stays whole)."""
    pa = model.config.partition_axis
    cache = model.init_cache(batch, length)
    spec = (pa.batch_axis, None, pa.kv_head_axis, None)
    if isinstance(cache, KVCache):  # stacked layers: a leading layer axis
        return KVCache(*(constrain(x, (None, *spec)) for x in cache))
    # a layer's state of another kind (linear attention's): rows over the batch axes, the rest whole
    return [KVCache(*(constrain(x, spec) for x in layer)) if isinstance(layer, KVCache)
            else jax.tree.map(lambda x: constrain(x, (pa.batch_axis,)), layer) for layer in cache]


_MAX_ENGINES = 8
_ENGINES: ProgramCache[StaticBatchProgram] = ProgramCache(_MAX_ENGINES)
#: the last graph definitions seen, by identity (a TrainState keeps one graphdef for the whole run),
#: each kept alive beside its engine so that its id cannot be reused
_BY_ID: ProgramCache[tuple[Any, StaticBatchProgram]] = ProgramCache(_MAX_ENGINES)


def engine_for(graphdef: Any, params: Any, frozen: Any = None) -> StaticBatchProgram:
    """The engine of ``graphdef``'s model, shared by every graph equal to it (:func:`model_key`), so a
    rebuilt or reloaded model of the same architecture reuses the compiled programs."""
    def by_model() -> tuple[Any, StaticBatchProgram]:
        model = join_trainable(graphdef, params, frozen)
        return graphdef, _ENGINES.get(model_key(model),
                                      lambda: StaticBatchProgram(graphdef, model.config.partition_axis.batch_axis))

    known = _BY_ID.get(id(graphdef), by_model)
    if known[0] is not graphdef:  # an id reused after its graph was garbage-collected: replace the entry
        _BY_ID.drop(id(graphdef))
        known = _BY_ID.get(id(graphdef), by_model)
    return known[1]


def split_source(source: Any) -> tuple[Any, Any, Any]:
    """``(graphdef, params, frozen)`` of a TrainState (anything with ``graphdef``, ``params`` and
    ``frozen``), a ``(graphdef, params[, frozen])`` tuple, or an ``nnx.Module`` (split here)."""
    if isinstance(source, nnx.Module):
        graphdef, state = nnx.split(source)
        return graphdef, state, None
    if isinstance(source, tuple) and len(source) in (2, 3):
        return source[0], source[1], source[2] if len(source) == 3 else None
    if all(hasattr(source, name) for name in ("graphdef", "params")):
        return source.graphdef, source.params, getattr(source, "frozen", None)
    raise TypeError(f"rollout: expected a TrainState, (graphdef, params[, frozen]) or a model, "
                    f"got {type(source).__name__}")


def rollout(source: Any, prompts: Any, sampling: SamplingParams, *, num_generations: int = 1,
            seed: int | Array = 0, step: int | Array = 0, attention_mask: Any = None,
            rows: Sequence[int] | None = None) -> Rollout:
    """Sample ``num_generations`` completions of each prompt from ``source``'s live parameters.

    ``source``: the TrainState being trained (``params`` and, for LoRA, ``frozen``; nothing is
    copied or merged), a ``(graphdef, params[, frozen])`` tuple, or a model. ``prompts``: token
    lists of any lengths, or [B, T] left-padded ids with ``attention_mask``. The draws are a pure
    function of ``(seed, step, row, position)``, so a resumed run samples what the uninterrupted one
    did at the same ``step``; ``rows`` (one per output row) replaces each row's index in that key.
    Runs on the mesh the parameters live on (entered here when none is active). Returns device arrays
    (:class:`Rollout`); reading them is the only host sync.
    """
    graphdef, params, frozen = split_source(source)
    ids, mask = as_rows(prompts, attention_mask)
    mesh = _mesh_of(params)
    engine = engine_for(graphdef, params, frozen)
    if mesh is None or not jax.sharding.get_abstract_mesh().empty:
        return engine.run(params, frozen, _bucket(engine, ids, mask, num_generations, sampling), sampling, seed,
                          step, rows)
    with jax.set_mesh(mesh):
        return engine.run(params, frozen, _bucket(engine, ids, mask, num_generations, sampling), sampling, seed,
                          step, rows)


def _bucket(engine: StaticBatchProgram, ids: np.ndarray, mask: np.ndarray, num_generations: int,
            sampling: SamplingParams) -> PaddedBatch:
    """The shape bucket of these prompts; the batch rounded to the active mesh's batch-axis devices."""
    shards = 1 if jax.sharding.get_abstract_mesh().empty else active_axis_size(engine.batch_axis)
    return bucket(ids, mask, num_generations, sampling.pad_token_id, shards)


def stop_ids(eos_token_id: int | Sequence[int] | None) -> tuple[int, ...]:
    """``eos_token_id`` (an id, a list of ids or None) as a tuple of ids."""
    if eos_token_id is None:
        return ()
    return (int(eos_token_id),) if isinstance(eos_token_id, (int, np.integer)) else tuple(int(i) for i in eos_token_id)


@dataclasses.dataclass(frozen=True)
class StaticBatchEngine:
    """Today's engine behind the :class:`~scaletrain.generation.interface.RolloutEngine` interface: a static
    batch per shape bucket (:func:`rollout`), every row decoding until the longest has stopped.

    ``sampling`` is fixed for the engine's life (a trainer samples every step alike); the state,
    prompts, group size, seed and step come with each call.
    """

    sampling: SamplingParams

    def generate(self, state: Any, prompts: Sequence[Sequence[int]], *, num_generations: int = 1, seed: int = 0,
                 step: int = 0, rows: Sequence[int] | None = None) -> Rollout:
        return rollout(state, [list(p) for p in prompts], self.sampling, num_generations=num_generations,
                       seed=seed, step=step, rows=rows)
