"""Contender: the bare jitted JAX loop (flax nnx + optax) a careful user would write.

It reuses scaletrain's Llama module, so the model maths is identical and only the
framework around it differs: no Trainer, no callbacks, no metrics but the loss, no
sharding machinery. The optimizer is the same chain as scaletrain's default
(global-norm clip 1.0, AdamW b1=0.9 b2=0.95, constant learning rate); the state is
donated; the loss is the plain mean next-token cross-entropy in float32. ``run.py``
starts it with the same glibc huge-page tunable as scaletrain (``GLIBC_TUNABLES``), so
the two differ only in the framework around the step; its result says whether it was on.
"""

from __future__ import annotations

import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# appended, not prepended: PYTHONPATH (set by run.py, e.g. to a baseline checkout) wins
sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from common import StepClock, contender_args  # noqa: E402


def main() -> None:
    cfg, tokens_path, out = contender_args()
    clock = StepClock("bare_jax", cfg)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    from scaletrain.models import LlamaConfig, LlamaForCausalLM

    tokens = np.load(tokens_path)
    mcfg = LlamaConfig(**cfg.hf_config())
    model = LlamaForCausalLM(mcfg, dtype=jnp.dtype(cfg.dtype), param_dtype=jnp.dtype(cfg.param_dtype),
                             rngs=nnx.Rngs(cfg.seed))
    graphdef, params = nnx.split(model)
    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(cfg.learning_rate, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.0))
    opt_state = tx.init(params)

    def loss_fn(p, ids):
        logits = nnx.merge(graphdef, p)(ids)
        return optax.softmax_cross_entropy_with_integer_labels(
            logits[:, :-1].astype(jnp.float32), ids[:, 1:]).mean()

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(p, o, ids):
        loss, grads = jax.value_and_grad(loss_fn)(p, ids)
        updates, o = tx.update(grads, o, p)
        return optax.apply_updates(p, updates), o, loss

    b = cfg.batch_size
    loss = None
    for i in range(cfg.steps):
        params, opt_state, loss = train_step(params, opt_state, jnp.asarray(tokens[i * b:(i + 1) * b]))
        if clock.wants(i + 1):
            loss.block_until_ready()
            clock.mark(i + 1)
    clock.finish(out, final_loss=float(loss), devices=jax.device_count(), backend=jax.default_backend(),
                 glibc_tunables=os.environ.get("GLIBC_TUNABLES", ""))


if __name__ == "__main__":
    main()
