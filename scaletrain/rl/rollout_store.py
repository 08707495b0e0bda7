"""A scored rollout batch kept in a checkpoint, so a resume in the middle of a ``num_iterations`` cycle is exact.

Why store it rather than sample it again: the sampler's random state is a pure function of
``(seed, step)``, but a rollout reused for μ steps was sampled from the parameters of its first
step, and a checkpoint taken inside the cycle holds later ones; sampling again from those would
give other completions, other old log-probabilities and other advantages. So the objective's
batch (tokens, masks, advantages, old and reference log-probabilities, importance-sampling
weights) goes into the checkpoint's data item, beside the prompt position, as one ``.npz``
encoded in base64: it is written in the same atomic checkpoint save as the parameters, and its
arrays come back bit for bit (dtypes kept). It is stored only when the next step reuses it.
"""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np

from scaletrain.errors import CheckpointError

KEY = "rollout"


def encode(batch: dict[str, np.ndarray], *, epoch: int, index: int) -> dict[str, Any]:
    """The data-item record of a rollout batch of prompt batch ``(epoch, index)``."""
    buffer = io.BytesIO()
    np.savez(buffer, **{k: np.asarray(v) for k, v in batch.items()})
    return {"epoch": int(epoch), "index": int(index), "npz_base64": base64.b64encode(buffer.getvalue()).decode()}


def decode(record: dict[str, Any], *, epoch: int, index: int, where: str) -> dict[str, np.ndarray]:
    """The batch :func:`encode` stored; CheckpointError unless it belongs to prompt batch ``(epoch, index)``."""
    if (record.get("epoch"), record.get("index")) != (epoch, index):
        raise CheckpointError(f"checkpoint {where}: its stored rollout is of prompt batch "
                              f"{(record.get('epoch'), record.get('index'))}, but the data position resumes "
                              f"in batch {(epoch, index)}; resume from another checkpoint")
    try:
        with np.load(io.BytesIO(base64.b64decode(record["npz_base64"])), allow_pickle=False) as stored:
            return {k: stored[k] for k in stored.files}
    except Exception as err:  # a damaged record
        raise CheckpointError(f"checkpoint {where}: its stored rollout cannot be read ({type(err).__name__}: "
                              f"{err}); resume from another checkpoint") from None
