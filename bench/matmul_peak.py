"""Float32 matmul FLOP/s of XLA (what scaletrain's CPU MFU divides by) against torch's.

``python bench/matmul_peak.py [--sizes 1024,2048] [--rounds 5] [--step-shapes]``

scaletrain's CPU "peak" is XLA's own best 1024² float32 matmul. If torch's GEMM
(oneDNN/MKL) is faster on the same cores, a torch trainer can exceed 100% "MFU"
and part of the gap to HF + torch.compile is the matmul library, not the
framework. The two run alternately in one process (best of ``--rounds``), also the
[2048, 256] x [256, 8192] shape of the benchmark's LM head. ``--step-shapes`` times
instead every weight matmul of one train step of the benchmark model (forward, input
gradient, weight gradient of each projection and of the head; attention's small
batched dots left out) and sums them per step: the GEMM time each library needs for
the step, whatever the framework around it.
"""

from __future__ import annotations

import argparse
import os
import time


def best(fn, rounds: int) -> float:
    fn()
    out = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1024,2048")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--step-shapes", action="store_true", help="the benchmark step's matmuls, summed per step")
    a = p.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp
    import torch

    shapes = {(n, n, n): 1 for n in (int(x) for x in a.sizes.split(","))}
    shapes[(2048, 256, 8192)] = 1
    if a.step_shapes:
        shapes = step_shapes()
    print(f"torch threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.2f}")
    totals = [0.0, 0.0]
    for (m, k, n), count in shapes.items():
        xa, xb = jnp.ones((m, k), jnp.float32), jnp.ones((k, n), jnp.float32)
        f = jax.jit(lambda x, y: x @ y)
        ta, tb = torch.ones(m, k), torch.ones(k, n)
        flops = 2.0 * m * k * n
        jx = best(lambda: f(xa, xb).block_until_ready(), a.rounds)
        th = best(lambda: torch.mm(ta, tb), a.rounds)
        jx2 = best(lambda: f(xa, xb).block_until_ready(), a.rounds)
        th2 = best(lambda: torch.mm(ta, tb), a.rounds)
        jx, th = min(jx, jx2), min(th, th2)
        totals[0] += count * jx
        totals[1] += count * th
        print(f"{count:3d} x [{m}x{k}] @ [{k}x{n}]: XLA {flops / jx / 1e9:6.1f} GFLOP/s, "
              f"torch {flops / th / 1e9:6.1f} GFLOP/s, torch/XLA {jx / th:.2f}")
    if a.step_shapes:
        print(f"per step: XLA {totals[0] * 1e3:.0f} ms, torch {totals[1] * 1e3:.0f} ms, torch/XLA "
              f"{totals[0] / totals[1]:.3f}")


def step_shapes(tokens: int = 2048, hidden: int = 256, kv: int = 128, inter: int = 1024, vocab: int = 8192,
                layers: int = 4) -> dict[tuple[int, int, int], int]:
    """``(M, K, N) -> count`` of the benchmark step's weight matmuls (forward, dx, dW each)."""
    forward = [(tokens, hidden, hidden)] * 2 + [(tokens, hidden, kv)] * 2 + [(tokens, hidden, inter)] * 2
    forward = forward * layers + [(tokens, inter, hidden)] * layers + [(tokens, hidden, vocab)]
    out: dict[tuple[int, int, int], int] = {}
    for m, k, n in forward:
        for shape in ((m, k, n), (m, n, k), (k, m, n)):  # y = x w, dx = dy w^T, dw = x^T dy
            out[shape] = out.get(shape, 0) + 1
    return out


if __name__ == "__main__":
    main()
