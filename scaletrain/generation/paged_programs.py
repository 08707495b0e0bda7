"""The compiled programs of the continuous-batching engine: prefill a prompt, insert it into slots, decode.

Why three programs and a host loop between them: the decode program is the one that runs
almost all the time, so it must never recompile and never stop for the host without reason.
It runs up to ``decode_steps`` steps over every slot inside one ``lax.while_loop`` and hands
control back early only when a slot has freed up *and* rows are waiting (or nothing is left
to decode); the host then prefills the next prompts and inserts them into the free slots.

- **prefill** (one program per prompt-length bucket): one prompt, left-padded to its bucket,
  through the model's contiguous-cache forward (``forward_with_cache``, the static engine's
  prefill, bit for bit); it returns that cache and the last position's logits. A prompt's G
  samples share this one prefill.
- **insert** (per prompt bucket): copies the prefill into the paged state. The prompt's whole
  pages are written once, at its first insertion, and held by all G samples (one count each);
  its last, partial page is copied into a fresh page per sample, since each sample writes its
  own tokens after it (copy-on-write at the first page that differs). Fixed-size layer state
  (linear attention's) is copied into each sample's slot. Each sample's first token is drawn
  from the prefill logits here.
- **decode**: one token per live slot per step, over the pages (``CausalLM.forward_paged``);
  a slot that crosses a page boundary takes a free page on the device
  (:mod:`~scaletrain.generation.page_pool`), a slot that stops gives its pages back, unless its row keeps them for
  its next turn (``Sampler.row_keep``).
- **gather** and **release** (multi-turn rows' kept pages, :mod:`~scaletrain.generation.kept_pages`): a row's next
  turn copies its kept pages into the contiguous prefill cache, and the chunked prefill writes only its new tokens
  over them; release gives a row's kept pages back.

Every random draw is keyed by the row's request index (or the id the request gives it, with its own
seed: :class:`Sampler`) and the token's position in the
completion (:func:`~scaletrain.generation.sampling.row_keys`), never by the slot, and every
computation is row by row, so a row's tokens and log-probabilities do not depend on which slot
ran it or what ran beside it.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from scaletrain.generation.kept_pages import gather_prefix
from scaletrain.generation.page_pool import give_back, take_pages
from scaletrain.generation.sampling import pick_tokens, row_keys
from scaletrain.models.common.decoder import constrain
from scaletrain.models.kernels.attention import KVCache
from scaletrain.models.kernels.cpu_dots import traced_forward_only
from scaletrain.models.kernels.paged_attention import PagedKVCache, PageTable
from scaletrain.peft.lora import join_trainable

Array = jax.Array


class EngineState(NamedTuple):
    """The whole scheduler state, on the device between programs.

    Per layer ``cache`` (page pools and per-slot states); ``counts`` [num_pages] holders per page;
    per slot: ``table`` [slots, max_pages], ``lengths`` (tokens in its cache), ``tokens`` (the last
    token drawn, fed next), ``t`` (the completion position drawn next), ``rows`` (its request
    row; ``R`` when idle), ``active``; per request row: ``out_ids`` / ``out_mask`` / ``out_lp``
    [R, N] and ``stopped`` (ended by a stop id); ``short`` (the pool ran out) and
    ``peak_pages`` (the most pages held at once).
    """

    cache: Any
    counts: Array
    table: Array
    lengths: Array
    tokens: Array
    t: Array
    rows: Array
    active: Array
    out_ids: Array
    out_mask: Array
    out_lp: Array
    stopped: Array
    short: Array
    peak_pages: Array


class Prefill(NamedTuple):
    """One prompt's prefill: the model's contiguous cache of batch 1 over the prompt bucket (left-padded)
    and the last position's logits [1, vocab]."""

    cache: Any
    logits: Array


