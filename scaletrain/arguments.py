"""``TrainingArguments``: every knob of a training run, validated.

Unknown keys and wrong types are errors that name the key (``InvalidConfig``, a
``ConfigError``, with a "did you mean"). Other tools' names are
accepted where they mean the same as ours and refused with what to set otherwise
(the tables: :mod:`scaletrain.argument_names` and its plugins); saving writes our names.
Defaults never change the schedule behind the user's back: the trainer prints the
resolved plan (steps, epochs, tokens, schedule) at start.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any, Literal

from pydantic import ConfigDict, ValidationError, field_validator, model_validator

from scaletrain.argument_names import merged_table, report_to_names, translate_other_names
from scaletrain.compile_cache import DEFAULT_DIR as DEFAULT_COMPILATION_CACHE
from scaletrain.config_keys import ConfigModel, format_validation_error, key_errors
from scaletrain.errors import ConfigError
from scaletrain.models.common.config import dtype_name
from scaletrain.peft.lora_config import LoRAConfig

__all__ = ["TrainingArguments", "format_validation_error", "parse_duration"]

AxisSpec = str | tuple[str, ...] | None


class TrainingArguments(ConfigModel):
    """Hyper-parameters and run settings (names follow EasyDeL's where they exist)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)

    # where and how long
    output_dir: str = "runs/scaletrain"
    total_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    max_length: int = 256
    num_train_epochs: int | None = 1
    max_training_steps: int | None = None
    # optimisation
    learning_rate: float = 3e-4
    learning_rate_end: float | None = None
    warmup_steps: int = 0
    scheduler: Literal["constant", "linear", "cosine"] = "cosine"
    optimizer: Literal["adamw", "lion", "adafactor", "sgd"] = "adamw"
    beta1: float = 0.9
    beta2: float = 0.95
    epsilon: float = 1e-8
    momentum: float = 0.9
    weight_decay: float = 0.0
    clip_grad: float | None = 1.0
    z_loss: float = 0.0
    loss_chunk_size: int | Literal["auto"] | None = "auto"
    # precision
    dtype: str = "float32"
    param_dtype: str = "float32"
    seed: int = 0
    # regex over parameter paths ("model/layers/0/self_attn/q_proj/kernel"): those are not trained
    frozen_parameters: str | None = None
    # low-rank adapters on a frozen (optionally quantised) base: scaletrain.peft.lora
    lora: LoRAConfig | None = None
    # compiled programs cached on disk across runs (scaletrain.compile_cache); null: off
    compilation_cache_dir: str | None = DEFAULT_COMPILATION_CACHE
    # evaluation
    do_eval: bool = True
    evaluation_steps: int | None = None
    max_evaluation_steps: int | None = None
    # logging
    log_steps: int = 10
    progress_bar: bool = True
    peak_flops_per_device: float | None = None
    report_to: tuple[Literal["tensorboard", "wandb"], ...] = ("tensorboard",)
    wandb_project: str = "scaletrain"
    wandb_entity: str | None = None
    wandb_name: str | None = None
    log_grad_norms: bool = False
    log_weight_stats: bool = False
    # a hash of each step's global batch (its token ids), logged as ``data/fingerprint``: the same value
    # for the same tokens whatever the process count, so runs resumed on N -> M processes can be compared
    log_data_fingerprint: bool = False
    generate_steps: int | None = None
    generate_prompts: tuple[str, ...] = ("\n",)
    generate_max_new_tokens: int = 32
    # checkpoints and resume
    save_steps: int | None = None
    save_interval_minutes: float | None = None
    save_total_limit: int | None = None
    save_best: bool = False
    save_at_end: bool = True
    resume_if_possible: bool = False
    resume_from: str | None = None
    # keys a resume may change (objective.beta, objective.reward_funcs, ...); each change is recorded in checkpoints
    resume_allow_changes: tuple[str, ...] = ()
    # stopping rules (besides the horizon of max_training_steps / epochs)
    exit_iteration: int | None = None
    exit_iteration_this_run: int | None = None
    kill_switch_path: str | None = None
    training_time_limit: str | None = None
    break_on_nan: bool = True
    # data
    shuffle_train_dataset: bool = True
    truncation_mode: Literal["keep_end", "keep_start"] = "keep_end"
    step_partition_spec: tuple[AxisSpec, ...] = (("dp", "fsdp"), "sp")
    # EasyDeL's jax.distributed.initialize keywords; the recipe's ``launch`` section means the same
    # (``scaletrain train`` reads both, see scaletrain.launch.jax)
    jax_distributed_config: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _other_names(cls, data: Any) -> Any:
        """Other tools' names, translated by their tables (renamed, fixed or refused): scaletrain.argument_names."""
        if not isinstance(data, dict):
            return data
        data, problems = translate_other_names(data, cls.model_fields, _fixed_value)
        if problems:
            try:  # the other keys' problems too, so one run shows them all
                cls.model_validate(data)
                others = None
            except ValidationError as err:
                others = err
            raise key_errors(cls.__name__, problems, others)
        return data

    @field_validator("scheduler", mode="before")
    @classmethod
    def _scheduler(cls, value: Any) -> Any:
        value = getattr(value, "value", value)  # an enum's members (the plugins' scheduler names)
        return merged_table().scheduler_values.get(value, value) if value is None or isinstance(value, str) else value

    @field_validator("optimizer", mode="before")
    @classmethod
    def _optimizer(cls, value: Any) -> Any:
        return getattr(value, "value", value)  # another tool's enum members (EasyDeLOptimizers)

    @field_validator("report_to", mode="before")
    @classmethod
    def _report_to(cls, value: Any) -> Any:
        return report_to_names(value)

    @field_validator("step_partition_spec", mode="before")
    @classmethod
    def _partition_spec(cls, value: Any) -> Any:
        # a jax PartitionSpec (what EasyDeL users pass) is kept as the tuple of its entries
        return tuple(value) if type(value).__name__ == "PartitionSpec" else value

    @field_validator("frozen_parameters")
    @classmethod
    def _regex(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                re.compile(value)
            except re.error as err:
                raise ValueError(f"not a valid regular expression: {err}") from None
        return value

    @field_validator("dtype", "param_dtype", mode="before")
    @classmethod
    def _dtype(cls, value: Any) -> str:
        return dtype_name(value)

    @field_validator(
        "total_batch_size", "gradient_accumulation_steps", "max_length", "log_steps", "generate_max_new_tokens"
    )
    @classmethod
    def _positive(cls, value: int) -> int:
        if value <= 0:
            raise ValueError("must be > 0")
        return value

    @field_validator("learning_rate", "learning_rate_end", "warmup_steps", "epsilon", "weight_decay", "z_loss")
    @classmethod
    def _not_negative(cls, value: float | None) -> float | None:
        # a negative learning rate or decay climbs the loss, and trains without a word
        if value is not None and not (value >= 0 and math.isfinite(value)):  # NaN fails both
            raise ValueError("must be >= 0 and finite")
        return value

    @field_validator("beta1", "beta2", "momentum")
    @classmethod
    def _decay_rate(cls, value: float) -> float:
        # an average that forgets nothing (1) never moves, and Adam's bias correction divides by 1 - beta ** t
        if not 0 <= value < 1:
            raise ValueError("must be in [0, 1)")
        return value

    @field_validator("clip_grad")
    @classmethod
    def _clip(cls, value: float | None) -> float | None:
        # 0 or null: no clipping (as the Hugging Face Trainer's max_grad_norm, its other name)
        if value is not None and not (value >= 0 and math.isfinite(value)):
            raise ValueError("must be >= 0 (0 or null: no clipping)")
        return value

    @field_validator("loss_chunk_size")
    @classmethod
    def _chunk(cls, value: int | str | None) -> int | str | None:
        if isinstance(value, int) and value < 1:
            raise ValueError("must be at least 1, 'auto' or null")
        return value

    @field_validator("training_time_limit")
    @classmethod
    def _duration(cls, value: str | None) -> str | None:
        if value is not None:
            parse_duration(value)
        return value

    @field_validator(
        "num_train_epochs", "max_training_steps", "evaluation_steps", "max_evaluation_steps", "save_steps",
        "save_total_limit", "exit_iteration", "exit_iteration_this_run", "generate_steps", "save_interval_minutes",
        "peak_flops_per_device",
    )
    @classmethod
    def _positive_or_none(cls, value: float | None) -> float | None:
        if value is not None and not (value > 0 and math.isfinite(value)):  # NaN fails both
            raise ValueError("must be > 0 or null")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> TrainingArguments:
        if self.total_batch_size % self.gradient_accumulation_steps:
            raise ValueError(
                f"total_batch_size ({self.total_batch_size}) must be divisible by "
                f"gradient_accumulation_steps ({self.gradient_accumulation_steps})"
            )
        if "num_train_epochs" not in self.model_fields_set:
            # an explicit step budget wins over the default epoch count, as HF's max_steps does; set in
            # __dict__ (no re-validation) so assignments follow the rule too
            self.__dict__["num_train_epochs"] = None if self.max_training_steps is not None else 1
        if self.num_train_epochs is None and self.max_training_steps is None:
            raise ValueError("set num_train_epochs or max_training_steps (or both)")
        return self

    @property
    def micro_batch_size(self) -> int:
        """Sequences per micro-batch (one forward/backward inside the step)."""
        return self.total_batch_size // self.gradient_accumulation_steps

    def __getattr__(self, name: str) -> Any:
        """Another tool's name reads our field back (``args.save_directory``) where its table says so."""
        table = merged_table()
        if name in table.read_back:
            return getattr(self, table.renamed[name])
        return super().__getattr__(name)

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "training") -> TrainingArguments:
        """Validate ``data``; a bad key or value raises ConfigError naming ``where.key``."""
        try:
            return cls.model_validate(data)
        except ValidationError as err:
            raise ConfigError(format_validation_error(err, where)) from None

    @property
    def time_limit_seconds(self) -> float | None:
        return None if self.training_time_limit is None else parse_duration(self.training_time_limit)

    def ensure_output_dir(self) -> str:
        os.makedirs(self.output_dir, exist_ok=True)
        return self.output_dir


_UNITS = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0}


def parse_duration(text: str) -> float:
    """Seconds in ``"2h30m"``, ``"90m"``, ``"45s"``, ``"1d"`` or a bare number of seconds."""
    s = str(text).strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", s):
        return float(s)
    parts = re.findall(r"(\d+(?:\.\d+)?)([dhms])", s)
    if not parts or "".join(n + u for n, u in parts) != s:
        raise ValueError(f"{text!r} is not a duration like '2h30m', '90m' or '45s'")
    return sum(float(n) * _UNITS[u] for n, u in parts)


def _fixed_value(value: Any) -> Any:
    """A FIXED switch's value in the table's terms (dtypes by name)."""
    if value is None or isinstance(value, (bool, str, dict, list)):
        return value
    try:
        return dtype_name(value)
    except ValueError:
        return value
