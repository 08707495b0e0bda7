"""The names ``attn_mechanism`` and ``gradient_checkpointing`` accept, and what each runs here.

Why a table: other tools' configs name kernels and remat policies their own way (EasyDeL's
``flash_attn2``, ``nothing_saveable``; their enums live in :mod:`scaletrain.compat.easydel.enums`
and arrive here as their string values). Each name we can honour is mapped onto the
implementation that does the same job here; every other name is refused with the accepted
list, never silently run as something else.
"""

from __future__ import annotations

import enum
from typing import Any


# accepted attn_mechanism value -> the value models/kernels/attention.py runs ("auto"/"sdpa": fused
# where it applies, "cudnn": always fused, "xla"/"vanilla": einsum, "pallas": models/kernels/flash_attention.py's
# segment-aware kernel, context parallel over sp)
ATTENTION: dict[str, str] = {
    "auto": "auto", "sdpa": "sdpa", "flash": "auto", "flash_attn2": "auto", "cuda_flash_attn2": "auto",
    "cudnn": "cudnn", "xla": "xla", "vanilla": "vanilla", "blockwise": "vanilla",
    "pallas": "pallas", "pallas_flash": "pallas",
}
REFUSED_ATTENTION: dict[str, str] = {
    "ring": "ring attention is not implemented; 'pallas' splits the sequence over sp by gathering keys instead",
    "splash": "splash attention is a TPU Pallas kernel we do not ship",
    "blocksparse": "block-sparse (splash) attention is a TPU Pallas kernel we do not ship",
    "ragged_page_attention_v2": "paged attention is for inference servers",
    "ragged_page_attention_v3": "paged attention is for inference servers",
    "page_attention": "paged attention is for inference servers",
    "autoregressive_decodeattn": "a decoding-only kernel; generation here uses the einsum path",
}

#: the remat policies a decoder layer can run under; :data:`scaletrain.models.common.remat.POLICIES`
#: builds each but ``none`` (no remat) and checks at import that it builds exactly these.
#: The names live here, not there, because config validation reads them and must not import JAX.
REMAT_POLICIES = ("none", "full", "dots", "dots_with_no_batch_dims", "save_attention", "dots_and_attention")

# accepted gradient_checkpointing value -> the policy (one of REMAT_POLICIES) each decoder layer runs under:
# each policy's own name, and EasyDeL's names for the same job
REMAT: dict[str, str] = {
    **{name: name for name in REMAT_POLICIES},
    "": "none", "everything_saveable": "none", "nothing_saveable": "full", "checkpoint_dots": "dots",
    "dots_saveable": "dots", "checkpoint_dots_with_no_batch_dims": "dots_with_no_batch_dims",
    "dots_with_no_batch_dims_saveable": "dots_with_no_batch_dims", "selective": "dots_with_no_batch_dims",
}


def _text(value: Any) -> str:
    return value.value if isinstance(value, enum.Enum) else value


def attention_implementation(value: Any) -> str:
    """The ``attn_mechanism`` we run for ``value`` (a name or a str enum member); ValueError otherwise."""
    name = _text(value)
    if isinstance(name, str) and name.lower() in ATTENTION:
        return ATTENTION[name.lower()]
    reason = REFUSED_ATTENTION.get(name.lower(), "unknown") if isinstance(name, str) else "not a name"
    raise ValueError(f"{name!r} is not supported here ({reason}); use one of {sorted(ATTENTION)}")


def remat_policy(value: Any) -> str:
    """The remat policy we apply for ``value`` (a name or a str enum member, True = full, None/False = none);
    ValueError otherwise."""
    if value is None or value is False:
        return "none"
    if value is True:
        return "full"
    name = _text(value)
    if isinstance(name, str) and name.lower() in REMAT:
        return REMAT[name.lower()]
    shown = sorted(k for k in REMAT if k)
    raise ValueError(f"{name!r} is not supported here; use one of {shown} ('' = none; EasyDeL's "
                     "name-list policies need its checkpoint names, which these models do not define)")
