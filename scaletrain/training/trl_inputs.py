"""What TRL's trainers accept, made into what ours run on: a model folder, a ``peft.LoraConfig``, TRL-format rows.

Why one module: the promise of the Python API is that a TRL user changes only the import line,
and TRL's trainers take ``model="a/folder"`` (weights and tokenizer read from it), ``args=None``
(a default config named after the model), ``peft_config=LoraConfig(...)`` and a dataset of
*text* in any of TRL's formats (a ``datasets.Dataset``, a list of dicts or a file), which they
tokenize with ``processing_class``. Our trainers run on a placed ``nnx.Module``, ``TrainingArguments.lora``
and tokenized rows; the conversions live here once, shared by the preference trainers and GRPO,
and the rows go through the recipe's own data kinds (``scaletrain.data.kinds``), so Python and
recipes prepare the same tokens. Nothing is downloaded: a name that is not a local folder is refused.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from scaletrain.arguments import TrainingArguments
from scaletrain.errors import ConfigError, DataError
from scaletrain.peft.lora_config import LoRAConfig

#: the columns that mark rows as TRL's text formats (paired: chosen/rejected; unpaired: completion/label)
TEXT_COLUMNS = {"preference": ("chosen", "rejected"), "unpaired_preference": ("completion", "label")}

#: ``peft.LoraConfig`` fields that change nothing in training (bookkeeping, or the defaults we follow)
_PEFT_BOOKKEEPING = {"peft_type", "task_type", "inference_mode", "revision", "auto_mapping", "base_model_name_or_path",
                     "peft_version", "megatron_core"}
#: ``peft.LoraConfig`` fields mapped onto :class:`LoRAConfig`
_PEFT_MAPPED = {"r": "rank", "lora_alpha": "alpha", "lora_dropout": "dropout", "target_modules": "target_modules",
                "use_rslora": "rslora"}


class ArgumentNames:
    """The keyword arguments of a trainer that takes one thing under several names (TRL's ``args``, EasyDeL's and
    ours ``arguments``; ``ref_model`` / ``reference_model``; ``train_dataset`` / ``dataset_train``, ...): each is
    taken under whichever name was given, and two names given for the same thing are refused, naming both."""

    def __init__(self, named: Mapping[str, Any]):
        self.named = dict(named)

    def __call__(self, *names: str) -> Any:
        """The value given under one of ``names`` (None: none given); taken, so :meth:`rest` no longer holds it."""
        given = [n for n in names if self.named.get(n) is not None]
        if len(given) > 1:
            raise ConfigError(f"give {given[0]!r} or {given[1]!r}, not both (the same argument under two names)")
        values = [self.named.pop(n, None) for n in names]
        return next((v for v in values if v is not None), None)

    def rest(self) -> dict[str, Any]:
        """The arguments given and not taken yet."""
        return {k: v for k, v in self.named.items() if v is not None}


def one_of(**named: Any) -> Any:
    """The one argument given among ``named`` (names for the same thing); ConfigError naming two given."""
    return ArgumentNames(named)(*named)


def model_from(model: Any, args: TrainingArguments | None, who: str,
               score_head: bool = False) -> tuple[Any, str | None]:
    """``(module, folder)``: ``model`` itself, or the model in the local folder ``model`` names (TRL's
    ``model="..."``), built with the arguments' dtypes, as a score-head model with ``score_head`` (TRL's
    ``RewardTrainer`` loads ``AutoModelForSequenceClassification``). A torch model is refused with what to
    pass instead."""
    if isinstance(model, (str, os.PathLike)):
        folder = os.path.expanduser(os.fspath(model))
        if not os.path.isfile(os.path.join(folder, "config.json")):
            raise ConfigError(f"{who}(model={os.fspath(model)!r}): not a local model folder (config.json + "
                              "safetensors); nothing is downloaded here: pass a folder written by save_pretrained, "
                              "or a scaletrain model")
        from scaletrain.models.registry import AutoModelForCausalLM, AutoModelForSequenceClassification

        dtypes = {} if args is None else {"dtype": args.dtype, "param_dtype": args.param_dtype}
        auto = AutoModelForSequenceClassification if score_head else AutoModelForCausalLM
        return auto.from_pretrained(folder, **dtypes), folder
    if type(model).__module__.startswith("transformers."):
        raise ConfigError(f"{who}(model=...) got a transformers (torch) model; save it (model.save_pretrained(DIR)) "
                          "and pass model=DIR, which loads it into JAX")
    return model, None


def tokenizer_from(processing_class: Any, folder: str | None) -> Any:
    """The tokenizer given, else the model folder's (as TRL loads ``processing_class`` from ``model``)."""
    if processing_class is not None or folder is None:
        return processing_class
    from scaletrain.data import load_processor

    return load_processor(folder)


