"""scaletrain's side of ``bench/preference.py``: SFT and DPO steps on the same pairs, one process.

``python bench/contenders/scaletrain_preference.py --spec FILE --out FILE``. Each variant
loads the model folder, builds the exact step the Trainer jits
(``make_step_functions`` over ``create_train_state`` with the variant's objective) and
compiles it; then, for each line the parent writes to stdin (one per round, between
TRL's runs), every variant runs ``steps`` steps in turn (:func:`common.alternate`), so
all see the same machine. Variants:

- ``sft``: the LM objective over chosen and rejected rows as one ``[2B, L]`` batch,
  loss on completion tokens: the same tokens as a DPO step, without the reference.
- ``lora-sft``: the same with rank-``lora_rank`` adapters on every linear layer.
- ``dpo-frozen``: the DPO objective (sigmoid, ``beta``) over the same pairs, the reference a
  frozen copy of the starting weights in ``TrainState.frozen_models``;
- ``dpo-precomputed``: the same with the reference's log-probabilities in the batch
  (computed once, before the timed steps), no reference model;
- ``lora-dpo-adapters-off``: LoRA-DPO, the reference the base with its adapters off.

Reported per variant: median seconds per step, XLA's compiled peak (arguments +
temporaries + outputs not aliased to arguments), the bytes of the trained parameters
(and frozen base), of the optimizer state and of any reference weights the state holds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)

from common import alternate  # noqa: E402


def _bytes(tree: Any) -> int:
    import jax

    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree) if hasattr(x, "addressable_shards"))


def load_model(spec: dict[str, Any], lora: bool) -> Any:
    """The folder's model, float32, on one device's mesh, with LoRA adapters when ``lora``."""
    from scaletrain.models.registry import AutoModelForCausalLM
    from scaletrain.peft.lora import LoRAConfig, apply_lora

    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype="float32", param_dtype="float32",
                                                 sharding_axis_dims=(1, -1, 1, 1, 1))
    if lora:
        apply_lora(model, LoRAConfig(rank=spec["lora_rank"], alpha=2 * spec["lora_rank"],
                                     target_modules="all-linear"))
    return model


def sft_batches(arrays: dict[str, Any], batch: int) -> list[dict[str, Any]]:
    """Chosen and rejected rows of each batch of pairs stacked into one ``[2B, L]`` LM batch."""
    import numpy as np

    n = arrays["chosen_input_ids"].shape[0] // batch
    out = []
    for i in range(n):
        rows = slice(i * batch, (i + 1) * batch)
        out.append({key: np.concatenate([arrays[f"chosen_{key}"][rows], arrays[f"rejected_{key}"][rows]])
                    for key in ("input_ids", "segment_ids", "loss_mask")})
    return out


#: DPO variant -> where its reference log-probabilities come from (``DPOObjective.reference_source``)
DPO_REFERENCE = {"dpo-frozen": "model", "dpo-precomputed": "precomputed", "lora-dpo-adapters-off": "adapters_off"}


def pair_batches(arrays: dict[str, Any], batch: int) -> list[dict[str, Any]]:
    """The preference batch keys of each batch of ``batch`` pairs."""
    n = arrays["chosen_input_ids"].shape[0] // batch
    return [{key: value[i * batch:(i + 1) * batch] for key, value in arrays.items()} for i in range(n)]


def with_reference_logps(state: Any, batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each batch with ``ref_chosen_logps`` / ``ref_rejected_logps`` of the starting model (what
    ``precompute_ref_log_probs`` stores before training), computed here outside the timed steps."""
    import jax
    import numpy as np

    from scaletrain.objectives.dpo import DPOObjective
    from scaletrain.objectives.logps import row_logps

    inputs = DPOObjective().reference_inputs
    score = jax.jit(lambda st, b: {k: row_logps(st.model, *rows) for k, rows in inputs(b).items()})
    return [{**b, **{k: np.asarray(v, np.float32) for k, v in score(state, b).items()}} for b in batches]


