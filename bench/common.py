"""What every contender of the benchmark shares: the config, the data and the clock.

Why a shared module: the ratios only mean something if every contender trains the
same model on the same tokens and is timed the same way. The parent
(``bench/run.py``) writes the config and the token array once; each contender is a
separate process that reads them, trains, and writes a :class:`ContenderResult`.

Timing contract (the same for all contenders): the contender marks a *boundary* at
step 1 and at every multiple of ``window`` steps, after making sure the step has
finished (a device sync for JAX, nothing for eager torch on CPU). Steady tokens/s is
the median over windows after the first one (which holds compilation / warm-up);
time to first step is wall time from the moment the parent launched the process
(interpreter start, imports, model build and compilation included) to boundary 1.
This module imports nothing heavy so every venv can use it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: env var holding the parent's ``time.time()`` at process launch
T0_ENV = "SCALETRAIN_BENCH_T0"


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark setting: a Llama, a batch shape, a step count and a dtype policy."""

    vocab_size: int = 8192
    hidden_size: int = 256
    intermediate_size: int = 1024
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    seq_len: int = 256
    batch_size: int = 8
    steps: int = 25
    window: int = 5
    dtype: str = "float32"  # compute dtype
    param_dtype: str = "float32"  # master weights
    learning_rate: float = 3e-4
    seed: int = 0
    data: str = "random"  # "random" tokens or the bundled "corpus"

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    def boundaries(self) -> list[int]:
        """Steps after which every contender reads the clock (step 1, then each window)."""
        marks = [1] + list(range(self.window, self.steps + 1, self.window))
        return sorted(set(m for m in marks if m <= self.steps))

    def hf_config(self) -> dict[str, Any]:
        """The model as a transformers ``LlamaConfig`` dict (also what EasyDeL takes)."""
        return dict(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            max_position_embeddings=max(self.seq_len, 256),
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
        )

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> BenchConfig:
        return cls(**json.loads(text))


def make_tokens(cfg: BenchConfig) -> np.ndarray:
    """``[steps * batch, seq]`` int32 tokens: seeded random, or the bundled Shakespeare.

    Random tokens are the default: no tokenizer differences, and the speed of a dense
    step does not depend on the token values. ``corpus`` tokenizes the corpus shipped
    in ``scaletrain/assets`` with the bundled tokenizer (ids folded into the vocab).
    """
    rows = cfg.steps * cfg.batch_size
    if cfg.data == "random":
        rng = np.random.default_rng(cfg.seed)
        return rng.integers(0, cfg.vocab_size, size=(rows, cfg.seq_len), dtype=np.int32)
    if cfg.data == "corpus":
        from tokenizers import Tokenizer

        from scaletrain.data.corpus import bundled_tokenizer_path, load_bundled_corpus

        tok = Tokenizer.from_file(os.path.join(bundled_tokenizer_path(), "tokenizer.json"))
        texts = load_bundled_corpus()[:64]
        ids = np.concatenate([np.asarray(e.ids, np.int32) for e in tok.encode_batch(texts)])
        need = rows * cfg.seq_len
        ids = np.resize(ids, need) % cfg.vocab_size
        return ids.reshape(rows, cfg.seq_len).astype(np.int32)
    raise ValueError(f"unknown data {cfg.data!r}: use random or corpus")


@dataclass
class ContenderResult:
    """What a contender process reports back to the parent (JSON)."""

    name: str
    boundaries: list[int] = field(default_factory=list)  # step numbers
    times: list[float] = field(default_factory=list)  # perf_counter at each boundary
    cpu_times: list[float] = field(default_factory=list)  # process CPU seconds (all threads) at each boundary
    first_step_s: float | None = None  # from process launch to the end of step 1
    peak_rss_mb: float | None = None
    final_loss: float | None = None
    info: dict[str, Any] = field(default_factory=dict)

    def steady_tokens_per_s(self, tokens_per_step: int) -> float | None:
        """Median tokens/s over the windows after the first (the first holds warm-up)."""
        rates = self.window_rates(tokens_per_step)[1:]
        return statistics.median(rates) if rates else None

    def steady_tokens_per_cpu_s(self, tokens_per_step: int) -> float | None:
        """Median tokens per CPU-second (this process's threads) over the steady windows.

        Less sensitive than wall time to other processes on a shared machine (but
        spin-waiting threads count as busy), so it is reported next to tokens/s.
        """
        rates = self.window_rates(tokens_per_step, self.cpu_times)[1:]
        return statistics.median(rates) if rates else None

    def window_rates(self, tokens_per_step: int, clock: list[float] | None = None) -> list[float]:
        """Tokens per second of ``clock`` (wall by default) in each window between boundaries."""
        times = self.times if clock is None else clock
        out = []
        for (s0, t0), (s1, t1) in zip(zip(self.boundaries, times), zip(self.boundaries[1:], times[1:])):
            if t1 > t0:
                out.append((s1 - s0) * tokens_per_step / (t1 - t0))
        return out


