"""Host memory and bytes read when a checkpoint is loaded for export: the parameters alone vs the whole state.

``python bench/export_memory.py --make DIR [--index 4]`` writes a run folder ``DIR`` with
one checkpoint (step 1) of the ``bench/scaling.py`` model at ``scaling_index``: float32
parameters and AdamW moments filled with noise (fresh moments are zeros and would
compress to nothing), as ``Checkpointer`` saves them in a run.

``python bench/export_memory.py DIR [--whole-state]`` loads it in a fresh process and
prints the process's peak RSS (``ru_maxrss``: on CPU the "device" is the host, so this is
what a device would need), its RSS before the load, and the bytes TensorStore read from
disk. Default: ``scaletrain.export.load_checkpoint_model`` (what ``scaletrain export``
runs). ``--whole-state``: the same model restored the way export did before, through
``Checkpointer.restore`` of the whole train state (parameters, moments, step, RNG). The
``scaletrain`` first on ``PYTHONPATH`` is the one measured (it is printed), so the same
command also measures another checkout. Writes ``bench/results/export-memory-<mode>-<date>.json``
(or ``--out``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import resource
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

STEP = 1


def make(directory: str, index: int) -> None:
    """A run folder with one checkpoint of the scaling-index model, as the Trainer lays it out."""
    import jax

    import scaletrain as st
    from scaling import model_at
    from scaletrain.models import LlamaConfig, LlamaForCausalLM, create_sharded_model
    from scaletrain.training.checkpoint import Checkpointer
    from scaletrain.training.optim import make_optimizer, make_schedule
    from scaletrain.training.state import create_train_state

    cfg = LlamaConfig(**model_at(index))
    model, mesh = create_sharded_model(LlamaForCausalLM, cfg)
    args = st.TrainingArguments(output_dir=directory, max_training_steps=10, num_train_epochs=None)
    state = create_train_state(model, make_optimizer(args, make_schedule(args, 10)), mesh)
    key = jax.random.key(0)
    noisy = jax.jit(lambda t: jax.tree.map(
        lambda x: x + 1e-3 * jax.random.normal(key, x.shape, x.dtype) if x.dtype.kind == "f" and x.ndim else x, t))
    state = state.replace(opt_state=noisy(state.opt_state))
    meta = {"config": cfg.to_dict(), "arguments": args.model_dump(mode="json"), "lora": None}
    checkpointer = Checkpointer.for_run(directory)
    path = checkpointer.save(STEP, state, {}, meta)
    checkpointer.close()
    params = sum(x.nbytes for x in jax.tree.leaves(state.params))
    whole = sum(x.nbytes for x in jax.tree.leaves((state.step, state.params, state.opt_state, state.rng)))
    print(f"wrote {path}: {state.num_params / 1e6:.1f}M parameters, {params / 2**20:.0f} MiB of parameters, "
          f"{whole / 2**20:.0f} MiB of train state")


def _whole_state(directory: str) -> Any:
    """Export's load before ``restore_params``: the whole train state restored into an abstract template."""
    from scaletrain.arguments import TrainingArguments
    from scaletrain.models import get_modules_by_type
    from scaletrain.models.factory import abstract_sharded_model, mesh_for_config
    from scaletrain.training.checkpoint import Checkpointer
    from scaletrain.training.optim import make_optimizer, make_schedule
    from scaletrain.training.state import abstract_train_state

    checkpointer = Checkpointer(os.path.join(directory, "checkpoints"))
    meta = checkpointer.read_meta(STEP)
    config_class, module_class = get_modules_by_type(meta["config"].get("model_type", "llama"))
    config = config_class.from_dict(meta["config"])
    args = TrainingArguments(**meta["arguments"])
    mesh = mesh_for_config(config)
    graphdef, params = abstract_sharded_model(module_class, config, dtype=args.dtype, param_dtype=args.param_dtype,
                                              mesh=mesh)
    tx = make_optimizer(args, make_schedule(args, max(args.max_training_steps or 1, 1)))
    state, _, _ = checkpointer.restore(STEP, abstract_train_state(graphdef, params, tx, mesh))
    checkpointer.close()
    return state.model


def _bytes_read() -> int:
    import tensorstore as ts

    found = ts.experimental_collect_matching_metrics("/tensorstore/kvstore/file/bytes_read")
    return sum(int(v.get("value", 0)) for m in found for v in m["values"])


def load(directory: str, whole_state: bool, out: str | None = None) -> dict[str, Any]:
    import jax
    import numpy as np
    from flax import nnx

    import scaletrain
    from scaletrain.export import load_checkpoint_model

    jax.devices()  # start the backend before the "before" reading
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    read_before, t0 = _bytes_read(), time.perf_counter()
    model = _whole_state(directory) if whole_state else load_checkpoint_model(directory, STEP)[0]
    params = jax.block_until_ready(nnx.to_pure_dict(nnx.state(model)))
    seconds = time.perf_counter() - t0
    row = {"scaletrain": os.path.dirname(scaletrain.__file__), "mode": "whole state" if whole_state else "export",
           "params_mib": sum(x.nbytes for x in jax.tree.leaves(params)) / 2**20,
           "peak_rss_before_mib": rss_before / 1024, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
           "read_mib": (_bytes_read() - read_before) / 2**20, "load_s": seconds,
           "checksum": float(sum(np.asarray(x, np.float64).sum() for x in jax.tree.leaves(params)))}
    for key, value in row.items():
        print(f"{key:>20}: {value:.1f}" if isinstance(value, float) else f"{key:>20}: {value}")
    from common import write_record

    row["load_1min"] = os.getloadavg()[0]
    write_record({"date": dt.datetime.now().isoformat(timespec="seconds"),
                  "command": "python bench/export_memory.py " + " ".join(sys.argv[1:]), "rows": [row]},
                 "export-memory-" + row["mode"].replace(" ", "-"), out)
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("directory")
    p.add_argument("--make", action="store_true", help="write the run folder instead of loading it")
    p.add_argument("--index", type=int, default=4, help="scaling_index of the model --make writes")
    p.add_argument("--whole-state", action="store_true", help="restore the whole train state, as export did before")
    p.add_argument("--out", default=None, help="where the JSON record goes")
    a = p.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if a.make:
        make(os.path.abspath(a.directory), a.index)
    else:
        load(os.path.abspath(a.directory), a.whole_state, a.out)


if __name__ == "__main__":
    main()
