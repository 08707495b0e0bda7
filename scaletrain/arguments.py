"""``TrainingArguments``: every knob of a training run, validated.

Unknown keys and wrong types are errors that name the key (pydantic with
``extra="forbid"``). Defaults never change the schedule behind the user's back:
the trainer prints the resolved plan (steps, epochs, tokens, schedule) at start.
"""

from __future__ import annotations

import os
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from scaletrain.compile_cache import DEFAULT_DIR as DEFAULT_COMPILATION_CACHE
from scaletrain.errors import ConfigError
from scaletrain.models.config import dtype_name

AxisSpec = str | tuple[str, ...] | None


class TrainingArguments(BaseModel):
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
    log_grad_norms: bool = False
    log_weight_stats: bool = False
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
    # stopping rules (besides the horizon of max_training_steps / epochs)
    exit_iteration: int | None = None
    exit_iteration_this_run: int | None = None
    kill_switch_path: str | None = None
    training_time_limit: str | None = None
    break_on_nan: bool = True
    # data
    truncation_mode: Literal["keep_end", "keep_start"] = "keep_end"
    step_partition_spec: tuple[AxisSpec, ...] = (("dp", "fsdp"), "sp")

    @field_validator("dtype", "param_dtype", mode="before")
    @classmethod
    def _dtype(cls, value: Any) -> str:
        return dtype_name(value)

    @field_validator(
        "total_batch_size", "gradient_accumulation_steps", "max_length", "log_steps"
    )
    @classmethod
    def _positive(cls, value: int) -> int:
        if value <= 0:
            raise ValueError("must be > 0")
        return value

    @field_validator("training_time_limit")
    @classmethod
    def _duration(cls, value: str | None) -> str | None:
        if value is not None:
            parse_duration(value)
        return value

    @field_validator(
        "num_train_epochs", "max_training_steps", "evaluation_steps", "max_evaluation_steps", "save_steps",
        "save_total_limit", "exit_iteration", "exit_iteration_this_run", "generate_steps",
    )
    @classmethod
    def _positive_or_none(cls, value: int | None) -> int | None:
        if value is not None and value <= 0:
            raise ValueError("must be > 0 or null")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> TrainingArguments:
        if self.total_batch_size % self.gradient_accumulation_steps:
            raise ValueError(
                f"total_batch_size ({self.total_batch_size}) must be divisible by "
                f"gradient_accumulation_steps ({self.gradient_accumulation_steps})"
            )
        if self.num_train_epochs is None and self.max_training_steps is None:
            raise ValueError("set num_train_epochs or max_training_steps (or both)")
        return self

    @property
    def micro_batch_size(self) -> int:
        """Sequences per micro-batch (one forward/backward inside the step)."""
        return self.total_batch_size // self.gradient_accumulation_steps

    @property
    def max_sequence_length(self) -> int:
        """EasyDeL's name for ``max_length``."""
        return self.max_length

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "training") -> TrainingArguments:
        """Validate ``data``; a bad key or value raises ConfigError naming ``where.key``."""
        try:
            return cls(**data)
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


def format_validation_error(err: ValidationError, where: str) -> str:
    """One line per problem: ``where.key: what is wrong (got value)``."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        key = ".".join(x for x in (where, loc) if x) or "(top level)"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        got = e.get("input")
        shown = "" if e["type"] in ("extra_forbidden", "missing") or isinstance(got, dict) else f" (got {got!r})"
        # a nested validator already named the full key path: don't repeat it
        lines.append(f"{msg}{shown}" if msg.startswith(f"{key}.") else f"{key}: {msg}{shown}")
    return "\n".join(lines)
