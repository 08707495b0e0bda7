"""``scaletrain plot RUN_DIR``: loss, learning rate and throughput against step, as a PNG; for a GRPO run
(records with a ``reward``) the mean reward too, with its running mean over 5 rollouts. ``--metric NAME``
draws one logged figure alone (``reward``, ``rewards/exact_answer/mean``, ``kl``, ...), with the same running mean.

The loss panel says what the loss is: nats per token only for a token-level loss (records with a
``perplexity``); a GRPO loss is a clipped policy-gradient surrogate and a preference loss is per pair."""

from __future__ import annotations

import json
import os

from scaletrain.errors import ConfigError, DataError


def read_metrics(run_dir: str) -> tuple[list[dict], list[dict]]:
    """Train and eval records of ``metrics.jsonl``, one per step.

    The file is append-only: a resumed run, or a Ray group restarted after a failure
    (which first writes a ``{"split": "restart", "resumed_from_step": N}`` marker), logs
    again the steps after its checkpoint. The later line for a step wins: it is the one
    the run's final state descends from. Markers and samples are not returned.
    """
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise DataError(f"no metrics.jsonl in {run_dir}")
    train: dict[int, dict] = {}
    evals: dict[int, dict] = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            try:
                rec = json.loads(line)
            except ValueError:
                raise DataError(f"{path}: line {n} is not JSON") from None
            if rec.get("split") == "eval":
                evals[rec["step"]] = rec
            elif rec.get("split") == "train":
                train[rec["step"]] = rec
    return [train[k] for k in sorted(train)], [evals[k] for k in sorted(evals)]


def loss_title(train: list[dict]) -> str:
    """The loss panel's title: its unit where it has one (see the module docstring)."""
    if any("perplexity" in r for r in train):
        return "loss (nats/token)"
    if any("reward" in r for r in train):
        return "loss (GRPO objective, not a likelihood)"
    return "loss"


def metric_points(train: list[dict], metric: str, where: str) -> tuple[list[int], list[float]]:
    """``(steps, values)`` of ``metric`` in the train records that log it; DataError naming the figures there are."""
    points = [(r["step"], float(r[metric])) for r in train
              if isinstance(r.get(metric), (int, float)) and not isinstance(r.get(metric), bool)]
    if not points:
        names = sorted({k for r in train for k, v in r.items()
                        if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("step", "epoch")})
        raise DataError(f"--metric {metric!r}: {where} logs no such figure; it logs {', '.join(names)}")
    return [s for s, _ in points], [v for _, v in points]


def _with_running_mean(ax: object, at: list[int], values: list[float], label: str, window: int = 5) -> None:
    smooth = [sum(values[max(0, i - window + 1):i + 1]) / len(values[max(0, i - window + 1):i + 1])
              for i in range(len(values))]
    ax.plot(at, values, ".", alpha=0.5, label=label)  # type: ignore[attr-defined]
    ax.plot(at, smooth, "-", label=f"running mean ({window})")  # type: ignore[attr-defined]
    ax.legend()  # type: ignore[attr-defined]


def plot_run(run_dir: str, out: str | None = None, metric: str | None = None) -> str:
    """Draw the run's curves into ``out`` (default ``<run_dir>/metrics.png``), or with ``metric`` that one figure
    against step (default ``<run_dir>/<metric>.png``, "/" read as "_")."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("plotting needs matplotlib: pip install 'scaletrain[plot]'") from None
    train, evals = read_metrics(run_dir)
    if not train:
        raise DataError(f"{run_dir}/metrics.jsonl has no train records")
    if metric is not None:
        at, values = metric_points(train, metric, f"{run_dir}/metrics.jsonl")
        fig, ax = plt.subplots(1, 1, figsize=(8, 4))
        _with_running_mean(ax, at, values, metric)
        ax.set(title=f"{metric} ({os.path.basename(os.path.abspath(run_dir))})", xlabel="step")
        fig.tight_layout()
        out = out or os.path.join(run_dir, metric.replace("/", "_") + ".png")
        fig.savefig(out, dpi=100)
        plt.close(fig)
        return out
    steps = [r["step"] for r in train]
    rewards = [(r["step"], r["reward"]) for r in train if r.get("reward") is not None]
    fig, axes = plt.subplots(1, 4 if rewards else 3, figsize=(20 if rewards else 15, 4))
    axes[0].plot(steps, [r["loss"] for r in train], label="train")
    if evals:
        axes[0].plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval")
    axes[0].set(title=loss_title(train), xlabel="step")
    axes[0].legend()
    axes[1].plot(steps, [r["learning_rate"] for r in train])
    axes[1].set(title="learning rate", xlabel="step")
    axes[2].plot(steps, [r["tokens_per_s"] for r in train])
    axes[2].set(title="tokens/s", xlabel="step")
    if rewards:  # GRPO: one figure per rollout (every num_iterations steps)
        _with_running_mean(axes[3], [s for s, _ in rewards], [v for _, v in rewards], "reward")
        axes[3].set(title="reward (mean over completions)", xlabel="step")
    fig.suptitle(os.path.basename(os.path.abspath(run_dir)))
    fig.tight_layout()
    out = out or os.path.join(run_dir, "metrics.png")
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