def default_arguments(config_class: type[TrainingArguments], model: Any, suffix: str) -> TrainingArguments:
    """TRL's default for ``args=None``: a config whose ``output_dir`` is ``<model name>-<suffix>``."""
    name = os.path.basename(os.path.normpath(os.fspath(model))) if isinstance(model, (str, os.PathLike)) else "model"
    return config_class(output_dir=f"{name}-{suffix}")


def with_peft_config(args: TrainingArguments, peft_config: Any, model: Any, folder: str | None,
                     who: str) -> TrainingArguments:
    """``args`` with ``lora`` set from a ``peft.LoraConfig`` (a copy: the caller's config is left as it was).

    Without one, an ``args.lora`` of a model given as a folder gets that folder as its ``base_model`` (as a
    recipe's defaults to ``model.pretrained``), so checkpoints record the base and ``init_from`` is checked."""
    if peft_config is None:
        if args.lora is None or args.lora.base_model is not None or folder is None:
            return args
        return args.model_copy(update={"lora": args.lora.model_copy(update={"base_model": folder})})
    if args.lora is not None:
        raise ConfigError(f"{who}: give peft_config= or args.lora, not both (the same adapters twice)")
    return args.model_copy(update={"lora": lora_from_peft(peft_config, model, folder)})


def lora_from_peft(peft_config: Any, model: Any, folder: str | None = None) -> LoRAConfig:
    """Our :class:`LoRAConfig` for PEFT's ``LoraConfig``: ``r``, ``lora_alpha``, ``target_modules`` (unset: PEFT's
    default targets for the model's type, as TRL gets them), ``use_rslora``. Any other field set away from
    PEFT's default has no counterpart here and is refused, naming it, rather than silently trained without."""
    if type(peft_config).__name__ != "LoraConfig" or not type(peft_config).__module__.startswith("peft"):
        raise ConfigError(f"peft_config: only a peft.LoraConfig maps onto scaletrain's LoRA, got "
                          f"{type(peft_config).__name__}")
    from peft import LoraConfig

    given, default = peft_config.to_dict(), LoraConfig().to_dict()
    for field, value in given.items():
        if field in _PEFT_MAPPED or field in _PEFT_BOOKKEEPING or _same(value, default.get(field)):
            continue
        raise ConfigError(f"peft_config: LoraConfig.{field}={value!r} has no counterpart in scaletrain's LoRA; leave "
                          f"it at PEFT's default ({default.get(field)!r}) (supported: {', '.join(_PEFT_MAPPED)})")
    if given.get("task_type") not in (None, "CAUSAL_LM"):
        raise ConfigError(f"peft_config: LoraConfig.task_type={given['task_type']!r}; these trainers train causal "
                          "language models (task_type='CAUSAL_LM')")
    if given.get("lora_dropout"):
        raise ConfigError(f"peft_config: LoraConfig.lora_dropout={given['lora_dropout']} is not supported (the "
                          "train step has no dropout); set lora_dropout=0")
    targets = given.get("target_modules")
    if targets is None:
        targets = _peft_default_targets(model)
    elif not isinstance(targets, str):
        targets = tuple(sorted(targets))
    base = folder or given.get("base_model_name_or_path")
    try:
        return LoRAConfig(rank=given["r"], alpha=given["lora_alpha"], target_modules=targets,
                          rslora=bool(given.get("use_rslora")), base_model=base)
    except ValueError as exc:  # pydantic's error names our field; say PEFT's
        raise ConfigError(f"peft_config: {_one_line(exc)}") from None


