"""What ``scaletrain eval TARGET`` evaluates: a run folder, a checkpoint, an HF folder, a PEFT adapter.

Why one loader: the data evaluation, the lm-eval model class and its command all take the
same TARGET, and each needs the model on a mesh, its tokenizer and (for a run) the run's
recipe and arguments, so that ``scaletrain eval RUN`` can rebuild the run's own eval set
and evaluate it as the run did.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

from scaletrain.errors import CheckpointError, ConfigError


@dataclasses.dataclass
class Target:
    """A loaded model and what is known about where it came from.

    ``meta`` is a run checkpoint's metadata (``recipe``, ``arguments``, ``config``), ``{}``
    for an HF or adapter folder; ``step`` is the checkpoint's step (None for a folder).
    """

    model: Any
    tokenizer: Any | None
    name: str
    kind: str  # "run", "hf" or "adapter"
    meta: dict[str, Any]
    step: int | None = None


def _axis_dims(mesh: Sequence[int] | None) -> tuple[int, ...] | None:
    return None if mesh is None else tuple(int(x) for x in mesh)


def _local_tokenizer(folder: str) -> Any | None:
    """The tokenizer saved in ``folder`` (local files only), or None if it has none."""
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any(os.path.isfile(os.path.join(folder, n)) for n in names):
        return None
    from scaletrain.data import load_processor

    return load_processor(folder)


def load_target(target: str, *, step: int | None = None, adapter: str | None = None,
                mesh: Sequence[int] | None = None, dtype: str | None = None) -> Target:
    """Load ``target`` onto a mesh of ``mesh`` axis sizes (default: every device on ``fsdp``).

    A run folder gives checkpoint ``step`` (default: the newest); a checkpoints or step folder
    works too. An HF folder is read with its tokenizer, and ``adapter`` (a PEFT folder) is
    applied to it unmerged, as training ran it. A PEFT folder given as ``target`` brings its
    base from ``base_model_name_or_path``. A missing or unrecognised target is one ConfigError.
    """
    from scaletrain.peft.adapter import ADAPTER_CONFIG

    if not os.path.exists(target):
        raise ConfigError(f"{target}: no such file or directory; pass a run folder, a checkpoint folder, "
                          "or a Hugging Face model folder")
    dims = _axis_dims(mesh)
    is_hf, is_adapter = (os.path.isfile(os.path.join(target, f)) for f in ("config.json", ADAPTER_CONFIG))
    if step is not None and (is_hf or is_adapter):
        raise ConfigError(f"--checkpoint {step}: {target} is a model folder, not a training run; drop --checkpoint")
    if adapter is not None and not is_hf:
        raise ConfigError(f"--adapter {adapter}: applies to a Hugging Face model folder, and {target} is not one "
                          "(no config.json)")
    if is_adapter:
        return _load_adapter_folder(target, dims, dtype or "float32")
    if is_hf:
        return _load_hf(target, adapter, dims, dtype or "float32")
    return _load_run(target, step, dims, dtype)


def _load_hf(folder: str, adapter: str | None, dims: tuple[int, ...] | None, dtype: str) -> Target:
    from scaletrain.models.hf_config import read_hf_config
    from scaletrain.models.registry import AutoModelForCausalLM, AutoModelForSequenceClassification
    from scaletrain.peft.adapter import ADAPTER_CONFIG, load_peft_adapter

    architectures = read_hf_config(folder).get("architectures") or [""]
    score_head = str(architectures[0]).endswith("ForSequenceClassification")  # a reward model's folder
    auto = AutoModelForSequenceClassification if score_head else AutoModelForCausalLM
    model = auto.from_pretrained(folder, dtype=dtype, sharding_axis_dims=dims)
    tokenizer = _local_tokenizer(folder)
    if adapter is None:
        return Target(model, tokenizer, folder, "hf", {})
    if not os.path.isfile(os.path.join(adapter, ADAPTER_CONFIG)):
        raise ConfigError(f"--adapter {adapter}: not a PEFT adapter folder (no {ADAPTER_CONFIG})")
    model = load_peft_adapter(model, adapter)
    return Target(model, _local_tokenizer(adapter) or tokenizer, f"{folder}+{adapter}", "adapter", {})


def _load_adapter_folder(folder: str, dims: tuple[int, ...] | None, dtype: str) -> Target:
    from scaletrain.peft.adapter import ADAPTER_CONFIG, recorded_base

    base = recorded_base(folder)
    if base is None or not os.path.isfile(os.path.join(base, "config.json")):
        raise ConfigError(f"{os.path.join(folder, ADAPTER_CONFIG)}: base_model_name_or_path {base!r} is not a local "
                          "Hugging Face model folder; pass the base folder as TARGET and this one as --adapter")
    loaded = _load_hf(base, folder, dims, dtype)
    return dataclasses.replace(loaded, name=folder)


def _load_run(path: str, step: int | None, dims: tuple[int, ...] | None, dtype: str | None) -> Target:
    from scaletrain.export import load_checkpoint_model, tokenizer_for
    from scaletrain.training.checkpoint import resolve_checkpoint

    try:
        directory, latest = resolve_checkpoint(path)
    except CheckpointError as err:
        raise ConfigError(f"{path} is neither a Hugging Face model folder (no config.json) nor a training run "
                          f"with a complete checkpoint ({err})") from None
    overrides = {"sharding_axis_dims": dims} if dims is not None else None
    model, meta = load_checkpoint_model(path, step, config_overrides=overrides, dtype=dtype)
    tokenizer = tokenizer_for(meta) if meta.get("recipe") else None
    return Target(model, tokenizer, path, "run", meta, latest if step is None else step)
