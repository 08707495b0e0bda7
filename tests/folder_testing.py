"""Helpers for tests that must show a folder on disk was left exactly as it was."""

from __future__ import annotations

import hashlib
import os


def tree_hash(path: str | os.PathLike) -> str:
    """SHA-256 over every file's relative name and bytes under ``path``, in a fixed order: equal
    before and after an operation only if it created, removed, renamed and changed nothing."""
    digest = hashlib.sha256()
    for root, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted(files):
            digest.update(os.path.relpath(os.path.join(root, name), path).encode())
            with open(os.path.join(root, name), "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()


def checkpoint_params_sha256(trainer, out: str | os.PathLike, step: int) -> str:
    """Checkpoint ``step`` of the run in ``out`` loaded into ``trainer``'s state: its parameters' hash
    (equal for two runs only if the checkpoint holds the same parameters, bit for bit)."""
    from scaletrain.training.checkpoint import Checkpointer
    from scaletrain.training.state import params_sha256

    ckpt = Checkpointer.for_run(str(out), async_save=False)
    try:
        state, _, _ = ckpt.restore(step, trainer.model_state)
    finally:
        ckpt.close()
    assert int(state.step) == step
    return params_sha256(state.params)