class Sampler(NamedTuple):
    """The traced sampling operands every program shares (static flags are the programs' arguments).

    Per request row [R], each optional: ``row_seeds`` the seed its draws use (default ``seed``), ``row_ids`` the id
    they are keyed by (default the row's index), ``row_limits`` the most tokens it samples (default ``new``). A
    multi-turn rollout sets them per turn: a row's turn is keyed by (its turn's seed, the row), capped at its room.
    ``row_keep``: the rows that keep their pages when they stop, for their next turn (:mod:`kept_pages`).
    """

    seed: Array
    step: Array
    temperature: Array
    inv_temperature: Array
    top_p: Array
    stop_ids: Array
    fill: Array
    row_seeds: Array | None = None
    row_ids: Array | None = None
    row_limits: Array | None = None
    row_keep: Array | None = None

    def keys(self, rows: Array) -> Array:
        """The draw keys of request ``rows`` (out-of-range ids, an idle slot's, read a clamped entry, unused)."""
        seeds = self.seed if self.row_seeds is None else self.row_seeds[rows]
        return row_keys(seeds, self.step, rows if self.row_ids is None else self.row_ids[rows])

    def limit(self, rows: Array, new: int) -> Array | int:
        """How many tokens request ``rows`` may sample: ``new``, or less where ``row_limits`` says."""
        return new if self.row_limits is None else jnp.minimum(self.row_limits[rows], new)

    def keeps(self, rows: Array) -> Array:
        """Whether request ``rows`` keep their pages when they stop (``row_keep``: their row will continue)."""
        return jnp.zeros(rows.shape, bool) if self.row_keep is None else self.row_keep[rows]


def _layer_pairs(paged: Any, contiguous: Any) -> list[tuple[Any, Any]]:
    """Each layer's (paged state, prefill state), for a list of layers or one stacked pair."""
    if isinstance(paged, PagedKVCache):
        return [(paged, contiguous)]
    return list(zip(paged, contiguous))


def _rebuild(paged: Any, layers: list[Any]) -> Any:
    return layers[0] if isinstance(paged, PagedKVCache) else layers


def _prefill_row(prefill: Prefill, index: Array) -> Prefill:
    """Row ``index`` of a prefill of several prompts, as a prefill of one (batch axis 1 of a stacked cache)."""
    stacked = isinstance(prefill.cache, KVCache) and prefill.cache.keys.ndim == 5
    axis = 1 if stacked else 0
    take = lambda x: jax.lax.dynamic_index_in_dim(x, index, axis=axis)  # noqa: E731  (keeps the axis, of size 1)
    return Prefill(jax.tree.map(take, prefill.cache), jax.lax.dynamic_index_in_dim(prefill.logits, index, axis=0))


def _fill_pages(pool: PagedKVCache, prefill: KVCache, ids: Array, page_index: Array, n: Array) -> PagedKVCache:
    """``pool`` with pages ``ids`` [J] holding the prompt's page ``page_index`` [J] of the left-padded
    prefill cache (batch 1); positions past the prompt are zero. Stacked layers: a leading layer axis."""
    if pool.keys.ndim == 5:  # stacked layers
        return jax.vmap(_fill_pages, in_axes=(0, 0, None, None, None))(pool, prefill, ids, page_index, n)
    page_size = pool.keys.shape[1]
    width = prefill.keys.shape[1]
    cols = width - n + page_index[:, None] * page_size + jnp.arange(page_size)[None, :]  # [J, ps]
    ok = (cols < width)[..., None, None]

    def copy(dst: Array | None, src: Array | None) -> Array | None:
        if dst is None:  # a keys-only pool (multi-head latent attention's)
            return None
        data = jnp.where(ok, jnp.take(src[0], jnp.clip(cols, 0, width - 1), axis=0), 0).astype(dst.dtype)
        return dst.at[ids].set(data, mode="drop")

    return PagedKVCache(copy(pool.keys, prefill.keys), copy(pool.values, prefill.values))


#: XLA's LLVM optimisation level (``xla_backend_optimization_level``) of each program on the CPU, where XLA's
#: default (3) costs compile time and buys no speed. Why: a first call compiles every program before its first
#: token, and on the CPU each program's machine code generation is most of its compile. The programs that run
#: once per prompt or less and move a few pages (init, insert, preempt, the chunk cache) compile at 0; the model
#: programs at 1: their time is in the matrix products, which XLA calls into a library for, so the level of the
#: code around them does not show in a call's time (docs/benchmarks.md "Rollouts", first call).
CPU_OPT_LEVEL = {"init": 0, "prefill": 1, "prefill_cache": 0, "prefill_chunk": 1, "insert": 0, "decode": 1,
                 "preempt": 0, "gather": 0, "release": 0}