def _peft_default_targets(model: Any) -> tuple[str, ...]:
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in DEFAULTS:
        raise ConfigError(f"peft_config: LoraConfig.target_modules is unset and PEFT has no default targets for "
                          f"model_type {model_type!r}; name them (e.g. target_modules=['q_proj', 'v_proj'])")
    return tuple(DEFAULTS[model_type])


def _same(value: Any, default: Any) -> bool:
    if isinstance(value, (set, frozenset, list, tuple)) and isinstance(default, (set, frozenset, list, tuple)):
        return sorted(map(str, value)) == sorted(map(str, default))
    return value == default or (not value and not default)


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())


# ---- datasets -----------------------------------------------------------------------------------
def _columns(dataset: Any) -> list[str] | None:
    """The column names of a ``datasets.Dataset`` or of a list of dicts' first row; None for anything else."""
    names = getattr(dataset, "column_names", None)
    if isinstance(names, list):
        return names
    if isinstance(dataset, (list, tuple)) and dataset and isinstance(dataset[0], Mapping):
        return list(dataset[0])
    return None


def holds_text(dataset: Any, kind: str) -> bool:
    """Whether ``dataset`` is TRL-format text to tokenize (a path, or rows with ``kind``'s TRL columns), rather
    than rows already prepared (``chosen_input_ids``, ..., or a ``FixedRows`` table), which are used as given."""
    if isinstance(dataset, (str, os.PathLike)):
        return True
    columns = _columns(dataset)
    return columns is not None and all(c in columns for c in TEXT_COLUMNS[kind])


def preference_rows(train: Any, evals: Any, tokenizer: Any, args: TrainingArguments, *, kind: str,
                    preparation: str, who: str) -> tuple[Any, Any]:
    """``(train rows, eval rows)`` of TRL-format preference data, through the recipe's data kind ``kind``.

    Each dataset that :func:`holds_text` is read (its file, or its rows), checked row by row and tokenized
    as the recipe's ``data.kind: preference`` / ``unpaired_preference`` does with ``preparation``; one given
    already prepared is returned as it is. No eval split is held out of ``train`` (TRL's trainers hold none).
    """
    text = {name: d for name, d in (("train_dataset", train), ("eval_dataset", evals))
            if d is not None and holds_text(d, kind)}
    if not text:
        return train, evals
    if tokenizer is None:
        raise ConfigError(f"{who}: {', '.join(text)} holds text rows; pass processing_class= (the tokenizer) or a "
                          "model folder that holds one, to tokenize them")
    from scaletrain.data.config import DataSection
    from scaletrain.data.kinds import data_kind
    from scaletrain.data.records import BadRows
    from scaletrain.data.sources import iter_source, source_format

    for name, dataset in text.items():
        if isinstance(dataset, (str, os.PathLike)) and source_format(os.fspath(dataset)) == "text":
            raise DataError(f"{who}({name}={os.fspath(dataset)!r}): read as plain text; preference rows need "
                            f"columns ({' / '.join(TEXT_COLUMNS[kind])}) in JSONL, Parquet, CSV or a dataset folder")
    data_type = data_kind(kind)
    # as a recipe that leaves it unset: the cut the objective's TRL trainer makes (keep_start), unless args set one
    truncation = (args.truncation_mode if "truncation_mode" in getattr(args, "model_fields_set", ())
                  or data_type.truncation_mode is None else data_type.truncation_mode)
    for name in text:
        data = DataSection(kind=kind, source=name, eval_fraction=0.0, preparation=preparation,
                           max_prompt_length=getattr(args, "max_prompt_length", None))

        def rows(source: str, split: str, column: str = data_type.column(data), name: str = name) -> Any:
            return iter_source(_path_or_rows(text[name]), column, split=split)

        bad = BadRows(skip=False)
        built = data_type.build(data, rows, tokenizer, bad, max_length=args.max_length, seed=args.seed,
                                truncation_mode=truncation)
        bad.report()
        if name == "train_dataset":
            train = built.train
        else:
            evals = built.train
    return train, evals


def _path_or_rows(dataset: Any) -> Any:
    return os.fspath(dataset) if isinstance(dataset, os.PathLike) else dataset
