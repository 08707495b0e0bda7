"""Continuous batching: a fixed number of decode slots over a paged cache, refilled as rows stop.

Why: a static batch keeps every row's slot and cache until its longest row stops, so on
long-tailed completions (RL's usual case) most of the decode work is spent on finished rows.
Here rows wait in a queue; a slot whose row stops gives its pages back and takes the next
waiting row, so the slots stay full until the work runs out. How a request flows:

1. **queue**: prompts in request order, each with its G samples (rows ``i * G .. i * G + G - 1``).
2. **prefill**: when a slot and its pages are free, the next prompt is prefilled once, whatever its G (every
   prompt at once, in one batch, when all of a call's rows fit in its first round),
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
``prefill_cache`` and ``prefill_chunk`` once per width longer than a chunk, ``preempt`` once; for multi-turn rows
that keep their pages (``keep_pages``), ``gather`` and a chunk-sized ``prefill_chunk`` once per width and
``release`` once. The decode and insert programs compile on threads (:class:`~scaletrain.generation.ahead.Ahead`)
while the first prompts are prefilled, so a first call waits for the longest of them, not their sum.

The host loop of steps 1-5 is :class:`~scaletrain.generation.schedule.Schedule`; ``generate`` queues every
prompt and runs it to the end, and :meth:`ContinuousBatchEngine.session` keeps one open while a caller feeds it
requests (a multi-turn rollout: a row's next turn queued when its tools come back).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from scaletrain.compile_cache import ProgramCache, model_key
from scaletrain.generation.buckets import bucket, left_pad, prompt_bucket, round_up_pow2
from scaletrain.generation.engine import Rollout, SamplingParams, _mesh_of, split_source
from scaletrain.generation.page_pool import pool_pages
from scaletrain.generation.paged_programs import PagedPrograms, Sampler
from scaletrain.generation.schedule import Schedule
from scaletrain.generation.sampling import inverse_temperature
from scaletrain.peft.lora import join_trainable

_PROGRAMS: ProgramCache[PagedPrograms] = ProgramCache(8)


def programs_for(graphdef: Any, params: Any, frozen: Any = None) -> PagedPrograms:
    """The compiled programs of ``graphdef``'s model, shared by every graph equal to it (:func:`model_key`)."""
    return _PROGRAMS.get(model_key(join_trainable(graphdef, params, frozen)), lambda: PagedPrograms(graphdef))


@functools.partial(jax.jit, static_argnames=("rows",))
def _outputs(out_ids: jax.Array, out_mask: jax.Array, out_lp: jax.Array, stopped: jax.Array, *,
             rows: int) -> tuple[jax.Array, ...]:
    """The first ``rows`` request rows' completion ids, mask, log-probs, lengths, whether each was cut at the cap, and
    the longest length: one program rather than seven eager ops (each compiled on a first call)."""
    lengths = jnp.sum(out_mask[:rows], axis=1)
    return out_ids[:rows], out_mask[:rows], out_lp[:rows], lengths, ~stopped[:rows], jnp.max(lengths)


