"""The continuous engine's host loop: a queue of requests, the free slots and pages, one round at a time.

Why a class of its own rather than a loop inside ``generate``: the same scheduler serves two callers. A plain
rollout (:meth:`~scaletrain.generation.continuous.ContinuousBatchEngine.generate`) queues every prompt and runs
rounds until nothing is left. A multi-turn rollout (``rl/overlap.py``) keeps one schedule open for the whole
rollout: a row whose turn ends with a tool call leaves its slot, keeping its pages (``submit(..., keep=True)``),
and when its tools come back its next turn (the whole context, token in and token out) is queued here as a new
request while the other rows go on decoding, and prefilled over the kept pages (:mod:`kept_pages`); the caller
runs a round, reads which rows finished, and polls its tools in between.

A request is a prompt and the request rows (output rows) its samples write: G adjacent rows for a prompt's G
samples, or one row for a turn. Per row, the :class:`~scaletrain.generation.paged_programs.Sampler` may give the
seed and id its draws are keyed by and how many tokens it may sample; a row written again (its next turn) is
blanked by the insert. One round (:meth:`Schedule.advance`):

1. a long prompt at the head of the queue prefills one chunk;
2. queued requests go into free slots while their pages fit (a prompt prefilled once for its samples);
3. one decode call; the host reads the slots' status, records the pages of rows that stopped with ``keep``, gives
   kept pages back or else preempts the youngest row if the pool ran short (it is queued again and samples the
   same tokens), and reports the rows that finished.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import deque
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from scaletrain.generation.ahead import Ahead, paused_gc
from scaletrain.generation.buckets import left_pad, prompt_bucket
from scaletrain.generation.kept_pages import KeptPages, padded_pages, resume_chunks
from scaletrain.generation.paged_programs import EngineState, PagedPrograms, Sampler
from scaletrain.models.kernels.paged_attention import PagedKVCache

#: The chunk a resumed prefill (a turn over its row's kept pages) runs its new tokens in: a turn's new tokens are
#: typically a tool's output and a chat template's markers, tens of tokens; one compile per width (a 3/4 width's
#: chunk is the power of two that divides it, e.g. 16 for 48).
RESUME_CHUNK = 32


@dataclasses.dataclass
class _Entry:
    """A queued request: its prompt's index, the request rows still to sample from it (G, or one preempted row),
    how many of them sit in slots, once prefilled its :class:`Prefill` and the pages its whole pages took, and
    while a long prompt is prefilled in chunks the cache so far and the slot its next chunk starts at."""

    prompt: int
    rows: list[int]
    placed: int = 0
    prefill: Any = None
    prefill_row: int = 0  # its row of ``prefill`` (a call's first round may prefill all its prompts at once)
    held: Any = None
    chunk_cache: Any = None
    chunk_at: int = 0


class Schedule:
    """One open run of the continuous engine's programs (module docstring): ``rows`` request rows of at most
    ``new`` tokens each, over ``slots`` slots and ``num_pages`` pages of ``page_size`` tokens, a slot's table
    ``max_pages`` long; ``group``: the most rows one request has (the insert program's width); ``width``: the
    bucket of the run's longest prompt, which every prompt's prefill is padded to (:meth:`width`). ``stats``
    counts what ran (the engine's ``stats``). The decode program compiles on a thread
    (:class:`~scaletrain.generation.ahead.Ahead`) while the first prompts are prefilled."""

    def __init__(self, programs: PagedPrograms, params: Any, frozen: Any, sampler: Sampler, *, slots: int,
                 page_size: int, decode_steps: int, prefill_chunk: int, num_pages: int, max_pages: int, rows: int,
                 new: int, group: int, width: int, pad_id: int, flags: dict[str, Any], keep_pages: bool = False):
        self.programs, self.params, self.frozen, self.sampler = programs, params, frozen, sampler
        self.slots, self.page_size, self.decode_steps, self.prefill_chunk = slots, page_size, decode_steps, \
            prefill_chunk
        self.num_pages, self.rows, self.group, self.pad_id, self.flags = num_pages, rows, group, pad_id, flags
        self.longest = width
        self.row_seeds = np.full((rows,), int(sampler.seed), np.uint32)  # each request row's key and cap (Sampler)
        self.row_ids = np.arange(rows, dtype=np.int32)
        self.row_limits = np.full((rows,), new, np.int32)
        self.row_keep = np.zeros((rows,), bool)
        self._keyed = False  # whether the sampler holds the arrays above as they are
        self.sampler = self._keyed_sampler(sampler)
        self.es: EngineState = programs.init(params, frozen, sampler.fill, slots=slots, num_pages=num_pages,
                                             page_size=page_size, max_pages=max_pages, rows=rows, new=new)
        # decode compiles on a thread while the first prompts are prefilled and inserted (a no-op once compiled)
        self._ahead: Ahead | None = Ahead(programs.decode, params, frozen, self.es, self.sampler, jnp.asarray(True),
                                          **flags, decode_steps=decode_steps)
        self._insert_ahead: Ahead | None = None  # the insert program's compile, started by the first prefill
        self.all_submitted = False  # set by a caller that queued every request before the first round (generate)
        self.prompts: list[list[int]] = []
        self.prompt_of: dict[int, int] = {}  # request row -> the prompt it samples now
        self.waiting: deque[_Entry] = deque()
        self.in_slot: dict[int, int] = {}  # slot -> request row, as the host last placed or read it
        self.free, self.live, self.free_pages = list(range(slots)), 0, num_pages
        self.max_pages, self.kept = max_pages, KeptPages()
        layers = [self.es.cache] if isinstance(self.es.cache, PagedKVCache) else self.es.cache
        self.keeping = keep_pages and all(isinstance(c, PagedKVCache) for c in layers)  # no per-slot state to keep
        self.stats = dict(prefills=0, prefill_chunks=0, decode_calls=0, decodes_between_chunks=0, preemptions=0,
                          prefills_resumed=0, kept_prefix_tokens=0, kept_dropped=0)

    @property
    def busy(self) -> bool:
        """Whether a request waits or a row decodes."""
        return bool(self.waiting) or self.live > 0

    def submit(self, prompt: Sequence[int], rows: Sequence[int], *, seed: int | None = None,
               limit: int | None = None, keep: bool = False) -> None:
        """Queue ``prompt`` for request ``rows`` (its samples, at most ``group``; prefilled once for all of them);
        their draws keyed by ``seed`` (default the run's) and their ids (:attr:`row_ids`), at most ``limit``
        tokens each (default ``new``). ``keep``: the rows will continue (a multi-turn row's next turn), so they
        keep their pages when they stop, for a next turn that starts with their tokens (:mod:`kept_pages`;
        ignored where the engine does not keep pages). Call :meth:`forget` for a kept row that will not continue."""
        if not 0 < len(rows) <= self.group:
            raise ValueError(f"a request has 1 to {self.group} rows, got {len(rows)}")
        index = np.asarray(rows, np.int64)
        if seed is not None:
            self.row_seeds[index] = np.uint32(seed)
        if limit is not None:
            self.row_limits[index] = int(limit)
        self.row_keep[index] = keep and self.keeping
        self._keyed = False
        self.prompts.append([int(t) for t in prompt])
        for r in rows:
            self.prompt_of[int(r)] = len(self.prompts) - 1
        self.waiting.append(_Entry(len(self.prompts) - 1, [int(r) for r in rows]))

    def advance(self) -> list[int]:
        """One round (module docstring); the request rows that finished in it."""
        stats = self.stats
        if not self._keyed:
            self.sampler, self._keyed = self._keyed_sampler(self.sampler), True
        head = self.waiting[0] if self.waiting else None
        if head is not None and head.prefill is None:
            self._resume(head)  # a turn over its row's kept pages: prefilled now (not chunk by chunk), pages given back
        if head is not None and head.prefill is None and self._bucket(head.prompt) > self.prefill_chunk:
            self._prefill_chunk(head)  # one chunk per round
            stats["prefill_chunks"] += 1
            stats["prefills"] += head.prefill is not None
        with paused_gc() if self._ahead is not None else contextlib.nullcontext():  # a first round traces its programs
            self._place(self._plan())
        if self._ahead is not None:
            self._ahead.wait()
            self._ahead = None
        self.es, status = self.programs.decode(self.params, self.frozen, self.es, self.sampler,
                                               jnp.asarray(bool(self.waiting)), **self.flags,
                                               decode_steps=self.decode_steps)
        stats["decode_calls"] += 1
        stats["decodes_between_chunks"] += bool(self.waiting) and self.waiting[0].chunk_cache is not None
        status = np.array(status)
        active, slot_rows, (self.free_pages, short) = (status[:self.slots], status[self.slots:2 * self.slots],
                                                       status[-2:])
        if self.keeping:
            self._keep_finished(active)
        if short and len(self.kept):  # kept pages go back first; decoding goes on next round
            while self.free_pages < int(active.sum()) and self._drop_kept():
                pass
        elif short:  # the pool cannot give the next step's pages: the youngest row leaves and waits again
            victim = int(np.argmax(np.where(active > 0, slot_rows, -1)))
            self.es = self.programs.preempt(self.es, jnp.int32(victim), self.sampler.fill, page_size=self.page_size)
            row = int(slot_rows[victim])
            self.waiting.appendleft(_Entry(self.prompt_of[row], [row]))
            stats["preemptions"] += 1
            active[victim] = 0
            del self.in_slot[victim]
            self.free_pages = int(jnp.sum(self.es.counts == 0))
        finished = [row for slot, row in self.in_slot.items() if not active[slot]]
        self.in_slot = {slot: row for slot, row in self.in_slot.items() if active[slot]}
        self.free = [s for s in range(self.slots) if not active[s]]
        self.live = int(active.sum())
        return sorted(finished)

    def _plan(self) -> list[tuple[_Entry, int]]:
        """The queued requests that go into free slots this round, in queue order, and how many of each one's rows:
        while slots are free and their pages fit, keeping a page for each live slot's next page boundary so insertion
        does not starve them; it stops at a long prompt still being prefilled chunk by chunk."""
        plan: list[tuple[_Entry, int]] = []
        free, used, live = len(self.free), 0, self.live  # used: the pages the planned insertions take
        for entry in self.waiting:
            if not free:
                break
            if entry.prefill is None:
                self._resume(entry)  # a turn over its row's kept pages: prefilled now, those pages given back
            left = len(entry.rows) - entry.placed

            def fits() -> int:
                take = min(left, free)
                while take and self._pages_taken(entry, take) > self.free_pages - used - live:
                    take -= 1
                return take

            take = fits()
            while not take and self._drop_kept(frozenset(entry.rows)):  # kept pages go before any live row's
                take = fits()
            if not take or (entry.prefill is None and self._bucket(entry.prompt) > self.prefill_chunk):
                break
            plan.append((entry, take))
            free, live, used = free - take, live + take, used + self._pages_taken(entry, take)
            if take < left:
                break
        return plan

    def _place(self, plan: list[tuple[_Entry, int]]) -> None:
        """Prefill the planned requests that are not yet (each prompt once, whatever its G), then insert their rows.

        Why every prefill before the first insert: on a run's first round the insert program compiles on a thread
        (:class:`~scaletrain.generation.ahead.Ahead`, from the first prefill's shapes) while the other prompts are
        prefilled, rather than between them."""
        self._prefill_together(plan)
        for entry, _ in plan:
            if entry.prefill is None:
                p_ids, p_mask = left_pad([self.prompts[entry.prompt]], self.pad_id, self._bucket(entry.prompt))
                entry.prefill = self.programs.prefill(self.params, self.frozen, p_ids, p_mask)
                self.stats["prefills"] += 1
            if entry.held is None:
                entry.held = jnp.zeros((self._bucket(entry.prompt) // self.page_size,), jnp.int32)
            if self._insert_ahead is None:  # the first insert's shapes are known now: compile it beside the prefills
                self._insert_ahead = Ahead(self.programs.insert, *self._insert_args(entry, 1),
                                           **self.flags)
        for entry, take in plan:
            self._insert_ahead.wait()
            self.es, entry.held = self.programs.insert(*self._insert_args(entry, take), **self.flags)
            self.in_slot.update(zip(self.free[:take], entry.rows[entry.placed:entry.placed + take]))
            self.free, self.live = self.free[take:], self.live + take
            self.free_pages -= self._pages_taken(entry, take)
            entry.placed += take
            if entry.placed == len(entry.rows):
                self.waiting.popleft()

    def _prefill_together(self, plan: list[tuple[_Entry, int]]) -> None:
        """Prefill every prompt of ``plan`` in one batch, where it places every request of a call that is all
        queued (:attr:`all_submitted`) in its first round: a call whose prompts all fit in its slots (G = 1 and few
        prompts) then reads the weights once for them, not once a prompt, as the static engine does.

        Why only then: a later round places the one or two prompts whose slots just freed, and a batch of another
        size is another program to compile; a call that fits in one round has no later round."""
        if not (self.all_submitted and self.stats["prefills"] == 0 and len(plan) > 1
                and len(plan) == len(self.waiting) and all(take == len(e.rows) for e, take in plan)):
            return
        widths = {self._bucket(e.prompt) for e, _ in plan}
        if len(widths) > 1 or max(widths) > self.prefill_chunk or any(e.prefill is not None for e, _ in plan):
            return
        p_ids, p_mask = left_pad([self.prompts[e.prompt] for e, _ in plan], self.pad_id, widths.pop())
        together = self.programs.prefill(self.params, self.frozen, p_ids, p_mask)
        for i, (entry, _) in enumerate(plan):
            entry.prefill, entry.prefill_row = together, i
        self.stats["prefills"] += len(plan)

    def _pages_taken(self, entry: _Entry, take: int) -> int:
        """The free pages placing ``take`` more of ``entry``'s rows takes: the prompt's whole pages at its first
        placement (shared by all its rows), and a copy of its partial last page per row."""
        whole, partial = divmod(len(self.prompts[entry.prompt]), self.page_size)
        return whole * (not entry.placed) + take * (partial > 0)

    def _insert_args(self, entry: _Entry, take: int) -> tuple[Any, ...]:
        """The insert program's operands placing ``take`` more of ``entry``'s rows into the first free slots."""
        g = self.group
        slots = np.full((g,), self.slots, np.int32)
        slots[:take] = self.free[:take]
        row_ids = np.full((g,), self.rows, np.int32)
        row_ids[:take] = entry.rows[entry.placed:entry.placed + take]
        return (self.es, entry.prefill, jnp.int32(entry.prefill_row), jnp.int32(len(self.prompts[entry.prompt])),
                slots, row_ids, jnp.asarray(not entry.placed), jnp.int32(len(entry.rows)), entry.held, self.sampler)

    def finish(self) -> dict[str, int]:
        """The run's ``stats`` with its pages (peak, still held, the pool's), after every kept page went back;
        RuntimeError if the pool ran out inside a step (an engine bug)."""
        for row in list(self.kept.rows):
            self.forget(row)
        if bool(self.es.short):
            raise RuntimeError(f"the paged cache ran out of its {self.num_pages} pages inside a step (an engine bug: "
                               "insertion checks the free pages and decoding preempts before a step that would)")
        return dict(self.stats, peak_pages=int(self.es.peak_pages), pages_in_use=int(jnp.sum(self.es.counts > 0)),
                    num_pages=self.num_pages)

    def forget(self, row: int) -> None:
        """Give row ``row``'s kept pages back to the pool (it will not continue; a no-op if it keeps none)."""
        kept = self.kept.pop(row)
        if kept is not None:
            self.es = self.programs.release(self.es, padded_pages(kept.pages, self.max_pages, self.num_pages))
            self.free_pages = int(jnp.sum(self.es.counts == 0))

    def _drop_kept(self, spare: frozenset[int] = frozenset()) -> bool:
        """Give back the oldest kept pages of a row not in ``spare`` (it will be prefilled whole); whether any."""
        row = self.kept.oldest(spare)
        if row is None:
            return False
        self.forget(row)
        self.stats["kept_dropped"] += 1
        return True

    def _keep_finished(self, active: np.ndarray) -> None:
        """Record the kept pages of the rows that stopped this round with ``row_keep``: their slot's table row up to
        its cache length, over the request's prompt and the completion less its last (never fed) token."""
        stopped = [(slot, row) for slot, row in self.in_slot.items() if not active[slot] and self.row_keep[row]]
        if not stopped:
            return
        slots = jnp.asarray([slot for slot, _ in stopped], jnp.int32)
        tables, lengths = jax.device_get((self.es.table[slots], self.es.lengths[slots]))
        for (_, row), table, length, (ids, _) in zip(stopped, tables, lengths, self.read([r for _, r in stopped])):
            tokens = self.prompts[self.prompt_of[row]] + ids[:-1]
            pages = table[:-(-int(length) // self.page_size)]
            self.forget(row)  # never expected (its next turn took them): no page is ever lost by an overwrite
            self.kept.record(row, pages, tokens)
            if len(tokens) != int(length):  # never expected: give the pages back rather than trust them
                self.forget(row)

    def _resume(self, entry: _Entry) -> None:
        """Prefill ``entry`` (one row's next turn) over its row's kept pages when its context starts with their
        tokens, and the chunks would not cover the whole context: gathered into the contiguous cache
        (:meth:`~scaletrain.generation.paged_programs.PagedPrograms.gather`), the new tokens prefilled over them by
        the chunk program in ``RESUME_CHUNK``-token chunks that end at the last slot; then those pages go back (the
        insert writes the context's pages afresh). Kept pages its context does not start with go back unused."""
        if len(entry.rows) != 1 or entry.rows[0] not in self.kept.rows:
            return
        row, prompt = entry.rows[0], self.prompts[entry.prompt]
        kept = self.kept.rows[row]
        width = self._bucket(entry.prompt)
        chunk = min(RESUME_CHUNK, self.prefill_chunk, width & -width)  # a power of two that divides the width
        start, _ = resume_chunks(width, len(prompt), len(kept.tokens), chunk)
        pad = width - len(prompt)
        if kept.prefix_of(prompt) and start > pad:  # else the chunks would cover the whole context: prefill it whole
            ids, mask = left_pad([prompt], self.pad_id, width)
            cache = self.programs.gather(self.params, self.frozen, self.es.cache,
                                         padded_pages(kept.pages, self.max_pages, self.num_pages), jnp.int32(pad),
                                         jnp.int32(len(kept.tokens)), width=width)
            for at in range(start, width, chunk):
                entry.prefill = self.programs.prefill_chunk(self.params, self.frozen, cache, ids[:, at:at + chunk],
                                                            mask, jnp.int32(at))
                cache = entry.prefill.cache
            self.stats["prefills_resumed"] += 1
            self.stats["kept_prefix_tokens"] += max(0, start - pad)
        self.forget(row)

    def _keyed_sampler(self, sampler: Sampler) -> Sampler:
        """``sampler`` with the per-row arrays as the host holds them now."""
        return sampler._replace(row_seeds=jnp.asarray(self.row_seeds), row_ids=jnp.asarray(self.row_ids),
                                row_limits=jnp.asarray(self.row_limits), row_keep=jnp.asarray(self.row_keep))

    def read(self, rows: Sequence[int]) -> list[tuple[list[int], list[float]]]:
        """Request ``rows``' sampled ids and log-probabilities, read to the host."""
        index = jnp.asarray(np.asarray(rows, np.int32))
        ids, mask, lps = (np.asarray(jax.device_get(x[index])) for x in (self.es.out_ids, self.es.out_mask,
                                                                           self.es.out_lp))
        lengths = mask.sum(axis=1)
        return [([int(t) for t in ids[i, :n]], [float(x) for x in lps[i, :n]]) for i, n in enumerate(lengths)]

    def _bucket(self, prompt: int) -> int:
        """The width prompt ``prompt`` is left-padded to for its prefill: one width for every prompt of a run, its
        longest prompt's bucket (:func:`~scaletrain.generation.buckets.prompt_bucket`), capped at ``prefill_chunk`` for a prompt
        that fits in one chunk; a longer one is prefilled in chunks at that width. A prompt longer than the run's
        longest (a multi-turn row's next turn) takes its own bucket.

        Why one width per run and not each prompt's own bucket: the prefill and insert programs compile once per
        width (each ~1-3 CPU-s for SmolLM2-135M). The padding is masked out of attention and positions, so a row's
        tokens do not change; its log-probs may in the last bits."""
        own = prompt_bucket(len(self.prompts[prompt]), self.page_size, self.prefill_chunk)
        if own > self.longest:
            return own
        return self.longest if own > self.prefill_chunk else min(self.longest, self.prefill_chunk)

    def _prefill_chunk(self, entry: _Entry) -> None:
        """Prefill ``entry``'s next ``prefill_chunk`` tokens; its :class:`Prefill` is set after the last one.
        Chunks of left padding alone are skipped (their slots stay masked out)."""
        size, prompt = self.prefill_chunk, self.prompts[entry.prompt]
        ids, mask = left_pad([prompt], self.pad_id, self._bucket(entry.prompt))
        if entry.chunk_cache is None:
            entry.chunk_cache = self.programs.prefill_cache(self.params, self.frozen, width=ids.shape[1])
            entry.chunk_at = (ids.shape[1] - len(prompt)) // size * size
        at = entry.chunk_at
        out = self.programs.prefill_chunk(self.params, self.frozen, entry.chunk_cache, ids[:, at:at + size], mask,
                                          jnp.int32(at))
        entry.chunk_at += size
        if entry.chunk_at >= ids.shape[1]:
            entry.prefill, entry.chunk_cache = out, None
        else:
            entry.chunk_cache = out.cache
