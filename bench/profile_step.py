"""Where a train step's time goes on the XLA CPU backend, op by op.

``python bench/profile_step.py [--steps 3] [--dtype float32] [--xla-flags ...]`` traces a
few steps of scaletrain's jitted train step and of the bare loop's step (both on
scaletrain's model module, same shapes as ``bench/run.py``) with ``jax.profiler``
and per-op trace events (``--xla_cpu_enable_xprof_traceme``), then sums the CPU time
of each compiled op over the XLA worker threads and groups it:

- ``matmul``: dots (``dot.*``, ``ynn_fusion.*`` = XNNPACK/YNNPACK-lowered dots);
- ``layout copy``: ``copy``/``transpose`` fusions XLA inserts to give a dot the
  operand layout it wants (torch's BLAS takes transposed operands for free);
- ``scatter/gather``: the embedding lookup and its gradient, ``take_along_axis``;
- ``reduce``: softmax/logsumexp/norm reductions; ``elementwise``: everything else.

The numbers are CPU time (both cores' threads summed) per step, so they hold up
better than wall time on a loaded machine; compare the two columns, not absolute
values across runs.
"""

from __future__ import annotations

import argparse
import collections
import functools
import glob
import os
import sys
import tempfile
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

CATEGORIES = ("matmul", "layout copy", "scatter/gather", "reduce", "elementwise")


def categorise(name: str) -> str:
    """Category of a compiled XLA CPU op from its instruction name."""
    base = name.split(".")[0]
    if base.startswith(("ynn_fusion", "xnn_fusion", "dot", "onednn")) or "_dot" in base or "dot_" in base:
        return "matmul"
    if "scatter" in base or "gather" in base or "dynamic_slice" in base or "dynamic_update" in base:
        return "scatter/gather"
    if base.startswith(("copy", "transpose")) or "_transpose" in base or "copy_" in base:
        return "layout copy"
    if "reduce" in base:
        return "reduce"
    return "elementwise"


def op_times(trace_dir: str, steps: int) -> dict[str, float]:
    """Seconds per step of each op, summed over the XLA worker threads."""
    from jax.profiler import ProfileData

    path = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))[-1]
    total: collections.Counter[str] = collections.Counter()
    for plane in ProfileData.from_file(path).planes:
        for line in plane.lines:
            if not line.name.startswith("tf_XLA") or "PjRtCpuClient" in line.name:
                continue
            for ev in line.events:
                if "::" in ev.name or ev.name.startswith(("Slinky", "ThunkExecutor")):
                    continue
                total[ev.name] += ev.duration_ns / 1e9 / steps
    return dict(total)


def trace(step: Callable[[], Any], steps: int) -> dict[str, float]:
    import jax

    jax.block_until_ready(step())  # compile outside the trace
    with tempfile.TemporaryDirectory(prefix="scaletrain-prof-") as d:
        with jax.profiler.trace(d):
            out = None
            for _ in range(steps):
                out = step()
            jax.block_until_ready(out)
        return op_times(d, steps)


