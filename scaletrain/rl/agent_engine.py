"""The rollout engine of agentic runs: an inner engine samples the turns, tools and environments run between them.

Why an engine over an engine: what happens between turns is host work on user code (parse the calls, run the
tools, render their results), so :class:`MultiTurnEngine` implements the
:class:`~scaletrain.generation.interface.RolloutEngine` interface over any inner one and the trainer asks it for
a rollout as it asks any engine (it gets the usual arrays plus ``tool_mask``). Two loops, one set of rules
(``rl/multi_turn.Rules``), the same episodes for the same keys:

- **overlapped** (an inner engine that can stay open, the continuous one: ``rl/overlap.py``): one engine run
  per rollout; a row that waits on its tools leaves its slot and the others keep decoding;
- **turn by turn** (the static engine, several processes, or ``overlap=False``: ``rl/multi_turn.run_episodes``):
  each turn of all rows still going is one ``inner.generate`` call, and every row's tools run between two calls.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from scaletrain.errors import ConfigError
from scaletrain.generation.interface import Rollout, RolloutEngine, SamplingParams
from scaletrain.rl.multi_turn import Episode, Rules, Trajectories, Turns, run_episodes, to_arrays, turn_seed
from scaletrain.rl.overlap import overlapped_episodes
from scaletrain.rl.process_rows import OwnedCalls, read_whole
from scaletrain.rl.tools import DEFAULT_TOOL_TIMEOUT, Toolbox


def _turns(out: Rollout) -> Turns:
    """A rollout's rows read to the host: each row's sampled ids and log-probabilities."""
    ids, lps, lengths = (read_whole(x) for x in (out.completion_ids, out.log_probs, out.lengths))
    return [([int(t) for t in ids[r, :lengths[r]]], [float(x) for x in lps[r, :lengths[r]]])
            for r in range(len(lengths))]


def with_budget(engine: RolloutEngine, budget: int) -> RolloutEngine:
    """``engine`` sampling at most ``budget`` tokens a turn (rounded up to a power of two, so a run compiles a few
    turn lengths, not one per budget), where its sampling can be replaced; else ``engine`` as it is."""
    cap = engine.sampling.max_completion_length
    new = min(cap, 1 << max(0, int(budget) - 1).bit_length())
    if new == cap or not dataclasses.is_dataclass(engine):
        return engine
    return dataclasses.replace(engine, sampling=dataclasses.replace(engine.sampling, max_completion_length=new))


def _check_takes_rows(engine: RolloutEngine) -> None:
    """Refuse, in one line, an inner engine whose ``generate`` takes no ``rows=``.

    Why here and not at the first turn: a multi-turn rollout keys every row's draws by the row's own id (so a
    row's turns never depend on which other rows are still going, and a resumed run replays the same episodes);
    an engine written before ``rows=`` joined the interface would fail mid-rollout with Python's TypeError."""
    if engine is None:  # built to be read (its format, its rules), never sampled from
        return
    try:
        params = inspect.signature(engine.generate).parameters
    except (TypeError, ValueError):  # a builtin or C callable: nothing to read, let it run
        return
    if "rows" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    raise ConfigError(f"{type(engine).__name__}.generate takes no rows=: a multi-turn rollout keys each row's draws "
                      "by the id it passes there; add `rows: Sequence[int] | None = None` (the RolloutEngine "
                      "interface, scaletrain/generation/interface.py) and key each output row's draws by it")


@dataclasses.dataclass
class MultiTurnEngine:
    """A :class:`~scaletrain.generation.interface.RolloutEngine` whose rows call tools between turns (module docstring).

    ``inner``: the engine that samples each turn (its ``sampling`` caps the whole completion); ``tokenizer``: the
    chat template renders tool results; ``toolboxes(rows) -> [Toolbox]``: each row's tools for a rollout of
    ``rows`` rows (fresh environment instances); ``fmt``: the tool-call format (``rl/tool_calls.py``).
    ``overlap``: run the rollout overlapped when ``inner`` can (it has ``session``); False: turn by turn.
    ``last_episodes`` holds the last rollout's episodes (the trainer's figures and logs).
    """

    inner: RolloutEngine
    tokenizer: Any
    toolboxes: Callable[[int], Sequence[Toolbox]]
    fmt: str
    max_tool_calling_iterations: int | None = None
    tool_timeout: float = DEFAULT_TOOL_TIMEOUT
    max_model_len: int | None = None
    max_turns: int | None = None
    overlap: bool = True
    last_episodes: list[Episode] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        _check_takes_rows(self.inner)

    @property
    def sampling(self) -> SamplingParams:
        return self.inner.sampling

    @property
    def overlapped(self) -> bool:
        """Whether a rollout runs overlapped: ``overlap``, an inner engine that can stay open, and one process (the
        order of an overlapped run's programs follows when each call returns, which differs between processes,
        and every process of a run must launch the same programs in the same order)."""
        return self.overlap and callable(getattr(self.inner, "session", None)) and jax.process_count() == 1

    def generate(self, state: Any, prompts: Sequence[Sequence[int]], *, num_generations: int = 1, seed: int = 0,
                 step: int = 0, toolboxes: Sequence[Toolbox] | None = None,
                 owned: Sequence[int] | None = None) -> Trajectories:
        """The rollout of ``prompts`` with tools between turns; ``toolboxes`` (one per row) overrides
        ``self.toolboxes``; ``owned``: on several processes, the rows whose tools and environment steps this
        process runs (:class:`~scaletrain.rl.process_rows.OwnedCalls`; None: every row's; such a run goes turn by
        turn). Reads each turn to the host (the tools need its text)."""
        sampling = self.inner.sampling
        rules = Rules(self.tokenizer, self.fmt, sampling.max_completion_length, self.max_tool_calling_iterations,
                      self.max_model_len, self.tool_timeout, self.max_turns)
        rows = [list(p) for p in prompts for _ in range(num_generations)]
        boxes = list(toolboxes) if toolboxes is not None else list(self.toolboxes(len(rows)))
        if self.overlapped and owned is None:
            with self.inner.session(state, rows=len(rows), longest=max(len(p) for p in rows), group=num_generations,
                                    seed=seed, step=step) as run:
                self.last_episodes = overlapped_episodes(run, prompts, num_generations, boxes, rules, seed=seed)
        else:
            self.last_episodes = self._turn_by_turn(state, prompts, rows, num_generations, boxes, rules, seed, step,
                                                    None if owned is None else OwnedCalls(owned))
        return to_arrays(self.last_episodes, sampling.max_completion_length, sampling.pad_token_id,
                         sampling.stop_token_ids)

    def _turn_by_turn(self, state: Any, prompts: Sequence[Sequence[int]], rows: Sequence[Sequence[int]], g: int,
                      boxes: Sequence[Toolbox], rules: Rules, seed: int, step: int,
                      calls: OwnedCalls | None) -> list[Episode]:
        if callable(getattr(self.inner, "session", None)):
            first, sample = self._session_turns(state, prompts, rows, g, seed, step)
        else:
            first = _turns(self.inner.generate(state, [list(p) for p in prompts], num_generations=g, seed=seed,
                                               step=step))

            def sample(contexts: Sequence[Sequence[int]], budget: int, turn: int, keys: Sequence[int]) -> Turns:
                engine = with_budget(self.inner, budget)
                return _turns(engine.generate(state, [list(c) for c in contexts], num_generations=1,
                                              seed=turn_seed(seed, turn), step=step, rows=list(keys)))

        return run_episodes(rows, first, sample, boxes, rules, calls=calls)

    def _session_turns(self, state: Any, prompts: Sequence[Sequence[int]], rows: Sequence[Sequence[int]], g: int,
                       seed: int, step: int) -> tuple[Turns, Callable[..., Turns]]:
        """The first turn and the turn sampler of a turn-by-turn rollout on an engine that can stay open: each turn is
        one run of it shaped as an overlapped rollout's (every row, the same caps), so both loops run the same
        programs (no compile per turn's shape) with the same numerics."""
        cap = self.inner.sampling.max_completion_length

        def one_run(requests: Sequence[tuple[Sequence[int], Sequence[int], int, int]]) -> Turns:
            with self.inner.session(state, rows=len(rows), longest=max(len(p) for p in rows), group=g, seed=seed,
                                    step=step) as run:
                for prompt, ids, turn_key, limit in requests:
                    run.submit(prompt, ids, seed=turn_key, limit=limit)
                while run.busy:
                    run.advance()
                return run.read([r for _, ids, _, _ in requests for r in ids])

        first = one_run([(p, range(i * g, i * g + g), turn_seed(seed, 0), cap) for i, p in enumerate(prompts)])

        def sample(contexts: Sequence[Sequence[int]], budget: int, turn: int, keys: Sequence[int]) -> Turns:
            return one_run([(c, [k], turn_seed(seed, turn), cap - (len(c) - len(rows[k])))
                            for c, k in zip(contexts, keys)])

        return first, sample
