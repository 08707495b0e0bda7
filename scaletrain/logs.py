"""Logging set-up shared by every entry point: the CLI, sweep members and Ray workers.

One place decides the format and which chatty libraries are quietened, so a line
from a Ray worker reads like a line from the CLI (with its rank in front).
"""

from __future__ import annotations

import logging
import os

NOISY_LOGGERS = ("jax._src.xla_bridge", "absl", "orbax", "jax._src.distributed")


def setup_logging(rank: int | None = None) -> None:
    """INFO to stderr with a timestamp; ``rank`` tags the lines of one process of many."""
    # transformers advises at import that torch is missing; scaletrain never needs it
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    who = "" if rank is None else f"rank{rank} "
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {who}%(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    for noisy in NOISY_LOGGERS:
        logging.getLogger(noisy).setLevel(logging.WARNING)