def _compiler_options(program: str) -> dict[str, Any] | None:
    """The XLA options ``program`` compiles with: :data:`CPU_OPT_LEVEL` on the CPU, XLA's defaults elsewhere."""
    if jax.default_backend() != "cpu":
        return None
    return {"xla_backend_optimization_level": CPU_OPT_LEVEL[program]}


class PagedPrograms:
    """The three jitted programs of one model graph, and how often each was traced (compiled)."""

    def __init__(self, graphdef: Any):
        self.graphdef = graphdef
        self.traces = {"init": 0, "prefill": 0, "prefill_cache": 0, "prefill_chunk": 0, "insert": 0, "decode": 0,
                       "preempt": 0, "gather": 0, "release": 0}
        jit = lambda name, **kw: jax.jit(traced_forward_only(getattr(self, "_" + name)),  # noqa: E731
                                         compiler_options=_compiler_options(name), **kw)
        self.init = jit("init", static_argnames=("slots", "num_pages", "page_size", "max_pages", "rows", "new"))
        self.prefill = jit("prefill")
        self.prefill_cache = jit("prefill_cache", static_argnames=("width",))
        self.prefill_chunk = jit("prefill_chunk", donate_argnames=("cache",))
        self.insert = jit("insert", static_argnames=("new", "greedy", "top_k", "use_top_p", "page_size"),
                          donate_argnames=("state",))
        self.decode = jit("decode", static_argnames=("new", "greedy", "top_k", "use_top_p", "page_size",
                                                     "decode_steps"), donate_argnames=("state",))
        self.preempt = jit("preempt", static_argnames=("page_size",), donate_argnames=("state",))
        self.gather = jit("gather", static_argnames=("width",))
        self.release = jit("release", donate_argnames=("state",))

    def _model(self, params: Any, frozen: Any) -> nnx.Module:
        return join_trainable(self.graphdef, params, frozen)

    def _init(self, params: Any, frozen: Any, fill: Array, *, slots: int, num_pages: int, page_size: int,
              max_pages: int, rows: int, new: int) -> EngineState:
        """An empty state: every page free, every slot idle, every output row filled with ``fill``."""
        self.traces["init"] += 1
        model = self._model(params, frozen)
        pa = model.config.partition_axis
        cache = model.init_paged_cache(slots, num_pages, page_size)
        pool_spec = (None, None, pa.kv_head_axis, None)  # key/value heads over tp; pages whole

        def shard(c: Any) -> Any:
            if isinstance(c, PagedKVCache):
                return PagedKVCache(*(None if x is None else constrain(x, ((None,) * (x.ndim - 4)) + pool_spec)
                                      for x in c))
            return jax.tree.map(lambda x: constrain(x, (pa.batch_axis,)), c)  # per-slot state: slots over batch

        cache = shard(cache) if isinstance(cache, PagedKVCache) else [shard(c) for c in cache]
        per_slot = lambda value, dtype: constrain(jnp.full((slots,), value, dtype), (pa.batch_axis,))  # noqa: E731
        return EngineState(
            cache=cache, counts=jnp.zeros((num_pages,), jnp.int32),
            table=constrain(jnp.zeros((slots, max_pages), jnp.int32), (pa.batch_axis, None)),
            lengths=per_slot(0, jnp.int32), tokens=per_slot(0, jnp.int32), t=per_slot(0, jnp.int32),
            rows=per_slot(rows, jnp.int32), active=per_slot(False, bool),
            out_ids=jnp.full((rows, new), fill, jnp.int32), out_mask=jnp.zeros((rows, new), jnp.int32),
            out_lp=jnp.zeros((rows, new), jnp.float32), stopped=jnp.zeros((rows,), bool),
            short=jnp.zeros((), bool), peak_pages=jnp.zeros((), jnp.int32))

    def _prefill(self, params: Any, frozen: Any, input_ids: Array, mask: Array) -> Prefill:
        """Left-padded prompts [B, P] through the contiguous-cache prefill (the static engine's): one prompt, or
        every prompt of a call whose prompts all fit in its first round (:meth:`_insert` takes one row of it)."""
        self.traces["prefill"] += 1
        model = self._model(params, frozen)
        b, p = input_ids.shape
        mask = mask.astype(jnp.int32)
        positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0).astype(jnp.int32)
        hidden, cache = model.forward_with_cache(input_ids, positions, model.init_prefill_cache(b, p), 0,
                                                 mask.astype(bool))
        return Prefill(cache, model.compute_logits(hidden[:, -1]))

    def _prefill_cache(self, params: Any, frozen: Any, *, width: int) -> Any:
        """The empty contiguous cache of batch 1 and ``width`` slots a chunked prefill writes into."""
        self.traces["prefill_cache"] += 1
        return self._model(params, frozen).init_prefill_cache(1, width)

    def _prefill_chunk(self, params: Any, frozen: Any, cache: Any, input_ids: Array, mask: Array,
                       start: Array) -> Prefill:
        """One chunk of a long prompt: ``input_ids`` [1, C], the tokens at slots ``[start, start + C)`` of the
        prompt left-padded to its bucket (``mask`` [1, P] marks its real tokens), written into ``cache`` over the
        slots before them; the logits are the chunk's last position's (the prompt's, after its last chunk).

        Why chunks: a prompt prefilled whole holds the device for its whole length while every live slot
        waits; in chunks, the host runs a decode call between two of them. One compile per (bucket, chunk)."""
        self.traces["prefill_chunk"] += 1
        model = self._model(params, frozen)
        c = input_ids.shape[1]
        mask = mask.astype(jnp.int32)
        positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0).astype(jnp.int32)
        positions = jax.lax.dynamic_slice_in_dim(positions, start, c, axis=1)
        hidden, cache = model.forward_with_cache(input_ids, positions, cache, start, mask.astype(bool))
        return Prefill(cache, model.compute_logits(hidden[:, -1]))

    def _gather(self, params: Any, frozen: Any, pools: Any, pages: Array, pad: Array, length: Array, *,
                width: int) -> Any:
        """The contiguous cache of batch 1 and ``width`` slots holding the first ``length`` tokens that ``pages``
        [max_pages] of ``pools`` (the engine's cache) hold, at slots ``pad ..`` (a context left-padded to ``width``),
        for :meth:`_prefill_chunk` to prefill a turn's new tokens over (``schedule.Schedule._resume``).

        Why the chunk program and not one program with the chunks in a loop: that one compiled in 3.1 CPU-s for
        SmolLM2-135M at width 128, against 1.7 for the chunk program and 0.4 for this gather (XLA's default level).
        Families with fixed-size layer state never come here (that state would have to be kept too)."""
        self.traces["gather"] += 1
        cache = self._model(params, frozen).init_prefill_cache(1, width)
        return _rebuild(pools, [gather_prefix(p, c, pages, pad, length) for p, c in _layer_pairs(pools, cache)])

    def _release(self, state: EngineState, pages: Array) -> EngineState:
        """``state`` after a row's kept ``pages`` [max_pages] (padded with out-of-range ids) lose its hold."""
        self.traces["release"] += 1
        return state._replace(counts=state.counts.at[pages].add(-1, mode="drop"))

    def _insert(self, state: EngineState, prefill: Prefill, index: Array, n: Array, slots: Array, rows: Array,
                first: Array, holders: Array, prompt_pages: Array, sampler: Sampler, *, new: int, greedy: bool,
                top_k: int | None, use_top_p: bool, page_size: int) -> tuple[EngineState, Array]:
        """Put one prompt's samples into ``slots`` [G] (``num_slots`` where none) as request ``rows`` [G]; the prompt
        is row ``index`` of ``prefill`` (0 for a prefill of one prompt).

        ``first``: the prompt's first insertion (its whole pages are taken and written now, held by the
        ``holders`` samples that will read them: G, or 1 for a preempted row prefilled again); later
        insertions reuse ``prompt_pages`` [P / page_size], which this returns."""
        self.traces["insert"] += 1
        prefill = _prefill_row(prefill, index)
        num_slots, max_pages = state.table.shape
        g = slots.shape[0]
        valid = slots < num_slots
        whole, partial = n // page_size, n % page_size
        j = jnp.arange(prompt_pages.shape[0])
        ids, counts, short_a = take_pages(state.counts, first & (j < whole), jnp.full(j.shape, holders))
        prompt_pages = jnp.where(first, ids, prompt_pages)
        own, counts, short_b = take_pages(counts, valid & (partial > 0), jnp.ones((g,), jnp.int32))
        # the prompt's whole pages (written at its first insertion only) and each sample's copy of its partial
        # last page, in one gather and one scatter per layer and pool
        dst = jnp.concatenate([jnp.where(first, ids, counts.shape[0]), own])
        src = jnp.concatenate([j, jnp.full((g,), whole)])
        layers = []
        for paged, contiguous in _layer_pairs(state.cache, prefill.cache):
            if isinstance(paged, PagedKVCache):
                paged = _fill_pages(paged, contiguous, dst, src, n)
            else:
                paged = jax.tree.map(lambda s, c: s.at[slots].set(jnp.broadcast_to(c, (g, *c.shape[1:])).astype(
                    s.dtype), mode="drop"), paged, contiguous)
            layers.append(paged)
        m = jnp.arange(max_pages)
        held = jnp.pad(prompt_pages, (0, max(max_pages - prompt_pages.shape[0], 0)))[:max_pages]
        table_rows = jnp.where(m[None, :] < whole, held[None, :], jnp.where(m[None, :] == whole, own[:, None], 0))
        first_tok, first_lp = pick_tokens(
            jnp.broadcast_to(prefill.logits, (g, prefill.logits.shape[-1])), sampler.keys(rows),
            jnp.int32(0), greedy=greedy, temperature=sampler.temperature, inv_temperature=sampler.inv_temperature,
            top_k=top_k, top_p=sampler.top_p if use_top_p else None)
        first_tok = jnp.where(valid, first_tok, sampler.fill)
        stop = jnp.any(first_tok[:, None] == sampler.stop_ids[None, :], axis=-1)
        done = stop | (sampler.limit(rows, new) <= 1)
        out_rows = jnp.where(valid, rows, state.out_ids.shape[0])
        blank = state._replace(out_ids=state.out_ids.at[out_rows].set(sampler.fill, mode="drop"),  # a row sampled again
                               out_mask=state.out_mask.at[out_rows].set(0, mode="drop"),
                               out_lp=state.out_lp.at[out_rows].set(0.0, mode="drop"))
        table = state.table.at[slots].set(table_rows, mode="drop")
        lengths = state.lengths.at[slots].set(n, mode="drop")
        stopping = jnp.zeros((num_slots,), bool).at[slots].set(valid & done & ~sampler.keeps(rows), mode="drop")
        state = state._replace(
            cache=_rebuild(state.cache, layers), counts=give_back(counts, table, lengths, stopping, page_size),
            table=table, lengths=lengths,
            tokens=state.tokens.at[slots].set(first_tok, mode="drop"),
            t=state.t.at[slots].set(1, mode="drop"), rows=state.rows.at[slots].set(out_rows, mode="drop"),
            active=state.active.at[slots].set(valid & ~done, mode="drop"),
            out_ids=blank.out_ids.at[out_rows, 0].set(first_tok, mode="drop"),
            out_mask=blank.out_mask.at[out_rows, 0].set(1, mode="drop"),
            out_lp=blank.out_lp.at[out_rows, 0].set(first_lp, mode="drop"),
            stopped=state.stopped.at[out_rows].set(stop, mode="drop"),
            short=state.short | short_a | short_b,
            peak_pages=jnp.maximum(state.peak_pages, jnp.sum(counts > 0)))
        return state, prompt_pages

    def _decode(self, params: Any, frozen: Any, state: EngineState, sampler: Sampler, waiting: Array, *,
                new: int, greedy: bool, top_k: int | None, use_top_p: bool, page_size: int,
                decode_steps: int) -> tuple[EngineState, Array]:
        """Up to ``decode_steps`` steps over every slot; stops early once a slot freed up while rows wait,
        when no slot is live, or before a step whose new pages the pool cannot give (the host then
        preempts a row: :meth:`_preempt`). Returns the state and its :func:`status` for the host."""
        self.traces["decode"] += 1
        model = self._model(params, frozen)
        num_slots = state.table.shape[0]
        num_rows = state.out_ids.shape[0]
        every = jnp.arange(num_slots)
        pick = functools.partial(pick_tokens, greedy=greedy, temperature=sampler.temperature,
                                 inv_temperature=sampler.inv_temperature, top_k=top_k,
                                 top_p=sampler.top_p if use_top_p else None)

        def cond(carry: tuple[Array, Array, EngineState]) -> Array:
            i, freed, s = carry
            return (i < decode_steps) & jnp.any(s.active) & ~(freed & waiting) & _fits(s, page_size)

        def body(carry: tuple[Array, Array, EngineState]) -> tuple[Array, Array, EngineState]:
            i, freed, s = carry
            page = jnp.minimum(s.lengths // page_size, s.table.shape[1] - 1)
            need = s.active & (s.lengths % page_size == 0)
            ids, counts, short = take_pages(s.counts, need, jnp.ones((num_slots,), jnp.int32))
            table = s.table.at[every, page].set(jnp.where(need, ids, s.table[every, page]))
            write_page = jnp.where(s.active, table[every, page], counts.shape[0])
            hidden, cache = model.forward_paged(s.tokens[:, None], s.cache, PageTable(table, s.lengths, write_page))
            tok, lp = pick(model.compute_logits(hidden[:, 0]), sampler.keys(s.rows), s.t)
            out_rows = jnp.where(s.active, s.rows, num_rows)
            stop = jnp.any(tok[:, None] == sampler.stop_ids[None, :], axis=-1)
            done = s.active & (stop | (s.t + 1 >= sampler.limit(s.rows, new)))
            lengths = s.lengths + s.active.astype(jnp.int32)
            counts_after = give_back(counts, table, lengths, done & ~sampler.keeps(s.rows), page_size)
            s = s._replace(
                cache=cache, counts=counts_after, table=table, lengths=lengths, tokens=tok,
                t=s.t + s.active.astype(jnp.int32), active=s.active & ~done,
                out_ids=s.out_ids.at[out_rows, s.t].set(tok, mode="drop"),
                out_mask=s.out_mask.at[out_rows, s.t].set(1, mode="drop"),
                out_lp=s.out_lp.at[out_rows, s.t].set(lp, mode="drop"),
                stopped=s.stopped.at[out_rows].set(stop, mode="drop"), short=s.short | short,
                peak_pages=jnp.maximum(s.peak_pages, jnp.sum(counts > 0)))
            return i + 1, freed | jnp.any(done), s

        _, _, state = jax.lax.while_loop(cond, body, (jnp.int32(0), jnp.zeros((), bool), state))
        return state, status(state, page_size)

    def _preempt(self, state: EngineState, slot: Array, fill: Array, *, page_size: int) -> EngineState:
        """``state`` without the row in ``slot``: its pages go back to the pool (a shared prompt page loses one
        holder) and its output row is blanked; the host queues the row again, and since every draw is keyed
        by (seed, step, row, position) its second run samples the tokens the first one had drawn."""
        self.traces["preempt"] += 1
        num_slots = state.table.shape[0]
        leaving = (jnp.arange(num_slots) == slot) & state.active
        row = jnp.where(leaving[slot], state.rows[slot], state.out_ids.shape[0])
        return state._replace(
            counts=give_back(state.counts, state.table, state.lengths, leaving, page_size),
            active=state.active & ~leaving, rows=jnp.where(leaving, state.out_ids.shape[0], state.rows),
            out_ids=state.out_ids.at[row].set(fill, mode="drop"), out_mask=state.out_mask.at[row].set(0, mode="drop"),
            out_lp=state.out_lp.at[row].set(0.0, mode="drop"), stopped=state.stopped.at[row].set(False, mode="drop"))


def _fits(state: EngineState, page_size: int) -> Array:
    """Whether the pool has a free page for every live slot whose next token starts a new page."""
    need = state.active & (state.lengths % page_size == 0)
    return jnp.sum(need) <= jnp.sum(state.counts == 0)


def status(state: EngineState, page_size: int) -> Array:
    """What the host reads after a decode call, in one small int32 array: per slot whether it is live
    [slots] and its request row [slots], then the free pages and whether the pool ran short of the next
    step's pages (1: a row must be preempted before decoding goes on)."""
    short = jnp.any(state.active) & ~_fits(state, page_size)
    return jnp.concatenate([state.active.astype(jnp.int32), state.rows,
                            jnp.stack([jnp.sum(state.counts == 0), short]).astype(jnp.int32)])
