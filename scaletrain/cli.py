"""``scaletrain`` command line: ``train RECIPE [key=value ...]``.

User errors (:class:`ScaletrainError`) print one message and exit with status 2;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import logging
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
    return p


def _setup_logging() -> None:
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


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    _setup_logging()
    try:
        return {"train": cmd_train}[ns.command](ns)
    except ScaletrainError as err:
        print(f"scaletrain: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
