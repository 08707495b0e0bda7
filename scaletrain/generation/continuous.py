"""Continuous batching: a fixed number of decode slots over a paged cache, refilled as rows stop.

Why: a static batch keeps every row's slot and cache until its longest row stops, so on
long-tailed completions (RL's usual case) most of the decode work is spent on finished rows.
Here rows wait in a queue; a slot whose row stops gives its pages back and takes the next
waiting row, so the slots stay full until the work runs out. How a request flows:

1. **queue**: prompts in request order, each with its G samples (rows ``i * G .. i * G + G - 1``).
2. **prefill**: when a slot and its pages are free, the next prompt is prefilled once, whatever its G,
   left-padded to the call's width (its longest prompt's bucket: one program for every prompt of the
   call); a prompt longer than ``prefill_chunk`` is prefilled one chunk per host turn, with a decode
   call between two chunks.
3. **slot + pages**: its samples go into free slots; they share the prompt's whole pages and
   each gets its own copy of the last, partial one (:mod:`~scaletrain.generation.paged_programs`).
4. **decode**: one program runs up to ``decode_steps`` steps for every slot on the device, and
   returns early only when a slot freed up and rows wait, or before a step the page pool cannot
   give pages for; the host reads which slots are live (one small array), preempts the youngest
   row if the pool ran short, and refills.
5. **done**: a row's tokens and log-probabilities are written at its request row as they are
   drawn, so the result comes back in request order, as :class:`~scaletrain.generation.engine.Rollout`.

What is compiled: ``init`` and ``decode`` once per (slots, pages, rows bucket,
``max_completion_length``, sampling flags), ``prefill`` and ``insert`` once per call width,
``prefill_cache`` and ``prefill_chunk`` once per width longer than a chunk, ``preempt`` once. The
decode program compiles on a thread (:class:`~scaletrain.generation.ahead.Ahead`) while the first
prompts are prefilled, so a first call waits for the longer of the two, not their sum.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from scaletrain.compile_cache import ProgramCache, model_key
from scaletrain.generation.ahead import Ahead
from scaletrain.generation.buckets import MIN_PROMPT_BUCKET, bucket, left_pad, round_up_pow2
from scaletrain.generation.engine import Rollout, SamplingParams, _mesh_of, split_source
from scaletrain.generation.page_pool import pool_pages
from scaletrain.generation.paged_programs import EngineState, PagedPrograms, Sampler
from scaletrain.generation.sampling import inverse_temperature
from scaletrain.peft.lora import join_trainable

_PROGRAMS: ProgramCache[PagedPrograms] = ProgramCache(8)


def programs_for(graphdef: Any, params: Any, frozen: Any = None) -> PagedPrograms:
    """The compiled programs of ``graphdef``'s model, shared by every graph equal to it (:func:`model_key`)."""
    return _PROGRAMS.get(model_key(join_trainable(graphdef, params, frozen)), lambda: PagedPrograms(graphdef))


