"""A GRPO run's tools and environments, TRL 1.16's names: ``tools``, ``environment_factory``, and each step's episodes.

Why here and not in the trainer: what TRL's contract says about environments is set-up work apart from
the step: load ``tools`` (callables or recipe entries ``module:function``) and ``environment_factory`` (a
class or callable, ``module:Class``, or ``{name: factory}`` chosen per row by an ``environment`` column);
give each rollout row its own environment instance, whose public methods are its tools; call its
``reset(**row)`` (the row's columns and ``prompt``; also ``seed`` when ``reset`` takes one, derived from
``(seed, step, row)`` so a resumed run replays the same episodes), whose text, if any, is appended to the
prompt's last message; render the prompt with the row's tool schemas; and, when the environment class
defines ``get_reward()``, score each episode with it as one more reward, named after the class, weight 1.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from scaletrain.data.prompts import PromptRow, is_messages
from scaletrain.errors import ConfigError, DataError
from scaletrain.rl.chat_turns import prompt_ids
from scaletrain.rl.rewards import RewardFunction, _import
from scaletrain.rl.agent_engine import MultiTurnEngine
from scaletrain.rl.multi_turn import episode_record, tool_figures
from scaletrain.rl.tool_calls import resolve_format
from scaletrain.rl.env_steps import episode_return, is_multi_turn
from scaletrain.rl.tools import Toolbox, environment_tools, tool_schema
from scaletrain.user_calls import invoke


def load_object(spec: Any, field: str, folders: Sequence[str] = ()) -> Any:
    """A callable given as itself or as ``'module:name'`` (looked for in ``folders``, the working directory, then
    on ``sys.path``); ConfigError naming ``field`` otherwise."""
    import os

    if callable(spec):
        return spec
    module, sep, attr = str(spec).partition(":")
    if not isinstance(spec, str) or not sep or not module or not attr:
        raise ConfigError(f"{field}={spec!r}: name a callable as 'package.module:name'")
    try:
        value = getattr(_import(module, [*folders, os.getcwd()]), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"{field}={spec!r} cannot be loaded: {exc}") from None
    if not callable(value):
        raise ConfigError(f"{field}={spec!r} is not callable")
    return value


def episode_seed(seed: int, step: int, row: int) -> int:
    """The seed of row ``row``'s environment at ``step`` of a run seeded ``seed`` (a 31-bit integer)."""
    digest = hashlib.sha256(f"{int(seed)}:{int(step)}:{int(row)}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


@dataclasses.dataclass
class Agentic:
    """A run's ``tools`` and ``environment_factory`` (see the module docstring); ``factories`` maps an environment
    name (``None`` for the single factory) to its factory."""

    tools: list[Callable[..., Any]]
    factories: dict[str | None, Callable[[], Any]] | None

    @classmethod
    def of(cls, options: Any) -> Agentic | None:
        """The tools and environments of an RL objective's ``options`` (None for an objective without them)."""
        return cls.load(getattr(options, "tools", None) or [], getattr(options, "environment_factory", None))

    @classmethod
    def load(cls, tools: Sequence[Any], environment_factory: Any, folders: Sequence[str] = ()) -> Agentic | None:
        """None when the run has neither tools nor an environment."""
        loaded = [load_object(t, f"objective.tools[{i}]", folders) for i, t in enumerate(tools or [])]
        for tool in loaded:
            try:
                tool_schema(tool)
            except ValueError as err:
                raise ConfigError(f"objective.tools: {err}") from None
        factories = None
        if isinstance(environment_factory, Mapping):
            factories = {str(k): load_object(v, f"objective.environment_factory.{k}", folders)
                         for k, v in environment_factory.items()}
        elif environment_factory is not None:
            factories = {None: load_object(environment_factory, "objective.environment_factory", folders)}
        if not loaded and factories is None:
            return None
        for name, factory in (factories or {}).items():
            probe = factory()
            if not callable(getattr(probe, "reset", None)):
                raise ConfigError(f"objective.environment_factory{'' if name is None else '.' + name}: "
                                  f"{type(probe).__name__} needs a reset() method (TRL's contract)")
        return cls(loaded, factories)

    def environment_rewards(self) -> list[RewardFunction]:
        """One reward per environment class with a ``get_reward()`` (sync or ``async def``), or a multi-turn one
        (``rl/env_steps.py``: the sum of its ``step`` rewards, the ``environment_rewards`` column), named after the
        class (weight 1), reading the ``environments`` column: the row's instance (None for a row of another
        environment)."""
        out: list[RewardFunction] = []
        seen: set[type] = set()
        for factory in (self.factories or {}).values():
            kind = type(factory())
            owns = callable(getattr(kind, "get_reward", None))
            if kind in seen or not (owns or is_multi_turn(kind)):
                continue
            seen.add(kind)

            def get_reward(prompts: Any, completions: Any, environments: Sequence[Any] = (),
                           environment_rewards: Sequence[float | None] = (), _kind: type = kind, _owns: bool = owns,
                           **_: Any) -> list[float | None]:
                if not _owns:  # a multi-turn environment without get_reward: the sum of its step rewards
                    return [r if type(e) is _kind else None for e, r in zip(environments, environment_rewards)]
                return [invoke(e.get_reward) if type(e) is _kind else None for e in environments]

            out.append(RewardFunction(kind.__name__, get_reward))
        return out

    def start(self, rows: Sequence[PromptRow], num_generations: int, tokenizer: Any, *, seed: int,
              step: int) -> tuple[list[Toolbox], list[list[int]]]:
        """Each rollout row's toolbox (a fresh environment, reset) and prompt ids, ``num_generations`` rows per
        prompt row, in rollout order."""
        boxes, ids = [], []
        for r in range(len(rows) * num_generations):
            row = rows[r // num_generations]
            if not is_messages(row.prompt):
                raise DataError("tools and environments need conversational prompts (a list of messages): the tool "
                                "results are chat-template turns")
            messages = [dict(m) for m in row.prompt]
            environment = None
            if self.factories is not None:
                name = row.columns.get("environment") if None not in self.factories else None
                if name not in self.factories:
                    raise DataError(f"a prompt row has environment={name!r}, not one of the "
                                    f"objective.environment_factory names {sorted(map(str, self.factories))}")
                environment = self.factories[name]()
                text = self._reset(environment, row, episode_seed(seed, step, r))
                if text is not None:
                    messages[-1] = {**messages[-1], "content": str(messages[-1]["content"]) + str(text)}
            box = Toolbox(self.tools, environment)
            boxes.append(box)
            ids.append(prompt_ids(tokenizer, messages, box.tools))
        return boxes, ids

    def _reset(self, environment: Any, row: PromptRow, seed: int) -> Any:
        kwargs = {k: v for k, v in row.columns.items() if k != "environment"}
        kwargs["prompt"] = row.prompt
        params = inspect.signature(environment.reset).parameters
        if "seed" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
            kwargs.setdefault("seed", seed)
        if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            kwargs = {k: v for k, v in kwargs.items() if k in params}
        return environment.reset(**kwargs)


@dataclasses.dataclass(frozen=True)
class AgentStep:
    """What a step's multi-turn rollout gives the host besides its arrays: the longest prompt (ids, with the tool
    schemas), each row's model-token count, the rows' messages (the completions the rewards read), the rows'
    environments (the ``environments`` column) and their ``step`` rewards' sums (``environment_rewards``),
    ``completions.jsonl``'s records, and the tool figures."""

    longest: int
    model_tokens: Any
    messages: list[list[dict[str, Any]]]
    environments: list[Any]
    environment_rewards: list[float | None]
    records: list[Any]
    figures: dict[str, float]


def objective_record(options: Any) -> dict[str, Any]:
    """An RL objective's ``options`` as a checkpoint records them: ``reward_funcs`` left to the trainer, ``tools``
    and ``environment_factory`` by name (``module:name`` for a callable), not as dumped objects."""
    from scaletrain.rl.rewards import recorded_spec

    out = options.model_dump(exclude={"reward_funcs", "tools", "environment_factory"})
    if "tools" in type(options).model_fields:
        factory = options.environment_factory
        out.update(tools=[recorded_spec(t) for t in options.tools],
                   environment_factory=None if factory is None else recorded_spec(factory))
    return out


def run_rewards(agentic: Agentic | None, specs: Any, weights: Sequence[float] | None,
                tokenizer: Any = None) -> tuple[list[Any], list[float]]:
    """The run's rewards and weights: ``specs`` (``load_rewards``; none needed when an environment scores) plus each
    environment class's ``get_reward`` with weight 1."""
    from scaletrain.rl.rewards import load_rewards

    extra = agentic.environment_rewards() if agentic is not None else []
    funcs, given = load_rewards(specs, weights, tokenizer=tokenizer) if specs or not extra else ([], [])
    return funcs + extra, given + [1.0] * len(extra)


def agentic_engine(inner: Any, tokenizer: Any, options: Any, config: Any) -> MultiTurnEngine:
    """The run's rollout engine: ``inner`` samples each turn, tools run between turns (``options``: the GRPO
    options' ``max_tool_calling_iterations``, ``tool_timeout``, ``tool_call_format``, ``max_turns``; ``config``: the
    model's, whose ``max_position_embeddings`` bounds a trajectory)."""
    max_model_len = getattr(config, "max_position_embeddings", None)
    agentic = Agentic.of(options)
    offered = agentic is not None and (agentic.tools or any(
        environment_tools(f()) for f in (agentic.factories or {}).values()))
    try:  # a run without any tool (multi-turn environments only) parses no calls, whatever its template says
        fmt = "text" if options.tool_call_format == "auto" and not offered else resolve_format(
            tokenizer, options.tool_call_format)
    except ValueError as err:
        raise ConfigError(f"objective.tool_call_format: {err}") from None
    return MultiTurnEngine(inner, tokenizer, lambda n: [], fmt, options.max_tool_calling_iterations,
                           options.tool_timeout, max_model_len, getattr(options, "max_turns", None))


def sample_step(agentic: Agentic | None, engine: Any, state: Any, rows: Sequence[PromptRow], num_generations: int,
                tokenizer: Any, *, seed: int, step: int, layout: Any = None) -> tuple[Any, AgentStep | None]:
    """A step's rollout: without tools, the engine's of the rows' prompts; with them, each row's environment started
    (:meth:`Agentic.start`), then the multi-turn rollout, and its host record. ``layout``: the step's
    :class:`~scaletrain.rl.process_rows.RowLayout`; on several processes each runs the tools and environment steps
    of the rows it owns there (the rows whose rewards it runs, ``get_reward`` among them)."""
    if agentic is None:
        return engine.generate(state, [list(r.prompt_ids) for r in rows], num_generations=num_generations, seed=seed,
                               step=step), None
    boxes, ids = agentic.start(rows, num_generations, tokenizer, seed=seed, step=step)
    several = layout is not None and jax.process_count() > 1 and layout.n == len(ids)
    out = engine.generate(state, ids, num_generations=1, seed=seed, step=step, toolboxes=boxes,
                          **({"owned": layout.owned} if several else {}))
    episodes = engine.last_episodes
    return out, AgentStep(longest=max(len(i) for i in ids),
                          model_tokens=np.array([e.tokens("model") for e in episodes], np.float64),
                          messages=[e.messages for e in episodes], environments=[b.environment for b in boxes],
                          environment_rewards=[episode_return(e.environment_rewards) for e in episodes],
                          records=[episode_record(e) for e in episodes], figures=tool_figures(episodes))
