"""Float32 matmul FLOP/s of XLA (what scaletrain's CPU MFU divides by) against torch's.

``python bench/matmul_peak.py [--sizes 1024,2048] [--rounds 5]``

scaletrain's CPU "peak" is XLA's own best 1024² float32 matmul. If torch's GEMM
(oneDNN/MKL) is faster on the same cores, a torch trainer can exceed 100% "MFU"
and part of the gap to HF + torch.compile is the matmul library, not the
framework. The two run alternately in one process (best of ``--rounds``), also the
[2048, 256] x [256, 8192] shape of the benchmark's LM head.
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
    a = p.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp
    import torch

    shapes = [(n, n, n) for n in (int(x) for x in a.sizes.split(","))] + [(2048, 256, 8192)]
    print(f"torch threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.2f}")
    for m, k, n in shapes:
        xa, xb = jnp.ones((m, k), jnp.float32), jnp.ones((k, n), jnp.float32)
        f = jax.jit(lambda x, y: x @ y)
        ta, tb = torch.ones(m, k), torch.ones(k, n)
        flops = 2.0 * m * k * n
        jx = best(lambda: f(xa, xb).block_until_ready(), a.rounds)
        th = best(lambda: torch.mm(ta, tb), a.rounds)
        jx2 = best(lambda: f(xa, xb).block_until_ready(), a.rounds)
        th2 = best(lambda: torch.mm(ta, tb), a.rounds)
        jx, th = min(jx, jx2), min(th, th2)
        print(f"[{m}x{k}] @ [{k}x{n}]: XLA {flops / jx / 1e9:6.1f} GFLOP/s, torch {flops / th / 1e9:6.1f} GFLOP/s, "
              f"torch/XLA {jx / th:.2f}")


if __name__ == "__main__":
    main()
