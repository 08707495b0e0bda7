"""A sliding window over unpacked rows: the [B, 1, T, S] mask against ``CausalWindow``, side by side.

``python bench/window_attention.py [--seq 2048 --window 512 --batch 2 --heads 8 --kv-heads 4 --head-dim 64]``

Rows that are one unpadded sequence each (token-only batches) with a sliding window (Mistral,
Qwen2, Gemma 3's local layers) used to get the boolean mask ``build_attention_mask`` makes;
they now get :class:`scaletrain.models.kernels.attention.CausalWindow`, which the einsum path turns
into iotas inside each query block's fusion (no mask read from memory). This times attention's forward and
backward (``jax.vjp``, the layer's own path: :func:`dot_product_attention` with the query
blocks the model uses) for both, compiled once and then alternated in bursts in one process
(``common.alternate``), and checks that both give the same output and gradients.
On a GPU, cuDNN takes the window as its own ``sliding_window_length``; there the difference
is a kernel without a bias (see ``bench/aot.py --attn cudnn``), not measured here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=3, help="calls per burst")
    p.add_argument("--out", help="write the result as JSON here")
    a = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from common import alternate
    from scaletrain.models.kernels.attention import CausalWindow, build_attention_mask, causal_blocks, dot_product_attention

    b, t = a.batch, a.seq
    dtype = jnp.dtype(a.dtype)
    rng = np.random.default_rng(0)
    q, k, v, cot = (jnp.asarray(rng.normal(size=(b, t, n, a.head_dim)), dtype)
                    for n in (a.heads, a.kv_heads, a.kv_heads, a.heads))
    blocks = causal_blocks(t, t)
    dense = build_attention_mask(jnp.ones((b, t), jnp.int32), jnp.broadcast_to(jnp.arange(t), (b, t)), a.window)

    def fwd_bwd(mask: Any) -> Any:
        @jax.jit
        def run(q, k, v, mask_array):
            m = mask if mask_array is None else mask_array
            out, vjp = jax.vjp(lambda q, k, v: dot_product_attention(q, k, v, m, jnp.float32, None, blocks=blocks),
                               q, k, v)
            return out, vjp(cot)

        mask_array = None if isinstance(mask, CausalWindow) else mask
        return lambda: run(q, k, v, mask_array)

    runs = {"mask": fwd_bwd(dense), "window": fwd_bwd(CausalWindow(a.window))}
    outs = {name: jax.block_until_ready(run()) for name, run in runs.items()}  # compile and warm up
    for _ in range(2):
        for run in runs.values():
            jax.block_until_ready(run())
    worst = max(float(jnp.max(jnp.abs(x - y)) / jnp.max(jnp.abs(y)))
                for x, y in zip(jax.tree.leaves(outs["window"]), jax.tree.leaves(outs["mask"]), strict=True))
    result: dict[str, Any] = {"config": {**vars(a), "query_blocks": blocks, "backend": jax.default_backend()}}
    result.update(alternate(runs, a.rounds, a.steps))
    result["window_over_mask_speed_wall"] = result["mask_wall_s"] / result["window_wall_s"]
    result["window_over_mask_speed_cpu"] = result["mask_cpu_s"] / result["window_cpu_s"]
    result["max_rel_diff"] = worst
    for key, value in result.items():
        if key != "config":
            print(f"{key:<30}{value:.4g}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
