"""Stacked expert kernels <-> the per-expert tensors transformers writes to disk.

Why: our experts are one ``[E, in, out]`` kernel per projection (one grouped matmul
per projection), while the safetensors files transformers writes (and reads) hold one
``[out, in]`` linear per expert: ``...experts.<e>.<name>.weight``. transformers 5 fuses
them in memory (``gate_up_proj``) but converts back when saving, and its loader expects
the per-expert names, so those are the format we read and write.

The rule is by name only: a parameter that sits directly under an ``experts`` module
(``model.layers.3.mlp.experts.gate_proj``) is such a stack; the MoE modules name
their kernels after transformers' per-expert linears (see
:class:`scaletrain.models.moe.SwiGLUExperts`), so no family needs a table here.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

_STACKED = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<leaf>[A-Za-z_][A-Za-z0-9_]*)$")


def expert_tensor_names(name: str, num_experts: int) -> tuple[str, ...] | None:
    """The HF tensors (expert 0, 1, ...) of our stacked parameter ``name``, or None if it is not one."""
    m = _STACKED.match(name)
    if m is None:
        return None
    return tuple(f"{m['prefix']}.{e}.{m['leaf']}.weight" for e in range(num_experts))


def read_expert_block(slices: list[Any], index: tuple[slice, ...], shape: tuple[int, ...],
                      transpose: bool) -> np.ndarray:
    """The block ``index`` of a stacked ``shape`` = [E, in, out] kernel from per-expert ``slices``.

    ``slices[e]`` is expert e's safetensors slice (``[out, in]`` when ``transpose``);
    only the rows and columns this block needs are read from each.
    """
    experts = range(*index[0].indices(shape[0])) if index else range(shape[0])
    inner = tuple(index[1:]) if index else (slice(None), slice(None))
    part = tuple(reversed(inner)) if transpose else inner
    blocks = [slices[e][part] for e in experts]
    return np.stack([b.T if transpose else b for b in blocks])
