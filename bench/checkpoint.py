"""Checkpoint cost against model size: orbax async save (return and total) and restore.

``python bench/checkpoint.py [--indices 1,2,4] [--repeats 2]``

For each ``scaling_index`` (the same model family as ``bench/scaling.py``) a full
train state (float32 parameters + AdamW moments) goes through
``scaletrain.training.checkpoint.Checkpointer``, the class the Trainer uses:
``save`` (returns once the arrays are copied off and the write runs in the
background), ``wait`` (write finished), ``restore`` onto the same shardings. Times
are medians over ``--repeats``; the folder size is what lands on disk. Writes
``bench/results/checkpoint-<date>.json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from common import write_record  # noqa: E402


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def measure(index: int, repeats: int, workdir: str) -> dict[str, Any]:
    import jax

    import scaletrain as st
    from scaling import model_at
    from scaletrain.models import LlamaConfig, LlamaForCausalLM, create_sharded_model
    from scaletrain.training.checkpoint import Checkpointer
    from scaletrain.training.optim import make_optimizer, make_schedule
    from scaletrain.training.state import create_train_state

    cfg = LlamaConfig(**model_at(index))
    model, mesh = create_sharded_model(LlamaForCausalLM, cfg)
    args = st.TrainingArguments(max_training_steps=10, num_train_epochs=None)
    state = create_train_state(model, make_optimizer(args, make_schedule(args, 10)), mesh)
    # fresh AdamW moments are zeros, which compress to nothing: give them trained-like noise
    key = jax.random.key(0)
    noisy = jax.jit(lambda t: jax.tree.map(
        lambda x: x + 1e-3 * jax.random.normal(key, x.shape, x.dtype) if x.dtype.kind == "f" and x.ndim else x, t))
    state = state.replace(opt_state=noisy(state.opt_state))
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
    ret, total, restore, size = [], [], [], 0
    for r in range(repeats):
        directory = os.path.join(workdir, f"index{index}-r{r}")
        ckpt = Checkpointer(directory)
        t0 = time.perf_counter()
        path = ckpt.save(1, state, {"next_index": 1}, {"scaling_index": index})
        ret.append(time.perf_counter() - t0)
        ckpt.wait()
        total.append(time.perf_counter() - t0)
        size = folder_bytes(path)
        t0 = time.perf_counter()
        restored, _, _ = ckpt.restore(1, state)
        jax.block_until_ready(restored)
        restore.append(time.perf_counter() - t0)
        ckpt.close()
        shutil.rmtree(directory, ignore_errors=True)
    return {"scaling_index": index, "params": state.num_params, "state_mb": state_bytes / 2**20,
            "disk_mb": size / 2**20, "save_return_s": statistics.median(ret), "save_total_s": statistics.median(total),
            "restore_s": statistics.median(restore), "load_1min": os.getloadavg()[0]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--indices", default="1,2,4")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    rows = []
    with tempfile.TemporaryDirectory(prefix="scaletrain-ckpt-bench-") as work:
        for i in (int(x) for x in a.indices.split(",") if x):
            rows.append(measure(i, a.repeats, work))
    print(f"{'index':>6}{'params':>10}{'state MB':>10}{'disk MB':>9}{'save ret s':>11}{'save tot s':>11}"
          f"{'restore s':>10}{'load':>6}")
    for r in rows:
        print(f"{r['scaling_index']:>6}{r['params'] / 1e6:>9.1f}M{r['state_mb']:>10.0f}{r['disk_mb']:>9.0f}"
              f"{r['save_return_s']:>11.3f}{r['save_total_s']:>11.3f}{r['restore_s']:>10.3f}{r['load_1min']:>6.1f}")
    record = {"date": dt.datetime.now().isoformat(timespec="seconds"),
              "command": "python bench/checkpoint.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "rows": rows}
    write_record(record, "checkpoint", a.out)
    return record


if __name__ == "__main__":
    main()