@dataclasses.dataclass
class ContinuousBatchEngine:
    """A :class:`~scaletrain.generation.interface.RolloutEngine` with ``slots`` decode slots over a paged
    cache of ``page_size``-token pages (see the module docstring).

    ``decode_steps``: the most decode steps one program runs before the host looks again (it
    returns earlier when a slot frees up while rows wait). ``share_prefix`` False prefills every
    sample on its own (what the shared prefill is measured against). The page pool holds
    ``cache_pages`` pages, or ``cache_fraction`` of every slot at its longest
    (:func:`~scaletrain.generation.page_pool.pool_pages`); when it runs short the youngest row is
    preempted and sampled again later, to the same tokens. A prompt whose bucket is longer than
    ``prefill_chunk`` tokens is prefilled in chunks of that many, one chunk between two decode calls, so
    the live slots keep decoding meanwhile. ``stats`` after a call: ``prefills`` (prompt prefills run),
    ``prefill_chunks`` (chunks of long prompts), ``decode_calls``, ``decodes_between_chunks`` (decode calls
    run while a long prompt was part-way prefilled), ``preemptions``, ``peak_pages`` and
    ``pages_in_use`` (held after the call: 0 when every page came back), ``num_pages``.
    """

    sampling: SamplingParams
    slots: int = 16
    page_size: int = 16
    decode_steps: int = 32
    share_prefix: bool = True
    cache_pages: int | None = None
    cache_fraction: float = 0.75
    prefill_chunk: int = 256
    stats: dict[str, int] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 < self.cache_fraction <= 1:
            raise ValueError(f"cache_fraction must be in (0, 1], got {self.cache_fraction}")
        for name in ("slots", "page_size", "decode_steps", "prefill_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("page_size", "prefill_chunk"):
            if getattr(self, name) & (getattr(self, name) - 1):
                raise ValueError(f"{name} must be a power of two, got {getattr(self, name)}")

    def generate(self, state: Any, prompts: Sequence[Sequence[int]], *, num_generations: int = 1, seed: int = 0,
                 step: int = 0) -> Rollout:
        """``num_generations`` completions of each prompt, sampled from ``state``'s live parameters."""
        graphdef, params, frozen = split_source(state)
        prompts = [[int(t) for t in p] for p in prompts]
        mesh = _mesh_of(params)
        if mesh is None or not jax.sharding.get_abstract_mesh().empty:
            return self._run(graphdef, params, frozen, prompts, num_generations, seed, step)
        with jax.set_mesh(mesh):
            return self._run(graphdef, params, frozen, prompts, num_generations, seed, step)

    def _run(self, graphdef: Any, params: Any, frozen: Any, prompts: list[list[int]], g: int, seed: int,
             step: int) -> Rollout:
        programs = programs_for(graphdef, params, frozen)
        sampling = self.sampling
        if not self.share_prefix:  # every sample its own prompt: the same rows, prefilled G times
            prompts, g = [p for p in prompts for _ in range(g)], 1
        ids, mask = left_pad(prompts)
        layout = bucket(ids, mask, g, sampling.pad_token_id)
        rows = layout.rows
        longest = round_up_pow2(max(len(p) for p in prompts), max(MIN_PROMPT_BUCKET, self.page_size))
        width = lambda prompt: self._width(prompt, longest)  # noqa: E731
        new = int(sampling.max_completion_length)
        max_pages = -(-(longest + new) // self.page_size)
        num_pages = pool_pages(self.slots, max_pages, self.cache_pages, self.cache_fraction)
        flags = dict(new=new, greedy=sampling.greedy, page_size=self.page_size,
                     top_k=None if sampling.greedy or sampling.top_k is None else int(sampling.top_k),
                     use_top_p=not sampling.greedy and sampling.top_p is not None)
        sampler = Sampler(jnp.asarray(seed, jnp.uint32), jnp.asarray(step, jnp.int32),
                          jnp.float32(1.0 if sampling.greedy else sampling.temperature),
                          jnp.asarray(inverse_temperature(sampling.temperature)),
                          jnp.float32(1.0 if sampling.top_p is None else sampling.top_p),
                          jnp.asarray(np.asarray(sampling.stop_token_ids, np.int32).reshape(-1)),
                          jnp.int32(sampling.pad_token_id))
        rows_bucket = round_up_pow2(rows)
        es: EngineState = programs.init(params, frozen, jnp.int32(sampling.pad_token_id), slots=self.slots,
                                        num_pages=num_pages, page_size=self.page_size, max_pages=max_pages,
                                        rows=rows_bucket, new=new)
        # decode compiles on a thread while the first prompts are prefilled and inserted (a no-op once compiled)
        ahead: Ahead | None = Ahead(programs.decode, params, frozen, es, sampler, jnp.asarray(True), **flags,
                                    decode_steps=self.decode_steps)
        waiting = deque(_Entry(i, list(range(i * g, i * g + g))) for i in range(len(prompts)))
        free, live, free_pages = list(range(self.slots)), 0, num_pages
        prefills = decode_calls = preemptions = chunks = between_chunks = 0
        while True:
            head = waiting[0] if waiting else None
            if head is not None and head.prefill is None and width(prompts[head.prompt]) > self.prefill_chunk:
                self._prefill_chunk(programs, params, frozen, head, prompts[head.prompt], longest)  # one chunk per turn
                chunks += 1
                prefills += head.prefill is not None
            while waiting and free:
                entry = waiting[0]
                n = len(prompts[entry.prompt])
                whole, partial = divmod(n, self.page_size)
                first = not entry.placed
                take = min(len(entry.rows) - entry.placed, len(free))
                reserve = live  # a page for each live slot's next page boundary, so insertion does not starve them
                while take and (whole * first + take * (partial > 0)) > free_pages - reserve:
                    take -= 1
                if not take:
                    break
                if entry.prefill is None:
                    if width(prompts[entry.prompt]) > self.prefill_chunk:
                        break  # a long prompt still being prefilled, chunk by chunk
                    p_ids, p_mask = left_pad([prompts[entry.prompt]], sampling.pad_token_id,
                                             width(prompts[entry.prompt]))
                    entry.prefill = programs.prefill(params, frozen, p_ids, p_mask)
                    prefills += 1
                if entry.held is None:
                    entry.held = jnp.zeros((width(prompts[entry.prompt]) // self.page_size,), jnp.int32)
                slots = np.full((g,), self.slots, np.int32)
                slots[:take] = free[:take]
                row_ids = np.full((g,), rows_bucket, np.int32)
                row_ids[:take] = entry.rows[entry.placed:entry.placed + take]
                es, entry.held = programs.insert(es, entry.prefill, jnp.int32(n), slots, row_ids, jnp.asarray(first),
                                                 jnp.int32(len(entry.rows)), entry.held, sampler, **flags)
                free, live = free[take:], live + take
                free_pages -= whole * first + take * (partial > 0)
                entry.placed += take
                if entry.placed == len(entry.rows):
                    waiting.popleft()
            if ahead is not None:
                ahead.wait()
                ahead = None
            es, status = programs.decode(params, frozen, es, sampler, jnp.asarray(bool(waiting)), **flags,
                                         decode_steps=self.decode_steps)
            decode_calls += 1
            between_chunks += bool(waiting) and waiting[0].chunk_cache is not None
            status = np.array(status)
            active, slot_rows, (free_pages, short) = status[:self.slots], status[self.slots:2 * self.slots], status[-2:]
            if short:  # the pool cannot give the next step's pages: the youngest row leaves and waits again
                victim = int(np.argmax(np.where(active > 0, slot_rows, -1)))
                es = programs.preempt(es, jnp.int32(victim), sampler.fill, page_size=self.page_size)
                waiting.appendleft(_Entry(int(slot_rows[victim]) // g, [int(slot_rows[victim])]))
                preemptions += 1
                active[victim] = 0
                free_pages = int(jnp.sum(es.counts == 0))
            free = [s for s in range(self.slots) if not active[s]]
            live = int(active.sum())
            if not waiting and not live:
                break
        if bool(es.short):
            raise RuntimeError(f"the paged cache ran out of its {num_pages} pages inside a step (an engine bug: "
                               "insertion checks the free pages and decoding preempts before a step that would)")
        self.stats = dict(prefills=prefills, prefill_chunks=chunks, decode_calls=decode_calls,
                          decodes_between_chunks=between_chunks, preemptions=preemptions,
                          peak_pages=int(es.peak_pages), pages_in_use=int(jnp.sum(es.counts > 0)),
                          num_pages=num_pages)
        lengths = jnp.sum(es.out_mask[:rows], axis=1)
        return Rollout(jnp.asarray(layout.input_ids[:rows]), jnp.asarray(layout.attention_mask[:rows]),
                       es.out_ids[:rows], es.out_mask[:rows], es.out_lp[:rows], lengths, ~es.stopped[:rows],
                       jnp.max(lengths))

    def _width(self, prompt: list[int], longest: int) -> int:
        """The width ``prompt`` is left-padded to for its prefill: one width for every prompt of a call, the
        call's ``longest`` bucket (a power of two, at least 16 and one page), capped at ``prefill_chunk`` for a
        prompt that fits in one chunk; a longer one is prefilled in chunks at ``longest``.

        Why one width per call and not each prompt's own bucket: the prefill and insert programs compile once
        per width (each ~1-3 CPU-s for SmolLM2-135M), and most of a first call's wait was compiling them for
        every bucket its prompts fell in (three for prompts of 8-40 tokens). The padding is masked out of
        attention and positions, so a row's tokens do not change; its log-probs may in the last bits."""
        own = round_up_pow2(len(prompt), max(MIN_PROMPT_BUCKET, self.page_size))
        return longest if own > self.prefill_chunk else min(longest, self.prefill_chunk)

    def _prefill_chunk(self, programs: PagedPrograms, params: Any, frozen: Any, entry: _Entry,
                       prompt: list[int], longest: int) -> None:
        """Prefill ``entry``'s next ``prefill_chunk`` tokens; its :class:`Prefill` is set after the last one.
        Chunks of left padding alone are skipped (their slots stay masked out)."""
        size = self.prefill_chunk
        ids, mask = left_pad([prompt], self.sampling.pad_token_id, self._width(prompt, longest))
        if entry.chunk_cache is None:
            entry.chunk_cache = programs.prefill_cache(params, frozen, width=ids.shape[1])
            entry.chunk_at = (ids.shape[1] - len(prompt)) // size * size
        at = entry.chunk_at
        out = programs.prefill_chunk(params, frozen, entry.chunk_cache, ids[:, at:at + size], mask, jnp.int32(at))
        entry.chunk_at += size
        if entry.chunk_at >= ids.shape[1]:
            entry.prefill, entry.chunk_cache = out, None
        else:
            entry.chunk_cache = out.cache


@dataclasses.dataclass
class _Entry:
    """A queued prompt: its index, the request rows still to sample from it (G, or one preempted row), how
    many of them sit in slots, once prefilled its :class:`Prefill` and the pages its whole pages took, and
    while a long prompt is prefilled in chunks the cache so far and the slot its next chunk starts at."""

    prompt: int
    rows: list[int]
    placed: int = 0
    prefill: Any = None
    held: Any = None
    chunk_cache: Any = None
    chunk_at: int = 0
