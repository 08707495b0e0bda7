"""Multi-head latent attention's decode step over latent pages: the absorbed form against expanding every
cached latent per step, side by side in one process, on the tiny and a mid-size configuration.

``python bench/mla_decode.py [--slots 16 --lengths 256,1024 --rounds 5 --steps 10]``

Both forms take the same queries and the same gathered latent entries ``[slots, S, 1, rank + rope]`` (what
the continuous engine's pages hold) and give the same attention output (checked first, float32):

- **absorbed** (:meth:`LatentAttention.absorbed_attention`, the engine's): ``kv_b_proj``'s key half folded into
  the queries, every head attends over the shared latents, the value half applied after;
- **expanded** (:meth:`LatentAttention.expanded_attention`): ``kv_b_proj`` applied to every cached latent, then
  per-head attention, as a cache of expanded keys and values would hold them.

Printed: milliseconds per call (median of ``--rounds`` bursts of ``--steps`` calls, each form alternated) and
the expanded/absorbed ratio, one JSON line per (config, length).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from common import alternate  # noqa: E402

#: the tiny configuration of tests/test_continuous_batching.py and a mid-size one (DeepSeek-V2-Lite's attention:
#: 16 heads, rank 512, nope 128, rope 64, v 128, hidden 2048)
CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=32, num_attention_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
                 qk_nope_head_dim=8, v_head_dim=8),
    "mid": dict(hidden_size=2048, num_attention_heads=16, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
                qk_nope_head_dim=128, v_head_dim=128),
}


def measure(name: str, slots: int, length: int, rounds: int, steps: int) -> dict[str, Any]:
    """Both forms of one layer's decode attention at ``slots`` × ``length`` cached tokens."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from scaletrain.models.common.inputs import LayerInputs
    from scaletrain.models.common.latent_attention import LatentAttention
    from scaletrain.models.deepseek_v3 import DeepseekV3Config
    from scaletrain.models.kernels.paged_attention import paged_mask

    cfg = DeepseekV3Config(vocab_size=64, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=1,
                           n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                           **CONFIGS[name])
    layer = LatentAttention(cfg, jnp.float32, jnp.float32, None, nnx.Rngs(0))
    graphdef, params = nnx.split(layer)
    rs = np.random.RandomState(0)
    n, qk = cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    q = jnp.asarray(rs.standard_normal((slots, 1, n, qk)), jnp.float32)
    entries = jnp.asarray(rs.standard_normal((slots, length, 1, LatentAttention.latent_width(cfg))), jnp.float32)
    mask = paged_mask(jnp.asarray(rs.randint(length // 2, length, slots), jnp.int32), length, None)

    absorbed = jax.jit(lambda p, q, e, m: nnx.merge(graphdef, p).absorbed_attention(q, e, LayerInputs(m, None, None)))
    expanded = jax.jit(lambda p, q, e, m: nnx.merge(graphdef, p).expanded_attention(q, e, m))
    a, b = absorbed(params, q, entries, mask), expanded(params, q, entries, mask)
    err = float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
    # alternated bursts (bench/common.py): both forms see the same machine load
    timed = alternate({"absorbed": lambda: absorbed(params, q, entries, mask),
                       "expanded": lambda: expanded(params, q, entries, mask)}, rounds, steps)
    ms = {k: 1e3 * timed[f"{k}_wall_s"] for k in ("absorbed", "expanded")}
    return dict(config=name, slots=slots, cached_tokens=length, absorbed_ms=round(ms["absorbed"], 3),
                expanded_ms=round(ms["expanded"], 3), expanded_over_absorbed=round(ms["expanded"] / ms["absorbed"], 2),
                max_rel_diff=err)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default="tiny,mid")
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--lengths", default="256,1024")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    for name in args.configs.split(","):
        for length in (int(x) for x in args.lengths.split(",")):
            print(json.dumps(measure(name, args.slots, length, args.rounds, args.steps)), flush=True)


if __name__ == "__main__":
    main()
