"""Gated DeltaNet on this CPU: the chunked rule's forward + backward in JAX against transformers' torch
implementation on the same shapes, and a decode step's cost against the sequence length.

``python bench/gated_deltanet.py [--batch 2 --seq 1024 --k-heads 4 --v-heads 8 --head-dim 64 --rounds 5]``

Training: :func:`scaletrain.models.common.gated_delta_rule.chunk_gated_delta_rule` (jitted, ``jax.vjp``) and
``transformers.models.qwen3_5.modeling_qwen3_5.torch_chunk_gated_delta_rule`` (the fallback transformers runs
without the flash-linear-attention kernels, eager torch, ``backward``), alternated in bursts (A B A B ...),
both checked to give the same outputs and input gradients first. torch runs in a child process (spawned, the
two taking turns over a pipe, never at once): in one process, XLA's next computation after torch's first
multi-threaded backward sat in futex waits for good on this machine (a thread-pool deadlock between the two
runtimes), at the default shapes. Decoding: one token's
recurrent update (a fixed-size state) against one token of softmax attention over a KV cache of the same
length (the shared einsum path), at several lengths: the linear layer's cost stays flat, attention's grows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def _median_seconds(run: Any, rounds: int, steps: int) -> float:
    """Median wall seconds per call of ``run()`` (already warm) over ``rounds`` bursts of ``steps`` calls."""
    import jax

    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(steps):
            out = run()
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / steps)
    return statistics.median(times)


def _torch_side(conn: Any, arrays: tuple[Any, ...]) -> None:
    """The child process: transformers' chunked rule, forward + backward on ``arrays`` (q, k, v, g, beta and the
    output cotangent), on demand: ``"check"`` sends the outputs and input gradients, an int n runs n steps and
    sends the wall seconds per step, None ends."""
    import torch
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    *inputs, cot = arrays
    leaves = [torch.from_numpy(x).requires_grad_() for x in inputs]
    torch_cot = torch.from_numpy(cot)

    def step() -> Any:
        for x in leaves:
            x.grad = None
        out, _ = torch_chunk_gated_delta_rule(*leaves, use_qk_l2norm_in_kernel=True)
        out.backward(torch_cot)
        return out.detach().numpy(), [x.grad.numpy() for x in leaves]

    conn.send(torch.get_num_threads())
    while (order := conn.recv()) is not None:
        if order == "check":
            conn.send(step())
            continue
        t0 = time.perf_counter()
        for _ in range(order):
            step()
        conn.send((time.perf_counter() - t0) / order)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--k-heads", type=int, default=4)
    p.add_argument("--v-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=2, help="calls per burst")
    p.add_argument("--decode-lengths", default="256,1024,4096,16384")
    p.add_argument("--out", help="write the result as JSON here")
    a = p.parse_args(argv)

    import multiprocessing

    import jax
    import jax.numpy as jnp
    import numpy as np

    from scaletrain.models.common.gated_delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule
    from scaletrain.models.kernels.attention import dot_product_attention

    b, t, hk, hv, d = a.batch, a.seq, a.k_heads, a.v_heads, a.head_dim
    rng = np.random.default_rng(0)
    q, k = (rng.normal(size=(b, t, hk, d)).astype(np.float32) for _ in range(2))
    v, cot = (rng.normal(size=(b, t, hv, d)).astype(np.float32) for _ in range(2))
    g = (-0.3 * np.abs(rng.normal(size=(b, t, hv)))).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.normal(size=(b, t, hv))))).astype(np.float32)

    @jax.jit
    def jax_step(q, k, v, g, beta):
        out, vjp = jax.vjp(lambda *x: chunk_gated_delta_rule(*x)[0], q, k, v, g, beta)
        return out, vjp(jnp.asarray(cot))

    arrays = [jnp.asarray(x) for x in (q, k, v, g, beta)]
    context = multiprocessing.get_context("spawn")
    conn, child_conn = context.Pipe()
    child = context.Process(target=_torch_side, args=(child_conn, (q, k, v, g, beta, cot)), daemon=True)
    child.start()
    torch_threads = conn.recv()
    try:
        ours = jax.block_until_ready(jax_step(*arrays))
        conn.send("check")
        theirs = conn.recv()
        worst = max(float(np.max(np.abs(np.asarray(x) - y)) / np.max(np.abs(y)))
                    for x, y in zip([ours[0], *ours[1]], [theirs[0], *theirs[1]], strict=True))
        jax.block_until_ready(jax_step(*arrays))
        times: dict[str, list[float]] = {"jax": [], "torch": []}
        for _ in range(a.rounds):  # A B A B: both see the same machine, never at once
            times["jax"].append(_median_seconds(lambda: jax_step(*arrays), 1, a.steps))
            conn.send(a.steps)
            times["torch"].append(conn.recv())
    finally:
        conn.send(None)
        child.join(timeout=60)
    result: dict[str, Any] = {"config": {**vars(a), "backend": jax.default_backend(),
                                         "torch_threads": torch_threads, "torch_process": "spawned child"}}
    result["train_jax_s"] = statistics.median(times["jax"])
    result["train_torch_s"] = statistics.median(times["torch"])
    result["train_jax_over_torch_speed"] = result["train_torch_s"] / result["train_jax_s"]
    result["train_max_rel_diff"] = worst

    state = jnp.asarray(rng.normal(size=(b, hv, d, d)).astype(np.float32))
    one = [jnp.asarray(x[:, :1]) for x in (q, k, v, g, beta)]
    decode_linear = jax.jit(recurrent_gated_delta_rule)
    decode: dict[str, dict[str, float]] = {}
    for length in (int(x) for x in a.decode_lengths.split(",")):
        keys, values = (jnp.asarray(rng.normal(size=(b, length, hk, d)).astype(np.float32)) for _ in range(2))
        mask = jnp.ones((b, 1, 1, length), bool)
        attend = jax.jit(lambda q, k, v, m: dot_product_attention(q, k, v, m, jnp.float32, None))
        query = jnp.asarray(rng.normal(size=(b, 1, hv, d)).astype(np.float32))
        jax.block_until_ready((decode_linear(*one, state), attend(query, keys, values, mask)))
        decode[str(length)] = {
            "linear_us": 1e6 * _median_seconds(lambda: decode_linear(*one, state), a.rounds, 20),
            "attention_us": 1e6 * _median_seconds(lambda: attend(query, keys, values, mask), a.rounds, 20)}
    result["decode_per_token"] = decode

    print(f"chunked forward+backward, [{b}, {t}] tokens, {hk} key / {hv} value heads of {d}:")
    print(f"  scaletrain (JAX)  {result['train_jax_s'] * 1e3:9.1f} ms")
    print(f"  transformers torch {result['train_torch_s'] * 1e3:8.1f} ms")
    print(f"  JAX over torch speed {result['train_jax_over_torch_speed']:.2f}x (max rel diff {worst:.1e})")
    print("decode step per token (us): cache length, linear (recurrent state), attention (KV cache)")
    for length, row in decode.items():
        print(f"  {length:>6}  {row['linear_us']:9.1f}  {row['attention_us']:9.1f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
