"""Memory and speed of LoRA and QLoRA against full fine-tuning of the same model, one invocation.

``python bench/lora.py [--hidden 512 --layers 8 --vocab 8192] [--batch 8 --seq 256] [--steps 6] [--rank 16]``

Each mode builds the same Llama (same seed), the exact step the Trainer jits
(``make_step_functions`` over ``create_train_state``: only the adapters are
differentiated and get AdamW moments) and reports, per device: the bytes of the
parameters (trained + frozen), of the optimizer state, XLA's compile-time peak
(arguments + temporaries + outputs not aliased to arguments), and the live peak
where the backend reports one (GPU ``peak_bytes_in_use``); and steady tokens/s, the median
over ``--steps`` timed steps after one warm-up. Modes: ``full``, ``lora``
(all-linear, float32 base), ``lora-bf16`` (base held in bfloat16), ``qlora-int8``,
``qlora-nf4``. ``--layouts unrolled,stacked`` measures every mode in both layer layouts
(``model.scan_layers``), side by side, with the train step's compile seconds (``compile_s``)
and the stacked/unrolled ratios. Writes ``--out`` (default ``bench/results/lora-<date>.json``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

MODES = {
    "full": None,
    "lora": {},
    "lora-bf16": {"base_dtype": "bfloat16"},
    "qlora-int8": {"quantize": "int8"},
    "qlora-nf4": {"quantize": "nf4"},
}


def _bytes(tree: Any) -> int:
    import jax

    # per device: each array's shard on the first device that holds one
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree) if hasattr(x, "addressable_shards"))


def measure(mode: str, ns: argparse.Namespace, layout: str = "unrolled") -> dict[str, Any]:
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    import scaletrain as st
    from scaletrain.models import LlamaConfig, LlamaForCausalLM, create_sharded_model
    from scaletrain.peft.lora import LoRAConfig, apply_lora
    from scaletrain.objectives import LanguageModelObjective
    from scaletrain.objectives.loss import resolve_chunk_size
    from scaletrain.training.optim import make_optimizer, make_schedule
    from scaletrain.training.state import create_train_state, state_shardings
    from scaletrain.training.steps import make_step_functions

    cfg = LlamaConfig(vocab_size=ns.vocab, hidden_size=ns.hidden, intermediate_size=3 * ns.hidden,
                      num_hidden_layers=ns.layers, num_attention_heads=ns.hidden // 64,
                      num_key_value_heads=max(ns.hidden // 256, 1), max_position_embeddings=ns.seq,
                      scan_layers=layout == "stacked")
    model, mesh = create_sharded_model(LlamaForCausalLM, cfg, seed=0)
    if MODES[mode] is not None:
        apply_lora(model, LoRAConfig(rank=ns.rank, target_modules="all-linear", **MODES[mode]))
    args = st.TrainingArguments(max_training_steps=1000, num_train_epochs=None, scheduler="constant",
                                total_batch_size=ns.batch, max_length=ns.seq, learning_rate=1e-4)
    tx = make_optimizer(args, make_schedule(args, 1000))
    state = create_train_state(model, tx, mesh)
    del model
    bs = NamedSharding(mesh, PartitionSpec(*args.step_partition_spec))
    objective = LanguageModelObjective(chunk_size=resolve_chunk_size("auto", cfg.vocab_size, ns.seq))
    train, _ = make_step_functions(tx, state_shardings(state), bs, NamedSharding(mesh, PartitionSpec()), objective)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (ns.batch, ns.seq), dtype=np.int32)
    data = jax.device_put({"input_ids": ids}, bs)
    t0 = time.perf_counter()
    with jax.set_mesh(mesh):
        compiled = train.lower(state, data).compile()
    compile_s = time.perf_counter() - t0
    analysis = compiled.memory_analysis()
    peak_compiled = int(analysis.argument_size_in_bytes + analysis.temp_size_in_bytes
                        + analysis.output_size_in_bytes - analysis.alias_size_in_bytes)
    record = {"mode": mode, "layout": layout, "compile_s": round(compile_s, 2), "trainable_params": state.num_params,
              "params_bytes": _bytes(state.params) + _bytes(state.frozen), "optimizer_bytes": _bytes(state.opt_state),
              "compiled_peak_bytes": peak_compiled}
    times = []
    with jax.set_mesh(mesh):
        for i in range(ns.steps + 1):
            t = time.perf_counter()
            state, metrics = compiled(state, data)
            float(metrics["loss"])
            if i:
                times.append(time.perf_counter() - t)
    record["tokens_per_s"] = ns.batch * ns.seq / statistics.median(times)
    record["loss_after"] = float(metrics["loss"])
    stats = jax.devices()[0].memory_stats() or {}
    record["live_peak_bytes"] = stats.get("peak_bytes_in_use")
    return record


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--layouts", default="unrolled", help="unrolled, stacked (model.scan_layers), or both")
    p.add_argument("--out", default=None, help="result file (default bench/results/lora-<date>.json)")
    ns = p.parse_args()
    import jax

    layouts = ns.layouts.split(",")
    rows = [measure(mode, ns, layout) for mode in ns.modes.split(",") for layout in layouts]
    print(f"{jax.devices()[0].platform} x{jax.device_count()}  hidden={ns.hidden} layers={ns.layers} "
          f"vocab={ns.vocab} batch={ns.batch} seq={ns.seq} rank={ns.rank}")
    print(f"{'mode':<11} {'layout':<9} {'trainable':>11} {'params MB':>10} {'optim MB':>9} {'peak MB':>8} "
          f"{'compile s':>9} {'tok/s':>8} {'vs full':>8}")
    for r in rows:
        full = next((f for f in rows if f["mode"] == "full" and f["layout"] == r["layout"]), rows[0])
        print(f"{r['mode']:<11} {r['layout']:<9} {r['trainable_params']:>11,} {r['params_bytes'] / 2**20:>10.1f} "
              f"{r['optimizer_bytes'] / 2**20:>9.1f} {r['compiled_peak_bytes'] / 2**20:>8.1f} "
              f"{r['compile_s']:>9.1f} {r['tokens_per_s']:>8.0f} {r['tokens_per_s'] / full['tokens_per_s']:>7.2f}x")
    if len(layouts) == 2:  # stacked against unrolled, mode by mode (one invocation, one host)
        for mode in ns.modes.split(","):
            a, b = (next(r for r in rows if r["mode"] == mode and r["layout"] == lay) for lay in layouts)
            print(f"{mode:<11} {layouts[1]}/{layouts[0]}: compile {b['compile_s'] / a['compile_s']:.2f}x, "
                  f"tok/s {b['tokens_per_s'] / a['tokens_per_s']:.2f}x, "
                  f"peak {b['compiled_peak_bytes'] / a['compiled_peak_bytes']:.2f}x")
    out = ns.out or os.path.join(HERE, "results", f"lora-{dt.date.today().isoformat()}.json")
    with open(out, "w") as f:
        json.dump({"args": vars(ns), "platform": jax.devices()[0].platform, "devices": jax.device_count(),
                   "rows": rows}, f, indent=2)
    print("wrote", out)


if __name__ == "__main__":
    main()
