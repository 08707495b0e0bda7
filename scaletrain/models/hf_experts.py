"""Stacked expert kernels <-> the per-expert tensors transformers writes to disk.

Why: our experts are one ``[E, in, out]`` kernel per projection (one grouped matmul
per projection), while the safetensors files transformers writes (and reads) hold one
``[out, in]`` linear per expert: ``...experts.<e>.<name>.weight``. transformers 5 fuses
them in memory (``gate_up_proj``) but converts back when saving, and its loader expects
the per-expert names, so those are the format we read and write.

The rule is by name only: a parameter that sits directly under an ``experts`` module
(``model.layers.3.mlp.experts.gate_proj``) is such a stack; the MoE modules name
their kernels after transformers' per-expert linears (see
:class:`scaletrain.models.common.moe.SwiGLUExperts`), so no family needs a table here.
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


def read_stacked_block(slices: list[Any], index: tuple[slice, ...], shape: tuple[int, ...], transpose: bool,
                       lead: int = 1) -> np.ndarray:
    """The block ``index`` of a ``shape`` = [n_1, .., n_lead, *inner] parameter stacked from per-tensor ``slices``.

    ``slices`` holds one safetensors slice per entry of the ``lead`` stacked axes, in
    row-major order (experts ``[E, in, out]``; a layer stack ``[L, ...]``; both
    ``[L, E, in, out]``), each ``inner`` (reversed when ``transpose``). Only the rows and
    columns this block needs are read from each.
    """
    index = index or tuple(slice(None) for _ in shape)
    picked = [range(*index[d].indices(shape[d])) for d in range(lead)]
    inner = tuple(index[lead:])
    part = tuple(reversed(inner)) if transpose else inner
    blocks = []
    for position in np.ndindex(*(len(r) for r in picked)):
        flat = int(np.ravel_multi_index(tuple(r[i] for r, i in zip(picked, position)), shape[:lead]))
        block = slices[flat][part] if part else slices[flat][...]
        blocks.append(block.T if transpose else block)
    return np.stack(blocks).reshape(*(len(r) for r in picked), *blocks[0].shape)
