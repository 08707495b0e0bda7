"""GRPO's options (``objective: {type: grpo, ...}``, ``GRPOConfig``) under TRL 1.16's names and defaults.

Why one pydantic model for the recipe and Python: a bad value is one error naming
``objective.<field>``, and the run wiring, the objective and the rollout read the same
validated values. EasyDeL's ``GRPOConfig`` uses the same names for what they share
(``num_generations``, ``max_prompt_length``, ``max_completion_length``, ``temperature``, ``beta``).

Two defaults differ from TRL's on purpose: ``vllm_importance_sampling_correction`` is off
(TRL applies it only with vLLM; our sampler runs the trainer's own forward, so sampler and
trainer agree and the correction is an option for reduced-precision runs), and
``max_completion_length`` is 256 (TRL: 512) to suit a CPU. Options ours alone:
``reward_timeout``, the seconds a reward function's call may take before its rows score ``None``
(TRL waits for ever; ``scaletrain.user_calls``), and ``rollout_engine`` / ``rollout_slots``, which
engine samples (both draw the same tokens).
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from scaletrain.config_keys import key_errors
from scaletrain.objectives.advantage_estimators import REWARD_SCALES, AdvantageSpec
from scaletrain.objectives.grpo_loss import IMPORTANCE_SAMPLING_LEVELS, IS_MODES
from scaletrain.objectives.loss_aggregations import aggregation_names

logger = logging.getLogger("scaletrain")

#: TRL 1.16's options that choose and tune vLLM as the sampler. Rollouts here sample from the training arrays on
#: the training mesh (no second engine, no weight sync), so none of them has anything to act on.
TRL_VLLM_OPTIONS = frozenset({
    "use_vllm", "vllm_mode", "vllm_model_impl", "vllm_enable_sleep_mode", "vllm_server_base_url", "vllm_server_host",
    "vllm_server_port", "vllm_server_timeout", "vllm_group_port", "vllm_gpu_memory_utilization",
    "vllm_max_model_length", "vllm_tensor_parallel_size", "vllm_structured_outputs_regex",
})
_warned: set[tuple[str, ...]] = set()  # the dropped option sets already warned about: once a process, not per parse
_NO_VLLM = ("rollouts here sample from the training weights on the training mesh (no vLLM engine or server, "
            "no weight sync)")


class GRPOOptions(BaseModel):
    """Every GRPO option; see TRL's ``GRPOConfig`` for the meaning of each shared name."""

    model_config = ConfigDict(extra="forbid")

    # rollouts
    num_generations: int = Field(8, ge=2)
    max_prompt_length: int | None = Field(None, ge=1)  # the last tokens of a longer prompt are kept
    max_completion_length: int = Field(256, ge=1)
    temperature: float = Field(1.0, ge=0)  # 0 is refused (_temperature): greedy groups train nothing
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)  # 0: no top-k
    # which engine samples (ours alone): "static", one batch per shape bucket; "continuous", rollout_slots decode
    # slots over a paged cache, refilled as rows stop (docs/generation.md); both draw the same tokens
    rollout_engine: Literal["static", "continuous"] = "static"
    rollout_slots: int = Field(16, ge=1)
    rollout_cache_pages: int | None = Field(None, ge=1)  # continuous: the page pool (None: 3/4 of the worst case)
    # continuous, with tools: a row keeps its pages between turns and prefills only its new tokens (docs/generation.md,
    # kept pages); off by default: a turn over kept pages may sample a rare token another way, so a run replays
    # exactly only where the pool never drops them
    rollout_keep_pages: bool = False
    # rewards
    reward_funcs: list[Any] = Field(default_factory=list)
    reward_weights: list[float] | None = None
    scale_rewards: str = "group"
    # seconds one call of a reward function may take (it scores a batch's rows); past it the rows score None
    reward_timeout: float = Field(300.0, gt=0)
    # tools and environments (TRL's names; scaletrain/rl/agentic.py): callables or 'module:function' entries, an
    # environment class (or 'module:Class', or {name: either} chosen by an ``environment`` column)
    tools: list[Any] = Field(default_factory=list)
    environment_factory: Any = None
    max_tool_calling_iterations: int | None = Field(None, ge=0)  # None: until no row calls a tool
    tool_timeout: float = Field(60.0, gt=0)  # seconds one tool call may take; past it the model reads the error
    # the step calls of a multi-turn environment's episode (rl/env_steps.py); None: until it says done
    max_turns: int | None = Field(None, ge=1)
    tool_call_format: str = "auto"  # auto (the tokenizer's parser, else <tool_call> JSON), tokenizer, hermes, ...
    # the loss
    loss_type: str = "dapo"
    importance_sampling_level: str = "token"
    epsilon: float = Field(0.2, ge=0)
    epsilon_high: float | None = Field(None, ge=0)
    delta: float | None = Field(None, gt=0)
    beta: float = Field(0.0, ge=0)
    use_bias_correction_kl: bool = True
    num_iterations: int = Field(1, ge=1)
    mask_truncated_completions: bool = False
    reference: str | None = None  # with beta > 0: a model folder; unset: the starting policy (LoRA: adapters off)
    # sampler vs trainer (TRL's names, kept although no vLLM is involved)
    vllm_importance_sampling_correction: bool = False
    vllm_importance_sampling_mode: str = "sequence_mask"
    vllm_importance_sampling_clip_max: float | None = 3.0
    vllm_importance_sampling_clip_min: float | None = None
    # what a person reads
    log_completions: bool = True
    log_completions_steps: int = Field(10, ge=1)  # completions.jsonl every this many steps
    num_completions_to_print: int | None = Field(None, ge=1)  # rows written each time (None: all)

    @model_validator(mode="before")
    @classmethod
    def _other_names(cls, data: Any) -> Any:
        """EasyDeL's ``num_return_sequences`` is ``num_generations``."""
        if isinstance(data, dict) and "num_return_sequences" in data:
            data = dict(data)
            value = data.pop("num_return_sequences")
            data.setdefault("num_generations", value)
        return data

    @model_validator(mode="before")
    @classmethod
    def _trl_vllm_options(cls, data: Any) -> Any:
        """TRL's vLLM options (:data:`TRL_VLLM_OPTIONS`): asking for vLLM (``use_vllm: true``) or for what only it
        does (``vllm_structured_outputs_regex``, guided decoding) is refused with the reason, since the run would
        not do it; the settings that only tune the engine (``vllm_mode``, ``vllm_gpu_memory_utilization``, ...)
        change nothing when vLLM is off, in TRL too, so they are dropped with one warning, and a TRL config
        runs unchanged."""
        if not isinstance(data, dict) or not TRL_VLLM_OPTIONS & set(data):
            return data
        data = dict(data)
        given = {k: data.pop(k) for k in sorted(TRL_VLLM_OPTIONS & set(data))}
        refused = []
        if given.get("use_vllm"):
            refused.append(("use_vllm", f"{_NO_VLLM}, so vLLM is neither needed nor used: drop use_vllm "
                                        f"(and the vllm_* settings)", given["use_vllm"]))
        if given.get("vllm_structured_outputs_regex") is not None:
            refused.append(("vllm_structured_outputs_regex", f"{_NO_VLLM}, and the sampler has no guided "
                            f"decoding: drop it (a reward can pay for the format instead, e.g. format_regex)",
                            given["vllm_structured_outputs_regex"]))
        if refused:
            raise key_errors(cls.__name__, refused)
        if tuple(given) not in _warned:
            _warned.add(tuple(given))
            logger.warning("objective: %s: %s; these options have no effect and can be dropped", ", ".join(given),
                           _NO_VLLM)
        return data

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, value: float) -> float:
        if value == 0:
            raise ValueError("0 samples greedily, so the num_generations completions of a prompt are all the same: "
                             "their rewards are equal, every advantage is 0 and nothing trains; use a temperature "
                             "> 0 (TRL's default: 1.0)")
        return value

    @field_validator("reward_funcs", mode="before")
    @classmethod
    def _one_or_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, (str, dict)) or callable(value) else value

    @field_validator("tools", mode="before")
    @classmethod
    def _tool_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) or callable(value) else value

    @field_validator("tool_call_format")
    @classmethod
    def _tool_call_format(cls, value: str) -> str:
        return _one_of(value, ("auto", "tokenizer", "hermes", "llama3_json"))

    @field_validator("loss_type")
    @classmethod
    def _loss_type(cls, value: str) -> str:
        return _one_of(value, aggregation_names())

    @field_validator("importance_sampling_level")
    @classmethod
    def _level(cls, value: str) -> str:
        return _one_of(value, tuple(IMPORTANCE_SAMPLING_LEVELS))

    @field_validator("scale_rewards", mode="before")
    @classmethod
    def _scale(cls, value: Any) -> Any:
        # TRL accepts the old booleans: True is "group", False is "none"
        if isinstance(value, bool):
            return "group" if value else "none"
        return _one_of(value, tuple(REWARD_SCALES))

    @field_validator("vllm_importance_sampling_mode")
    @classmethod
    def _mode(cls, value: str) -> str:
        return _one_of(value, tuple(IS_MODES))

    @model_validator(mode="after")
    def _consistent(self) -> "GRPOOptions":
        if self.reward_weights is not None and self.reward_funcs and len(self.reward_weights) != len(self.reward_funcs):
            raise ValueError(f"reward_weights has {len(self.reward_weights)} values but reward_funcs lists "
                             f"{len(self.reward_funcs)} functions")
        if self.reference is not None and self.beta == 0.0:
            raise ValueError("reference is read only for the KL term: set beta > 0 or drop reference")
        return self


