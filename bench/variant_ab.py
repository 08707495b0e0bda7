"""Two variants of scaletrain's own train step, alternating in one process.

``python bench/variant_ab.py "attention.MAX_CAUSAL_BLOCKS = 1" "attention.MAX_CAUSAL_BLOCKS = 2" [--rounds 8]``

Each argument is a Python statement run just before that variant's step is built and
compiled (:func:`stepfn.scaletrain_step`, the exact step the Trainer compiles), with
``llama``, ``attention``, ``flash_attention`` and ``flash_sharding`` (``scaletrain.models``; e.g.
``"flash_sharding.BLOCK_Q = 128"``, ``"flash_attention.NUM_STAGES = 3"``), ``loss`` and ``steps``
(``scaletrain.training``) in scope; a statement that binds ``opts`` to a dict passes it to XLA as that variant's
compiler options (``"opts = {'xla_cpu_enable_fast_math': True}"``), one that binds ``model``
to a dict overrides the model config's fields (``"model = {'attn_mechanism': 'pallas'}"``), one that sets
``tokens_only = True`` feeds that variant batches of ``input_ids`` alone. Module constants read at trace time are how a model-level change is
switched off and on without two checkouts. Both compiled steps then alternate in
bursts, so both see the same machine: on this VM the same step's speed drifts by
±25% over tens of minutes, far more than the changes being compared.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))


def build(statement: str, batch: int, seq: int, dtype: str, tiny: bool = False) -> Callable[[], Any]:
    """Run ``statement``, then compile and warm up the train step it affects."""
    import jax

    import scaletrain.models.kernels.attention as attention
    import scaletrain.models.kernels.flash_attention as flash_attention
    import scaletrain.models.kernels.flash_sharding as flash_sharding
    import scaletrain.models.llama as llama
    import scaletrain.objectives.loss as loss
    import scaletrain.training.steps as steps
    from common import BenchConfig
    from stepfn import scaletrain_step

    scope: dict[str, Any] = {"llama": llama, "attention": attention, "flash_attention": flash_attention,
                             "flash_sharding": flash_sharding, "loss": loss, "steps": steps}
    exec(statement, scope)  # noqa: S102 - the benchmark's own input
    if tiny:
        from run import TINY

        config = BenchConfig(**TINY)
    else:
        config = BenchConfig(seq_len=seq, batch_size=batch)
    model = {**config.hf_config(), **scope.get("model", {})}
    step = scaletrain_step(model, config.batch_size, config.seq_len, dtype=dtype,
                           compiler_options=scope.get("opts"), tokens_only=bool(scope.get("tokens_only")))
    for _ in range(2):
        jax.block_until_ready(step.run())
    return step.run


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a", help="statement for variant A")
    p.add_argument("b", help="statement for variant B")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=3, help="steps per burst")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tiny", action="store_true", help="a toy model (for tests): only checks the plumbing")
    a = p.parse_args(argv)
    from common import alternate

    runs = {name: build(statement, a.batch, a.seq, a.dtype, a.tiny) for name, statement in (("A", a.a), ("B", a.b))}
    result = alternate(runs, a.rounds, a.steps)
    result["b_over_a_speed_wall"] = result["A_wall_s"] / result["B_wall_s"]
    result["b_over_a_speed_cpu"] = result["A_cpu_s"] / result["B_cpu_s"]
    for k, v in result.items():
        print(f"{k:<22}{v:.4f}")
    return result


if __name__ == "__main__":
    main()
