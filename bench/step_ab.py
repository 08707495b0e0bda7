"""scaletrain's jitted train step against the bare loop's step, alternating in one process.

``python bench/step_ab.py [--rounds 6] [--steps 3] [--dtype float32]``

Why in one process: on a shared 2-core machine two processes run minutes apart see
different neighbours, and the Trainer-level ratio in ``bench/run.py`` moves by ±10%
from one window to the next. Alternating short bursts of the two compiled steps
(the same ones ``bench/profile_step.py`` traces) puts both under the same load, so
the ratio isolates what each step computes; the Trainer's loop around it is what
``bench/run.py`` adds.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--dtype", default="float32")
    a = p.parse_args(argv)
    import jax

    from common import alternate
    from profile_step import build_steps

    steps = build_steps(a.dtype, 8, 256)
    for step in steps.values():  # compile and warm up
        for _ in range(2):
            jax.block_until_ready(step())
    result = alternate(steps, a.rounds, a.steps)
    result["vs_bare_jax"] = result["bare_jax_wall_s"] / result["scaletrain_wall_s"]
    result["cpu_vs_bare_jax"] = result["bare_jax_cpu_s"] / result["scaletrain_cpu_s"]
    for k, v in result.items():
        print(f"{k:<22}{v:.4f}")
    return result


if __name__ == "__main__":
    main()