class StepClock:
    """Records boundaries inside a contender; ``mark(step)`` after the step has finished."""

    def __init__(self, name: str, cfg: BenchConfig):
        self.cfg = cfg
        self.result = ContenderResult(name)
        self._marks = set(cfg.boundaries())
        self._launch = float(os.environ.get(T0_ENV, time.time()))

    def wants(self, step: int) -> bool:
        """Is ``step`` a boundary (the caller must sync before calling :meth:`mark`)."""
        return step in self._marks

    def mark(self, step: int) -> None:
        now = time.perf_counter()
        self.result.cpu_times.append(time.process_time())
        if step == 1:
            self.result.first_step_s = time.time() - self._launch
        self.result.boundaries.append(step)
        self.result.times.append(now)

    def finish(self, path: str, final_loss: float | None = None, **info: Any) -> None:
        """Write the result JSON to ``path`` (peak RSS of this process included)."""
        self.result.peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
        self.result.final_loss = None if final_loss is None else float(final_loss)
        self.result.info.update(info)
        with open(path, "w") as f:
            json.dump(dataclasses.asdict(self.result), f)


def contender_args(argv: list[str] | None = None) -> tuple[BenchConfig, str, str]:
    """``--config FILE --tokens FILE.npy --out FILE``: the contract of every contender script."""
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--tokens", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--variant", default="")
    a, _ = p.parse_known_args(argv if argv is not None else sys.argv[1:])
    with open(a.config) as f:
        cfg = BenchConfig.from_json(f.read())
    return cfg, a.tokens, a.out


def variant_arg(argv: list[str] | None = None) -> str:
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--variant", default="")
    a, _ = p.parse_known_args(argv if argv is not None else sys.argv[1:])
    return a.variant


def host_memory_gb(field: str = "VmHWM") -> float | None:
    """This process's peak (``VmHWM``) or current (``VmRSS``) resident memory in GB (1e9 bytes).

    Why /proc/self/status and not ``getrusage``: the kernel's high-water mark can be
    reset (:func:`reset_host_peak`), so one process can measure the peak of each phase
    (one compile each) on its own. None where there is no /proc (not Linux).
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024 / 1e9  # the kernel reports kB (KiB)
    except OSError:
        pass
    return None


def reset_host_peak() -> bool:
    """Lower this process's ``VmHWM`` to its current RSS (``5`` to /proc/self/clear_refs, Linux ≥ 4.0).

    Returns False where the kernel does not allow it: the next peak is then the
    process's peak since it started, an upper bound of the phase's.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def write_record(record: dict[str, Any], name: str, out: str | None = None) -> str:
    """Write a benchmark's JSON to ``out`` or ``bench/results/<name>-<date>.json``; return the path.

    Why here: every benchmark keeps its raw numbers next to the docs table they feed.
    """
    import datetime as dt

    path = out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                               f"{name}-{dt.date.today().isoformat()}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(record, f, indent=2)
    print(f"wrote {path}")
    return path


def alternate(runs: dict[str, Any], rounds: int, steps: int) -> dict[str, float]:
    """Median wall and CPU seconds per step of each zero-argument ``runs[name]()``, in bursts.

    Every round runs ``steps`` steps of each in turn (A B A B …), so all see the same
    machine; the runs must already be compiled and warm. Keys: ``<name>_wall_s``,
    ``<name>_cpu_s``.
    """
    import jax

    wall: dict[str, list[float]] = {k: [] for k in runs}
    cpu: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(steps):
                out = run()
            jax.block_until_ready(out)
            wall[name].append((time.perf_counter() - t0) / steps)
            cpu[name].append((time.process_time() - c0) / steps)
    result = {f"{k}_wall_s": statistics.median(v) for k, v in wall.items()}
    result.update({f"{k}_cpu_s": statistics.median(v) for k, v in cpu.items()})
    return result
