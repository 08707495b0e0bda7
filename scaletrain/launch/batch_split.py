"""Does the global batch divide among the processes? Said the same way by every backend.

Why a message of its own: a run resumed on another number of processes (a smaller spot
cluster, 8 GPUs -> 4) keeps its data order only with the same ``total_batch_size``, so
"change the batch" is the wrong first advice there: the process count is what to change.
"""

from __future__ import annotations

from scaletrain.errors import ConfigError


def check_batch_split(total_batch_size: int, processes: int, count_name: str) -> None:
    """ConfigError unless ``processes`` (named ``count_name``) divides ``total_batch_size``."""
    if total_batch_size % processes == 0:
        return
    divisors = [d for d in range(1, total_batch_size + 1) if total_batch_size % d == 0]
    shown = ", ".join(map(str, divisors[:12])) + (", ..." if len(divisors) > 12 else "")
    raise ConfigError(
        f"training.total_batch_size={total_batch_size} cannot be split among {count_name}={processes}: every "
        f"process reads an equal share of each global batch. To resume a run with its global batch and data "
        f"order, use a process count that divides it ({shown}); for a new run, set training.total_batch_size "
        f"to a multiple of {processes}"
    )