def build_steps(dtype: str, batch: int, seq: int) -> dict[str, Callable[[], Any]]:
    """Zero-argument closures that run one step of each contender (state kept inside)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    import scaletrain as st
    from common import BenchConfig
    from scaletrain.models import LlamaConfig, LlamaForCausalLM, create_sharded_model
    from scaletrain.training.optim import make_optimizer, make_schedule
    from scaletrain.training.state import create_train_state, state_shardings
    from scaletrain.objectives import LanguageModelObjective
    from scaletrain.training.steps import make_step_functions

    bc = BenchConfig(seq_len=seq, batch_size=batch, dtype=dtype)
    cfg = LlamaConfig(**bc.hf_config())
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, seq), dtype=np.int32)

    model, mesh = create_sharded_model(LlamaForCausalLM, cfg, dtype=dtype)
    args = st.TrainingArguments(max_training_steps=1000, num_train_epochs=None, scheduler="constant", dtype=dtype,
                                total_batch_size=batch, max_length=seq)
    tx = make_optimizer(args, make_schedule(args, 1000))
    holder: dict[str, Any] = {"state": create_train_state(model, tx, mesh)}
    bs = NamedSharding(mesh, PartitionSpec(("dp", "fsdp"), "sp"))
    train, _ = make_step_functions(tx, state_shardings(holder["state"]), bs, NamedSharding(mesh, PartitionSpec()),
                                   LanguageModelObjective())
    sbatch = jax.device_put({"input_ids": ids, "segment_ids": np.ones_like(ids),
                             "positions": np.broadcast_to(np.arange(seq, dtype=np.int32), ids.shape).copy()}, bs)

    def scaletrain_cost() -> dict[str, float]:
        with jax.set_mesh(mesh):
            return dict(train.lower(holder["state"], sbatch).compile().cost_analysis() or {})

    def scaletrain_step() -> Any:
        with jax.set_mesh(mesh):
            holder["state"], m = train(holder["state"], sbatch)
        return m["loss"]

    bare_model = LlamaForCausalLM(cfg, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(bare_model)
    btx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-4, b1=0.9, b2=0.95, weight_decay=0.0))
    bare_state = {"p": params, "o": btx.init(params)}
    bids = jnp.asarray(ids)

    def loss_fn(p: Any, x: Any) -> Any:
        logits = nnx.merge(graphdef, p)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1].astype(jnp.float32), x[:, 1:]).mean()

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def bare(p: Any, o: Any, x: Any) -> Any:
        loss, g = jax.value_and_grad(loss_fn)(p, x)
        u, o = btx.update(g, o, p)
        return optax.apply_updates(p, u), o, loss

    def bare_step() -> Any:
        bare_state["p"], bare_state["o"], loss = bare(bare_state["p"], bare_state["o"], bids)
        return loss

    def bare_cost() -> dict[str, float]:
        return dict(bare.lower(bare_state["p"], bare_state["o"], bids).compile().cost_analysis() or {})

    scaletrain_step.cost = scaletrain_cost  # type: ignore[attr-defined]
    bare_step.cost = bare_cost  # type: ignore[attr-defined]
    return {"scaletrain": scaletrain_step, "bare_jax": bare_step}


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--xla-flags", default="")
    a = p.parse_args(argv)
    os.environ["XLA_FLAGS"] = " ".join(
        [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
        + ["--xla_cpu_enable_xprof_traceme=true"] + a.xla_flags.split())
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    steps = build_steps(a.dtype, a.batch, a.seq)
    costs = {name: fn.cost() for name, fn in steps.items()}  # type: ignore[attr-defined]
    print("XLA cost analysis per step (independent of load):")
    for name, c in costs.items():
        print(f"  {name:<12} {c.get('flops', float('nan')) / 1e9:8.2f} GFLOP  "
              f"{c.get('bytes accessed', float('nan')) / 2**20:9.1f} MiB accessed")
    results = {name: trace(fn, a.steps) for name, fn in steps.items()}
    cats = {name: collections.Counter() for name in results}
    for name, ops in results.items():
        for op, s in ops.items():
            cats[name][categorise(op)] += s
    print(f"CPU ms per step by category ({a.dtype}, batch {a.batch} x {a.seq}, load {os.getloadavg()[0]:.2f})")
    print(f"{'category':<16}" + "".join(f"{n:>14}" for n in results))
    for c in (*CATEGORIES, "total"):
        vals = [sum(cats[n].values()) if c == "total" else cats[n][c] for n in results]
        print(f"{c:<16}" + "".join(f"{1e3 * v:>14.1f}" for v in vals))
    for name, ops in results.items():
        print(f"\ntop ops, {name}:")
        for op, s in sorted(ops.items(), key=lambda kv: -kv[1])[: a.top]:
            print(f"  {1e3 * s:8.1f} ms  {categorise(op):<14} {op}")
    return {n: {c: cats[n][c] for c in CATEGORIES} for n in results}


if __name__ == "__main__":
    main()
