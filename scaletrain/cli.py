"""``scaletrain`` command line: ``train``, ``generate``, ``export`` and ``plot``.

User errors (:class:`ScaletrainError`) print one message and exit with status 2;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from scaletrain import __version__
from scaletrain.errors import ScaletrainError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scaletrain", description="Train language models in JAX.")
    p.add_argument("--version", action="version", version=f"scaletrain {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train as a YAML recipe says")
    t.add_argument("recipe", help="path to the recipe YAML")
    t.add_argument("overrides", nargs="*", help="dotted overrides, e.g. training.max_training_steps=50")
    g = sub.add_parser("generate", help="continue a prompt with a Hugging Face model folder")
    g.add_argument("model_dir")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn (chat template)")
    e = sub.add_parser("export", help="write a run's checkpoint as a Hugging Face folder")
    e.add_argument("run_dir", help="run folder, its checkpoints folder, or one step folder")
    e.add_argument("--checkpoint", type=int, default=None, help="step (default: the newest)")
    e.add_argument("--out", required=True)
    e.add_argument("--max-shard-size", default="2GB")
    pl = sub.add_parser("plot", help="draw loss, learning rate and throughput of a run into a PNG")
    pl.add_argument("run_dir")
    pl.add_argument("--out", default=None)
    return p


def _setup_logging() -> None:
    # transformers advises at import that torch is missing; scaletrain never needs it
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    for noisy in ("jax._src.xla_bridge", "absl", "orbax", "jax._src.distributed"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def cmd_train(ns: argparse.Namespace) -> int:
    from scaletrain.recipe import Recipe
    from scaletrain.run import run_training

    recipe = Recipe.load(ns.recipe, ns.overrides)
    summary = run_training(recipe)
    keys = ("final_step", "final_train_loss", "final_eval_loss", "final_eval_bits_per_byte", "tokens_per_s", "mfu")
    print("\n".join(f"{k:26s} {summary.get(k)}" for k in keys))
    if "sample" in summary:
        print("\n--- sample ---\n" + summary["sample"] + "\n--------------")
    return 0


def cmd_generate(ns: argparse.Namespace) -> int:
    from scaletrain.cli_hf import generate_main

    print(generate_main(ns.model_dir, ns.prompt, max_new_tokens=ns.max_new_tokens, temperature=ns.temperature,
                        top_k=ns.top_k, top_p=ns.top_p, seed=ns.seed, chat=ns.chat))
    return 0


def cmd_export(ns: argparse.Namespace) -> int:
    from scaletrain.export import export_checkpoint

    print(export_checkpoint(ns.run_dir, ns.out, step=ns.checkpoint, max_shard_size=ns.max_shard_size))
    return 0


def cmd_plot(ns: argparse.Namespace) -> int:
    from scaletrain.plot import plot_run

    print(plot_run(ns.run_dir, ns.out))
    return 0


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    _setup_logging()
    commands = {"train": cmd_train, "generate": cmd_generate, "export": cmd_export, "plot": cmd_plot}
    try:
        return commands[ns.command](ns)
    except ScaletrainError as err:
        print(f"scaletrain: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
