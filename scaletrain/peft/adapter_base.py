"""Is a PEFT adapter's base this run's base? Checked before ``lora.init_from`` continues training it.

Why: an adapter is a small correction to one particular set of weights. On another base
of the same shapes (the instruct model instead of the base model, another size's
sibling with equal widths) it loads without complaint and trains from a meaningless
start. ``adapter_config.json`` records its base as ``base_model_name_or_path``. What
identifies a base is its weights, not its path: the same folder (after ``realpath``) is
the same base; otherwise, where both folders exist, their architectures must agree (read
from config.json: cheap, and the message names the field) and their tensors must be
equal (read once each, stopping at the first difference, so a copy of the base in
another place is accepted). Where the recorded base is not a local folder (a hub name,
a deleted folder) nothing can be compared: a warning says so, and the tensor shapes are
still checked when the weights load.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import struct
from typing import Any

from scaletrain.errors import CheckpointError, ConfigError
from scaletrain.models.hf import _IGNORED_TENSORS, _weight_files
from scaletrain.models.hf_config import CONFIG_FILE, load_hf_config
from scaletrain.peft.adapter import ADAPTER_CONFIG, recorded_base

logger = logging.getLogger("scaletrain")

#: config fields that make two bases' weights incompatible (the first differing one is named)
ARCHITECTURE = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings")


def check_adapter_base(folder: str, run_base: str | None, run_config: Any) -> None:
    """ConfigError unless the adapter in ``folder`` was trained on this run's base.

    ``run_base`` is the run's base folder (``lora.base_model``, which a recipe sets from
    ``model.pretrained``), ``run_config`` its model config.
    """
    recorded = recorded_base(folder)
    if recorded is None or (run_base is not None and _same_path(recorded, run_base)):
        return
    if not os.path.isfile(os.path.join(recorded, CONFIG_FILE)):
        logger.warning("lora.init_from=%s: the adapter's base %r is not a local model folder, so it cannot be "
                       "compared with this run's base %s; make sure they are the same model", folder, recorded,
                       run_base or "(not read from a folder)")
        return
    differ = _architecture_difference(load_hf_config(recorded), run_config)
    if differ is not None:
        raise ConfigError(_refusal(folder, recorded, run_base, f"their architectures differ: {differ}"))
    if run_base is None or not os.path.isfile(os.path.join(run_base, CONFIG_FILE)):
        logger.warning("lora.init_from=%s: this run's base is not a local model folder (set lora.base_model), so "
                       "its weights cannot be compared with the adapter's base %s", folder, recorded)
        return
    logger.info("lora.init_from=%s: comparing the adapter's base %s with this run's base %s", folder, recorded,
                run_base)
    differ = _weights_difference(recorded, run_base)
    if differ is not None:
        raise ConfigError(_refusal(folder, recorded, run_base, f"their weights differ ({differ})"))


def _same_path(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def _refusal(folder: str, recorded: str, run_base: str | None, reason: str) -> str:
    here = run_base or "(a model not read from a folder)"
    return (f"lora.init_from={folder}: the adapter was trained on the base {recorded}, but this run's base is "
            f"{here}: {reason}. Train on the adapter's base (model.pretrained / lora.base_model), or, if the "
            f"adapter does fit this base, set base_model_name_or_path in {os.path.join(folder, ADAPTER_CONFIG)} "
            f"to {here}")


def _architecture_difference(theirs: Any, ours: Any) -> str | None:
    """``"field X (the adapter's base has Y)"`` for the first architecture field that differs, else None."""
    for field in ARCHITECTURE:
        a, b = getattr(ours, field, None), getattr(theirs, field, None)
        if a is not None and b is not None and a != b:
            return f"{field} {a!r} here, {b!r} in the adapter's base"
    return None


def _weights_difference(a: str, b: str) -> str | None:
    """Where the weights of model folders ``a`` and ``b`` first differ (tensor names, dtypes, shapes, bytes),
    else None. Raw bytes are compared (any dtype, bfloat16 included), a block at a time."""
    index_a, index_b = _tensor_index(a), _tensor_index(b)
    if set(index_a) != set(index_b):
        return f"tensors in one only: {sorted(set(index_a) ^ set(index_b))[:3]}"
    with contextlib.ExitStack() as stack:
        files: dict[str, Any] = {}

        def opened(path: str) -> Any:
            if path not in files:
                files[path] = stack.enter_context(open(path, "rb"))
            return files[path]

        for name in sorted(index_a):
            (path_a, head_a, start_a, end_a), (path_b, head_b, start_b, end_b) = index_a[name], index_b[name]
            if head_a != head_b:
                return f"first at {name}: {head_a} in the adapter's base, {head_b} here"
            if not _same_bytes(opened(path_a), start_a, opened(path_b), start_b, end_a - start_a):
                return f"first at {name}"
    return None


def _tensor_index(folder: str) -> dict[str, tuple[str, tuple[Any, ...], int, int]]:
    """Tensor name -> ``(file, (dtype, shape), data start, data end)`` from the safetensors headers."""
    out = {}
    for path in sorted(set(_weight_files(folder).values())):
        with open(path, "rb") as f:
            try:
                size = struct.unpack("<Q", f.read(8))[0]
                header = json.loads(f.read(size))
            except (struct.error, ValueError) as err:
                raise CheckpointError(f"{path}: not a safetensors file ({err})") from None
        for name, entry in header.items():
            if name != "__metadata__" and not _IGNORED_TENSORS.match(name):
                start, end = entry["data_offsets"]
                out[name] = (path, (entry["dtype"], tuple(entry["shape"])), 8 + size + start, 8 + size + end)
    return out


def _same_bytes(fa: Any, start_a: int, fb: Any, start_b: int, count: int, block: int = 1 << 24) -> bool:
    fa.seek(start_a)
    fb.seek(start_b)
    while count > 0:
        n = min(block, count)
        if fa.read(n) != fb.read(n):
            return False
        count -= n
    return True
