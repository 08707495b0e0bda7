"""A multi-turn rollout in one continuous-engine run: rows that are not waiting on tools keep decoding.

Why: turn by turn (``rl/multi_turn.run_episodes``), every row waits for the slowest row's tools before any row
samples its next turn, and the engine idles while the tools run. Here the rollout is one open
:class:`~scaletrain.generation.schedule.Schedule`:

- every row's first turn is queued at once (a prompt's G samples share its prefill);
- after each decode round, the rows that finished a turn are read; a row whose turn calls tools (or whose
  multi-turn environment replies) hands the work to a thread pool and leaves its slot, its slot going to a
  queued row;
- between rounds the host collects the calls that came back (never waiting on one while any row can decode);
  a row's next turn, its whole context token in and token out, is queued as a new request of one row, keyed
  by ``(turn_seed(seed, turn), step, row)`` and capped at what is left of ``max_completion_length``;
- only when nothing can decode does the host block, until the first call comes back.

The episodes are the turn-by-turn loop's for the same keys (the same per-row rules, ``multi_turn.Rules``, and
draws that depend only on ``(seed, step, row, turn, position)``); only the seconds a row waited differ, since
here each row waits for its own calls.

Every turn is submitted with ``keep``: a row that stops keeps its pages while its calls run, and its next turn,
whose context starts with the tokens they hold, prefills only its new tokens over them
(:mod:`~scaletrain.generation.kept_pages`), where the engine keeps pages (``keep_pages=True``; off by default);
otherwise, or for a family with per-slot layer state, the whole context is prefilled again. A row whose episode ends
gives its kept pages back at once (``forget``); a short pool takes them back first, before it preempts a live row.
Log-probabilities differ from a full prefill's in the last bits (the prefix's keys came from other programs), so a
token at a near-tie may too; a run whose pool gives no kept pages back replays the same episodes
(docs/generation.md, "A multi-turn row keeps its pages between turns"); with keeping off every run does, and equals
the turn-by-turn loop.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Sequence
from typing import Any

from scaletrain.rl.multi_turn import Episode, Rules, follow_row, turn_seed
from scaletrain.rl.tools import Toolbox


def overlapped_episodes(run: Any, prompts: Sequence[Sequence[int]], num_generations: int,
                        toolboxes: Sequence[Toolbox], rules: Rules, *, seed: int, workers: int = 16) -> list[Episode]:
    """Every row's episode (module docstring) through ``run``, an open
    :class:`~scaletrain.generation.schedule.Schedule` of at least ``len(prompts) * num_generations`` request rows:
    row ``i * G + j`` is prompt ``i``'s sample ``j`` and owns ``toolboxes[i * G + j]``."""
    g = num_generations
    rows = [list(p) for p in prompts for _ in range(g)]
    for i, prompt in enumerate(prompts):
        run.submit(prompt, range(i * g, i * g + g), seed=turn_seed(seed, 0), limit=rules.max_completion_length,
                   keep=True)
    episodes: list[Episode | None] = [None] * len(rows)
    contexts: dict[int, list[int]] = {}
    turns = [0] * len(rows)
    calls: dict[concurrent.futures.Future, tuple[int, str, float]] = {}

    def taken(row: int, ids: Sequence[int], lps: Sequence[float]) -> None:
        """Record row ``row``'s sampled turn; hand what it wants to the pool."""
        e, box = episodes[row], toolboxes[row]
        if e is None:
            e = episodes[row] = rules.first(rows[row], ids, lps, box)
            wants = rules.wants(e, box)
        else:
            wants = rules.take(e, contexts.pop(row), ids, lps, box)
        if wants:
            future = pool.submit(follow_row, row, wants, e, box, rules.tool_timeout)
            calls[future] = (row, wants, time.perf_counter())
        else:
            run.forget(row)  # its episode ended: its kept pages go back

    def came_back(future: concurrent.futures.Future) -> None:
        """Record a row's calls that came back; queue its next turn (or end its episode)."""
        row, kind, start = calls.pop(future)
        e = episodes[row]
        e.tool_seconds += time.perf_counter() - start
        context = rules.follow(e, kind, future.result())
        if context is None:
            run.forget(row)
            return
        turns[row] += 1
        contexts[row] = context
        room = rules.room(e, context)
        if room <= 0:  # the results fill the completion: no turn is sampled (the turn-by-turn loop cuts it to none)
            taken(row, [], [])
            return
        run.submit(context, [row], seed=turn_seed(seed, turns[row]), limit=room, keep=True)

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(workers, len(rows))),
                                               thread_name_prefix="scaletrain-agent-calls") as pool:
        while run.busy or calls:
            finished = run.advance() if run.busy else []
            if finished:
                for row, (ids, lps) in zip(finished, run.read(finished)):
                    taken(row, ids, lps)
            elif not run.busy:  # nothing can decode: wait for the first call to come back
                concurrent.futures.wait(list(calls), return_when=concurrent.futures.FIRST_COMPLETED)
            for future in [f for f in calls if f.done()]:
                came_back(future)
    if any(e is None for e in episodes):
        raise RuntimeError("a row's first turn never came back from the engine (an engine bug)")
    return list(episodes)  # type: ignore[arg-type]