def _one_of(value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{value!r} is not one of {list(allowed)}")
    return value


def build_grpo_objective(o: GRPOOptions) -> Any:
    """The :class:`~scaletrain.objectives.grpo.GRPOObjective` of validated options."""
    from scaletrain.objectives.grpo import GRPOObjective

    return GRPOObjective(loss=loss_config(o), temperature=o.temperature, num_iterations=o.num_iterations,
                         importance_sampling_correction=o.vllm_importance_sampling_correction,
                         advantages=AdvantageSpec.of("grpo", o))


def loss_config(o: GRPOOptions) -> Any:
    """The :class:`~scaletrain.objectives.grpo_loss.GRPOLossConfig` of validated options."""
    from scaletrain.objectives.grpo_loss import GRPOLossConfig

    return GRPOLossConfig(loss_type=o.loss_type, importance_sampling_level=o.importance_sampling_level,
                          epsilon=o.epsilon, epsilon_high=o.epsilon_high, delta=o.delta, beta=o.beta,
                          use_bias_correction_kl=o.use_bias_correction_kl,
                          max_completion_length=o.max_completion_length)


#: the options handed to the GRPO trainer (all of them: it samples, scores and records them in checkpoints)
TRAINER_OPTIONS = tuple(GRPOOptions.model_fields)
