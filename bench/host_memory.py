"""Page faults and system time per train step, with and without glibc's huge-page tunable.

``python bench/host_memory.py [--rounds 3] [--steps 5]``

The tunable (:mod:`scaletrain.host_memory`) is read when a process starts, so each
variant runs in its own process (``GLIBC_TUNABLES`` unset / ``glibc.malloc.hugetlb=1``),
alternating, each building the exact step the Trainer compiles
(:func:`stepfn.scaletrain_step`, benchmark config) and reporting per steady step:
wall seconds, user and system CPU seconds, and minor page faults (``getrusage``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def child(steps: int, tiny: bool) -> dict[str, float]:
    import resource

    sys.path.insert(0, HERE)
    sys.path.insert(0, os.path.dirname(HERE))
    import jax

    from common import BenchConfig
    from scaletrain.host_memory import hugepages_enabled
    from stepfn import scaletrain_step

    if tiny:
        from run import TINY

        cfg = BenchConfig(**TINY)
    else:
        cfg = BenchConfig()
    step = scaletrain_step(cfg.hf_config(), cfg.batch_size, cfg.seq_len)
    for _ in range(2):
        jax.block_until_ready(step.run())
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for _ in range(steps):
        jax.block_until_ready(step.run())
    r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    return {"tuned": float(hugepages_enabled()), "wall_s": (t1 - t0) / steps, "user_s": (r1.ru_utime - r0.ru_utime) / steps,
            "sys_s": (r1.ru_stime - r0.ru_stime) / steps, "minflt": (r1.ru_minflt - r0.ru_minflt) / steps,
            "temp_mb": step.memory.get("temp_size_in_bytes", 0) / 2**20}


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--tiny", action="store_true", help="a toy model (for tests): only checks the plumbing")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.steps, a.tiny)))
        return {}
    sys.path.insert(0, os.path.dirname(HERE))
    from scaletrain.host_memory import hugepage_env

    plain = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"} | {"JAX_PLATFORMS": "cpu"}
    runs: dict[str, list[dict[str, float]]] = {"untuned": [], "tuned": []}
    for _ in range(a.rounds):
        for name, env in (("untuned", plain), ("tuned", hugepage_env(plain))):
            cmd = [sys.executable, __file__, "--child", "--steps", str(a.steps)] + (["--tiny"] if a.tiny else [])
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    for name, m in med.items():
        setting = "on" if m["tuned"] else "off"
        print(f"{name:<8} wall {m['wall_s']:.3f} s  user {m['user_s']:.3f} s  sys {m['sys_s']:.3f} s  "
              f"minor faults {m['minflt']:,.0f} per step (median of {a.rounds}; XLA temp {m['temp_mb']:.0f} MB, "
              f"huge-page tunable {setting})")
    u, t = med["untuned"], med["tuned"]
    print(f"tuned / untuned: wall speed {u['wall_s'] / t['wall_s']:.3f}, "
          f"CPU {(u['user_s'] + u['sys_s']) / (t['user_s'] + t['sys_s']):.3f}")
    return med


if __name__ == "__main__":
    main()
