"""How scaletrain's step time and memory grow with model size, sequence length and batch.

``python bench/scaling.py [--indices 1,2,4] [--seqs 128,256,512] [--batches 2,4,8,16]``

Three sweeps around the benchmark's base (4 layers, vocab 8192, float32):

- ``scaling_index`` i multiplies EasyDeL RayDistributedTrainer's ``CONFIG_SCALING_VARIABLES``: hidden 256·i,
  intermediate 1024·i, attention heads 2·i, kv heads 1·i (head dim stays 128);
- sequence length at index 1; batch size at index 1.

For each point: median step time over ``--steps`` steps after a warm-up step,
tokens/s, MFU against the measured CPU peak, and XLA's compile-time memory
analysis of the jitted step (``temp``: activations and other scratch; ``args``:
parameters + optimizer state + batch), which does not depend on machine load.
Writes ``bench/results/scaling-<date>.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from common import write_record  # noqa: E402

BASE: dict[str, Any] = dict(vocab_size=8192, num_hidden_layers=4, max_position_embeddings=4096)
#: EasyDeL RayDistributedTrainer's CONFIG_SCALING_VARIABLES (moe_intermediate_size does not apply to a dense Llama)
SCALING: dict[str, int] = dict(hidden_size=256, intermediate_size=1024, num_attention_heads=2,
                               num_key_value_heads=1)


def model_at(index: int) -> dict[str, Any]:
    return {**BASE, **{k: v * index for k, v in SCALING.items()}}


def measure(index: int, batch: int, seq: int, steps: int, dtype: str, peak: float) -> dict[str, Any]:
    import jax

    from stepfn import scaletrain_step

    t0 = time.perf_counter()
    step = scaletrain_step(model_at(index), batch, seq, dtype)
    jax.block_until_ready(step.run())
    first = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        jax.block_until_ready(step.run())
        times.append(time.perf_counter() - t)
    sec = statistics.median(times)
    tps = batch * seq / sec
    mem = step.memory
    return {"scaling_index": index, "batch": batch, "seq": seq, "params": step.num_params, "step_s": sec,
            "tokens_per_s": tps, "mfu": tps * step.flops_per_token / peak, "compile_and_first_step_s": first,
            "temp_mb": mem.get("temp_size_in_bytes", 0) / 2**20, "args_mb": mem.get("argument_size_in_bytes", 0) / 2**20,
            "load_1min": os.getloadavg()[0]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--indices", default="1,2,4")
    p.add_argument("--seqs", default="128,256,512")
    p.add_argument("--batches", default="2,4,8,16")
    p.add_argument("--base-batch", type=int, default=4, help="batch of the scaling_index sweep")
    p.add_argument("--base-seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from scaletrain.training.metrics import peak_flops_per_device

    peak = peak_flops_per_device()
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    sweeps: dict[str, list[dict[str, Any]]] = {"scaling_index": [], "seq": [], "batch": []}
    for i in ints(a.indices):
        sweeps["scaling_index"].append(measure(i, a.base_batch, a.base_seq, a.steps, a.dtype, peak))
    for s in ints(a.seqs):
        sweeps["seq"].append(measure(1, a.base_batch, s, a.steps, a.dtype, peak))
    for b in ints(a.batches):
        sweeps["batch"].append(measure(1, b, a.base_seq, a.steps, a.dtype, peak))
    record = {"date": dt.datetime.now().isoformat(timespec="seconds"),
              "command": "python bench/scaling.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "dtype": a.dtype, "cpu_peak_flops": peak, "base_model": BASE, "scaling_variables": SCALING,
              "sweeps": sweeps}
    print(f"{'sweep':<14}{'index':>6}{'batch':>6}{'seq':>6}{'params':>10}{'step s':>9}{'tok/s':>9}{'MFU':>7}"
          f"{'temp MB':>9}{'args MB':>9}{'load':>6}")
    for name, rows in sweeps.items():
        for r in rows:
            print(f"{name:<14}{r['scaling_index']:>6}{r['batch']:>6}{r['seq']:>6}{r['params'] / 1e6:>9.1f}M"
                  f"{r['step_s']:>9.3f}{r['tokens_per_s']:>9.0f}{100 * r['mfu']:>6.1f}%{r['temp_mb']:>9.1f}"
                  f"{r['args_mb']:>9.1f}{r['load_1min']:>6.1f}")
    write_record(record, "scaling", a.out)
    return record


if __name__ == "__main__":
    main()