def build(variant: str, spec: dict[str, Any], arrays: dict[str, Any]) -> tuple[Callable[[], Any], dict[str, Any]]:
    """A zero-argument step of ``variant`` (state kept inside, batches cycled) and its memory figures."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    import scaletrain as st
    from scaletrain.models.factory import place_model
    from scaletrain.objectives import LanguageModelObjective
    from scaletrain.objectives.loss import resolve_chunk_size
    from scaletrain.training.optim import make_optimizer, make_schedule
    from scaletrain.training.state import create_train_state, state_shardings
    from scaletrain.training.steps import batch_shardings, make_step_functions

    if variant not in ("sft", "lora-sft", *DPO_REFERENCE):
        raise SystemExit(f"unknown variant {variant!r}")
    model, mesh = place_model(load_model(spec, lora=variant.startswith("lora")))
    length, dpo = spec["max_length"], variant in DPO_REFERENCE
    args = st.TrainingArguments(max_training_steps=1000, num_train_epochs=None, scheduler="constant",
                                total_batch_size=spec["batch"] * (1 if dpo else 2), max_length=length,
                                learning_rate=spec["learning_rate"])
    tx = make_optimizer(args, make_schedule(args, 1000))
    if dpo:
        from scaletrain.objectives.dpo import DPOObjective

        objective: Any = DPOObjective(beta=spec["beta"], reference_source=DPO_REFERENCE[variant])
        batches = pair_batches(arrays, spec["batch"])
    else:
        objective = LanguageModelObjective(chunk_size=resolve_chunk_size("auto", model.config.vocab_size, length))
        batches = sft_batches(arrays, spec["batch"])
    state = create_train_state(model, tx, mesh)
    del model
    if dpo and objective.reference_source == "model":
        from scaletrain.training.frozen import copy_of

        state = state.replace(frozen_models={"reference": copy_of(state.graphdef, state.params, state.frozen)})
    if dpo and objective.reference_source == "precomputed":
        with jax.set_mesh(mesh):
            batches = with_reference_logps(state, batches)
    bs = NamedSharding(mesh, PartitionSpec(*args.step_partition_spec))
    train, _ = make_step_functions(tx, state_shardings(state), bs, NamedSharding(mesh, PartitionSpec()), objective)
    data = [jax.device_put(b, batch_shardings(b, bs)) for b in batches]
    t0 = time.perf_counter()
    with jax.set_mesh(mesh):
        compiled = train.lower(state, data[0]).compile()
    mem = compiled.memory_analysis()
    figures = {"compile_s": time.perf_counter() - t0,
               "compiled_peak_bytes": int(mem.argument_size_in_bytes + mem.temp_size_in_bytes
                                          + mem.output_size_in_bytes - mem.alias_size_in_bytes),
               "params_bytes": _bytes(state.params) + _bytes(state.frozen), "optimizer_bytes": _bytes(state.opt_state),
               "reference_bytes": _bytes(state.frozen_models)}
    box = {"state": state, "i": 0, "metrics": None}

    def step() -> Any:
        with jax.set_mesh(mesh):
            box["state"], box["metrics"] = compiled(box["state"], data[box["i"] % len(data)])
        box["i"] += 1
        return box["metrics"]["loss"]

    return step, figures


def run(spec: dict[str, Any], rounds: Any = None) -> dict[str, Any]:
    """Build every variant, then one timed burst of each per line read from ``rounds`` (stdin).

    Why stdin: the parent runs TRL's process between two bursts, so both are timed on the
    same machine state while every step here is compiled once. Each burst's seconds per
    step are printed as one JSON line; the figures and the medians are returned.
    """
    import statistics

    import jax
    import numpy as np

    with np.load(spec["arrays"]) as f:
        arrays = {k: f[k] for k in f.files}
    steps: dict[str, Callable[[], Any]] = {}
    figures: dict[str, dict[str, Any]] = {}
    for variant in spec["variants"]:
        steps[variant], figures[variant] = build(variant, spec, arrays)
        for _ in range(spec["warmup"]):
            jax.block_until_ready(steps[variant]())
    print(json.dumps({"ready": True}), flush=True)
    bursts: list[dict[str, float]] = []
    for _ in rounds if rounds is not None else sys.stdin:
        bursts.append(alternate(steps, rounds=1, steps=spec["steps"]))
        print(json.dumps(bursts[-1]), flush=True)
    out = {}
    for variant in spec["variants"]:
        loss = float(jax.block_until_ready(steps[variant]()))
        wall = [b[f"{variant}_wall_s"] for b in bursts]
        cpu = [b[f"{variant}_cpu_s"] for b in bursts]
        out[variant] = {**figures[variant], "seconds_per_step": statistics.median(wall), "per_round_seconds": wall,
                        "cpu_seconds_per_step": statistics.median(cpu), "per_round_cpu_seconds": cpu,
                        "loss": loss}
    return {"variants": out, "backend": jax.default_backend()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spec", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    with open(a.spec) as f:
        result = run(json.load(f))
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