@dataclasses.dataclass
class ContinuousBatchEngine:
    """A :class:`~scaletrain.generation.interface.RolloutEngine` with ``slots`` decode slots over a paged
    cache of ``page_size``-token pages (see the module docstring).

    ``decode_steps``: the most decode steps one program runs before the host looks again (it
    returns earlier when a slot frees up while rows wait). ``share_prefix`` False prefills every
    sample on its own (what the shared prefill is measured against). The page pool holds
    ``cache_pages`` pages, or ``cache_fraction`` of every slot at its longest (counted at the power-of-two width)
    (:func:`~scaletrain.generation.page_pool.pool_pages`); when it runs short the youngest row is
    preempted and sampled again later, to the same tokens. A prompt whose bucket is longer than
    ``prefill_chunk`` tokens is prefilled in chunks of that many, one chunk between two decode calls, so
    the live slots keep decoding meanwhile. ``stats`` after a call: ``prefills`` (prompt prefills run),
    ``prefill_chunks`` (chunks of long prompts), ``decode_calls``, ``decodes_between_chunks`` (decode calls
    run while a long prompt was part-way prefilled), ``preemptions``, ``peak_pages`` and
    ``pages_in_use`` (held after the call: 0 when every page came back), ``num_pages``.

    ``keep_pages``: a request submitted with ``keep`` (a multi-turn row that will continue: ``rl/overlap.py``) keeps its
    pages when it stops, and its next turn prefills only its new tokens over them
    (:mod:`~scaletrain.generation.kept_pages`); False (the default) prefills every turn from scratch, so a turn's
    tokens never depend on whether a short pool gave its pages back (docs/generation.md, kept pages). Families with
    per-slot fixed-size layer state (Gated DeltaNet hybrids) never keep pages. ``stats``: ``prefills_resumed``
    (turns prefilled over kept pages), ``kept_prefix_tokens`` (context tokens those did not recompute),
    ``kept_dropped`` (rows whose kept pages went back to a short pool: prefilled whole instead).
    """

    sampling: SamplingParams
    slots: int = 16
    page_size: int = 16
    decode_steps: int = 32
    share_prefix: bool = True
    cache_pages: int | None = None
    cache_fraction: float = 0.75
    prefill_chunk: int = 256
    keep_pages: bool = False
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
                 step: int = 0, rows: Sequence[int] | None = None) -> Rollout:
        """``num_generations`` completions of each prompt, sampled from ``state``'s live parameters; ``rows``: the
        id each output row's draws are keyed by (default its index)."""
        prompts = [[int(t) for t in p] for p in prompts]
        g = num_generations
        if not self.share_prefix:  # every sample its own prompt: the same rows, prefilled G times
            prompts, g = [p for p in prompts for _ in range(g)], 1
        ids, mask = left_pad(prompts)
        layout = bucket(ids, mask, g, self.sampling.pad_token_id)
        with self.session(state, rows=layout.rows, longest=max(len(p) for p in prompts), group=g, seed=seed,
                          step=step) as run:
            if rows is not None:
                run.row_ids[:layout.rows] = np.asarray(rows, np.int32)
            for i, prompt in enumerate(prompts):
                run.submit(prompt, range(i * g, i * g + g))
            run.all_submitted = True
            while run.busy:
                run.advance()
        n = layout.rows
        return Rollout(jnp.asarray(layout.input_ids[:n]), jnp.asarray(layout.attention_mask[:n]),
                       *_outputs(run.es.out_ids, run.es.out_mask, run.es.out_lp, run.es.stopped, rows=n))

    @contextlib.contextmanager
    def session(self, state: Any, *, rows: int, longest: int, group: int = 1, seed: int = 0,
                step: int = 0) -> Iterator[Schedule]:
        """An open run of the engine's programs on ``state`` (inside its mesh) for ``rows`` request rows whose
        sequences (prompt and completion) fit ``longest`` prompt tokens plus ``max_completion_length``, requests
        of at most ``group`` rows; the caller submits requests and runs rounds (:class:`Schedule`). ``stats`` is
        set when it closes. A multi-turn rollout keeps one open for all its turns (``rl/overlap.py``)."""
        graphdef, params, frozen = split_source(state)
        mesh = _mesh_of(params)
        inside = mesh is None or not jax.sharding.get_abstract_mesh().empty
        with contextlib.nullcontext() if inside else jax.set_mesh(mesh):
            run = self._schedule(programs_for(graphdef, params, frozen), params, frozen, rows, longest, group, seed,
                                 step)
            yield run
            self.stats = run.finish()

    def _schedule(self, programs: PagedPrograms, params: Any, frozen: Any, rows: int, longest: int, group: int,
                  seed: int, step: int) -> Schedule:
        sampling = self.sampling
        new = int(sampling.max_completion_length)
        width = prompt_bucket(longest, self.page_size, self.prefill_chunk)
        max_pages = -(-(width + new) // self.page_size)
        # the pool's budget follows the power-of-two bucket, as before the 3/4 widths: a narrower prefill must not
        # shrink it (a fixed-length call needs ~0.9x the worst case; a pool cut to 0.75x of a 3/4 width preempts)
        budget = -(-(round_up_pow2(width) + new) // self.page_size)
        flags = dict(new=new, greedy=sampling.greedy, page_size=self.page_size,
                     top_k=None if sampling.greedy or sampling.top_k is None else int(sampling.top_k),
                     use_top_p=not sampling.greedy and sampling.top_p is not None)
        sampler = Sampler(jnp.asarray(seed, jnp.uint32), jnp.asarray(step, jnp.int32),
                          jnp.float32(1.0 if sampling.greedy else sampling.temperature),
                          jnp.asarray(inverse_temperature(sampling.temperature)),
                          jnp.float32(1.0 if sampling.top_p is None else sampling.top_p),
                          jnp.asarray(np.asarray(sampling.stop_token_ids, np.int32).reshape(-1)),
                          jnp.int32(sampling.pad_token_id))
        return Schedule(programs, params, frozen, sampler, slots=self.slots, page_size=self.page_size,
                        decode_steps=self.decode_steps, prefill_chunk=self.prefill_chunk,
                        num_pages=pool_pages(self.slots, budget, self.cache_pages, self.cache_fraction),
                        max_pages=max_pages, rows=round_up_pow2(rows), new=new, group=group, width=width,
                        pad_id=int(sampling.pad_token_id), flags=flags, keep_pages=self.keep_pages)
