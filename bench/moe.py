"""Tokens/s of a small mixture of experts against a dense model with the same active parameters.

``python bench/moe.py [--rounds 6] [--steps 3] [--batch 8] [--seq 256] [--experts 8] [--top-k 2]``

The MoE is a Mixtral (``--experts`` SwiGLU experts of ``--expert-size``, top ``--top-k``);
the dense model is the Llama with the same attention and an MLP of ``top_k x expert_size``,
so a token passes through as many parameters in both (the MoE adds only its router).
Both train steps are scaletrain's own (the Trainer's optimizer, shardings and donation,
:mod:`stepfn`) and alternate in bursts in one process (:func:`common.alternate`), so
both see the same machine. Printed: each model's parameters, active parameters and
FLOPs per token, median step times and the ratios MoE/dense of tokens/s (wall and per
CPU-second). On XLA:CPU ``jax.lax.ragged_dot`` is a masked dense dot over all the
groups, so there the experts cost ``num_experts / top_k`` times their active FLOPs; on
GPU/TPU it is a grouped GEMM.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))


def build(module_class: type, config: Any, batch: int, seq: int) -> Callable[[], Any]:
    """Compile and warm the Trainer's train step for ``config``; returns one-step ``run()``."""
    import jax
    import numpy as np

    from scaletrain.models import create_sharded_model
    from scaletrain.training.state import create_train_state
    from stepfn import benchmark_optimizer, jit_train_step

    model, mesh = create_sharded_model(module_class, config)
    args, tx = benchmark_optimizer(batch, seq, "float32", "float32")
    holder = {"state": create_train_state(model, tx, mesh)}
    train, bs, _ = jit_train_step(config, tx, holder["state"], mesh, args, seq)
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (batch, seq), dtype=np.int32)
    data = jax.device_put({"input_ids": ids}, bs)
    with jax.set_mesh(mesh):
        compiled = train.lower(holder["state"], data).compile()

    def run() -> Any:
        with jax.set_mesh(mesh):
            holder["state"], metrics = compiled(holder["state"], data)
        return metrics["loss"]

    for _ in range(2):
        jax.block_until_ready(run())
    return run


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=3, help="steps per burst")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--expert-size", type=int, default=256)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)

    from common import alternate, write_record
    from scaletrain.models import LlamaConfig, LlamaForCausalLM
    from scaletrain.models.mixtral import MixtralConfig
    from scaletrain.models.mixtral import MixtralForCausalLM

    shared = dict(vocab_size=4096, hidden_size=a.hidden, num_hidden_layers=a.layers, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=a.seq, tie_word_embeddings=True)
    moe = MixtralConfig(**shared, intermediate_size=a.expert_size, num_local_experts=a.experts,
                        num_experts_per_tok=a.top_k)
    dense = LlamaConfig(**shared, intermediate_size=a.top_k * a.expert_size)
    runs = {"moe": build(MixtralForCausalLM, moe, a.batch, a.seq),
            "dense": build(LlamaForCausalLM, dense, a.batch, a.seq)}
    times = alternate(runs, a.rounds, a.steps)
    tokens = a.batch * a.seq
    record: dict[str, Any] = {"args": vars(a), **times}
    for name, cfg in (("moe", moe), ("dense", dense)):
        record[f"{name}_params"] = cfg.num_params
        record[f"{name}_active_params"] = cfg.num_active_params
        record[f"{name}_flops_per_token"] = cfg.flops_per_token(a.seq)
        record[f"{name}_tokens_per_s"] = tokens / times[f"{name}_wall_s"]
        print(f"{name:5s}: {cfg.num_params / 1e6:.2f}M params, {cfg.num_active_params / 1e6:.2f}M active, "
              f"{cfg.flops_per_token(a.seq) / 1e6:.1f} MFLOP/token, {times[f'{name}_wall_s'] * 1e3:.0f} ms/step "
              f"({times[f'{name}_cpu_s']:.2f} CPU-s), {record[f'{name}_tokens_per_s']:.0f} tokens/s")
    record["ratio_tokens_per_s_wall"] = times["dense_wall_s"] / times["moe_wall_s"]
    record["ratio_tokens_per_s_cpu"] = times["dense_cpu_s"] / times["moe_cpu_s"]
    print(f"MoE / dense tokens/s: {record['ratio_tokens_per_s_wall']:.3f} wall, "
          f"{record['ratio_tokens_per_s_cpu']:.3f} per CPU-second")
    write_record(record, "moe", a.out)
    return record


if __name__ == "__main__":
    main()
