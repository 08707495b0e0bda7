"""What a checkpoint restore says when the saved state does not fit or cannot be read.

Shared by :meth:`~scaletrain.training.checkpoint.Checkpointer.restore` (the whole train
state, for resume) and :meth:`~scaletrain.training.checkpoint.Checkpointer.restore_params`
(the parameters alone, for export), so both name the same checkpoint, tensor and
differences in the same words, whichever part of the state they read.
"""

from __future__ import annotations

import re
from typing import Any

import jax

from scaletrain.errors import CheckpointError
from scaletrain.key_paths import dotted

#: config keys that tell a reader which model a checkpoint was saved from
_HINT_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers")


def _shape_of(leaf: Any) -> tuple[int, ...] | None:
    shape = getattr(leaf, "shape", None)
    return None if shape is None else tuple(int(s) for s in shape)


def flat_shapes(tree: Any) -> dict[str, tuple[int, ...] | None]:
    """Dotted path -> shape of every leaf (arrays, ``ShapeDtypeStruct`` or orbax's saved metadata)."""
    return {dotted(path): _shape_of(leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def fit_error(where: str, meta: dict[str, Any], want: Any, have: Any) -> CheckpointError | None:
    """A CheckpointError naming checkpoint ``where`` and the first differences between
    ``want`` (the template's tree) and ``have`` (the saved tree's metadata); None when they fit.

    ``meta`` is the checkpoint's metadata: the model it was saved from is named, so a reader
    sees which config to load it with.
    """
    want_shapes, have_shapes = flat_shapes(want), flat_shapes(have) if have is not None else {}
    problems = []
    for key in sorted(set(want_shapes) | set(have_shapes)):
        if key not in have_shapes:
            problems.append(f"{key} missing from the checkpoint")
        elif key not in want_shapes:
            problems.append(f"{key} in the checkpoint but not in this model")
        elif want_shapes[key] != have_shapes[key]:
            problems.append(f"{key} has shape {have_shapes[key]} in the checkpoint but {want_shapes[key]} here")
    if not problems:
        return None
    cfg = meta.get("config", {})
    hint = ", ".join(f"{k}={cfg[k]}" for k in _HINT_KEYS if k in cfg)
    hint += f", scan_layers={cfg.get('scan_layers', False)}"  # the layers' layout: stacked or one by one
    lora = (meta.get("arguments") or {}).get("lora")
    if lora and any("lora_" in p for p in problems):  # adapters of another rank: say the setting, not 40 shapes
        hint += (f", lora.rank={lora.get('rank')}, lora.target_modules={lora.get('target_modules')}; set these to "
                 "resume it")
    return CheckpointError(f"checkpoint {where} does not fit this model ({len(problems)} mismatches; saved with "
                           f"{hint}): " + "; ".join(problems[:3]))


#: where TensorStore's errors start printing their spec (dozens of lines of JSON): as an
#: ``Error reading "key/..."`` status, and as orbax's ``Encountered error while reading array index``
_SPEC_STARTS = (" [tensorstore_spec=", " See full TensorStore details:")


def _tensor_named(err: BaseException) -> str | None:
    """The parameter a TensorStore error is about (its dotted path in the state), where it says:
    in a status (``Error reading "params.x/..."``) or as the relative key path inside the spec
    (``'path': 'params.x/'``; the spec's absolute paths are the checkpoint folder)."""
    text = str(err)
    found = re.search(r'Error reading "([^"/]+)/', text) or re.search(r"'path': '([^'/][^']*)/'", text)
    return found.group(1) if found else None


def _short_reason(err: BaseException, limit: int = 300) -> str:
    """The error without TensorStore's spec, which helps nobody (the tensor is named apart)."""
    text = str(err)
    for start in _SPEC_STARTS:
        text = text.split(start)[0]
    text = text.strip()
    return text if len(text) <= limit else text[:limit] + "..."


def unreadable(err: BaseException) -> str:
    """What a failed read could not read, and why, in one short clause."""
    tensor = _tensor_named(err)
    what = f"tensor {tensor}" if tensor else "its train state"
    return f"cannot read {what} ({type(err).__name__}: {_short_reason(err)})"
