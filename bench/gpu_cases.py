"""What both systems of ``bench/gpu.py`` share: the model, the cases, the rows and the clock.

Why a module of its own: the side-by-side ratios only mean something if scaletrain's run
and the torch contender (``bench/torch_contender.py``) train the same architecture on the
same rows, with documents laid out the same way, and read the clock at the same steps. Both
workers and the driver import this file, so it imports nothing but numpy (the torch worker
must not pull JAX in, nor the JAX worker torch).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

#: Llama-3.2-1B's architecture (the config.json of meta-llama/Llama-3.2-1B)
LLAMA_1B: dict[str, Any] = dict(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
    rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
    tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001,
)
TINY: dict[str, Any] = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                            tie_word_embeddings=True)

#: case -> (batch, seq, packed). ``single``, ``long`` and ``long32k`` are one sequence per row (plain
#: causal attention); ``packed`` rows hold documents of random length (same-document causal
#: attention). The first three are 16,384 tokens per step; ``long32k`` (32,768) is not run unless
#: named (``--cases long32k``).
CASES: dict[str, tuple[int, int, bool]] = {"single": (8, 2048, False), "packed": (8, 2048, True),
                                           "long": (2, 8192, False), "long32k": (1, 32768, False)}
TINY_CASES: dict[str, tuple[int, int, bool]] = {"single": (2, 32, False), "packed": (2, 32, True),
                                                "long": (1, 64, False), "long32k": (1, 128, False)}
#: the cases run when ``--cases`` is not given (issue 19's three)
DEFAULT_CASES = ("single", "packed", "long")
#: ``bench/gpu.py --rollout``: bench/rollout.py's arguments (random weights of the architecture; both systems
#: sample ``new`` tokens per row, no early stop, at each batch = prompts x generations)
ROLLOUT: dict[str, Any] = dict(arch="llama-1b", prompts=16, batches="16,64", new=64, repeats=3)
TINY_ROLLOUT: dict[str, Any] = dict(arch="tiny", prompts=2, batches="2,4", new=4, repeats=1)
#: ``bench/gpu.py --paged``: the continuous engine at 256 decode slots (its decode attention the Pallas paged
#: kernel on GPU) beside the static engine and transformers' generate, both workloads of bench/rollout.py
#: (fixed: 64 prompts x 4 = 256 rows of ``new`` tokens; long-tailed: 64 prompts x 4, cap 512), per architecture
PAGED_ROLLOUT: dict[str, Any] = dict(archs=("smollm2-135m", "llama-1b"), slots=256, prompts=64, batches="256",
                                     new=128, repeats=3, chat_prompts=64, generations=4, cap=512)
TINY_PAGED_ROLLOUT: dict[str, Any] = dict(archs=("tiny",), slots=4, prompts=2, batches="4", new=4, repeats=1,
                                          chat_prompts=2, generations=2, cap=8)
#: shortest and longest document of a packed row (tokens)
DOC_LENGTHS, TINY_DOC_LENGTHS = (64, 1024), (4, 16)


def process_start_time() -> float:
    """Wall-clock time this process started (Linux /proc), else now."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return boot + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, StopIteration):
        return time.time()


def packed_layout(rows: int, seq: int, shortest: int, longest: int) -> tuple[Any, Any]:
    """Segment ids (1, 2, ...) and per-document positions [rows, seq] of documents of random lengths.

    As first-fit packing leaves them: documents back to back, the last one cut at the row's end.
    """
    import numpy as np

    rng = np.random.default_rng(1)
    segments = np.zeros((rows, seq), np.int32)
    positions = np.zeros((rows, seq), np.int32)
    for r in range(rows):
        start, doc = 0, 1
        while start < seq:
            n = min(int(rng.integers(shortest, longest + 1)), seq - start)
            segments[r, start:start + n], positions[r, start:start + n] = doc, np.arange(n)
            start, doc = start + n, doc + 1
    return segments, positions


def case_rows(spec: dict[str, Any]) -> tuple[Any, Any, Any]:
    """``(tokens, segments, positions)``, int32 ``[steps * batch, seq]``: step ``s`` trains rows
    ``s * batch`` to ``(s + 1) * batch`` in both systems (scaletrain's loader does not shuffle here).

    Random tokens (seed 0): the speed of a dense step does not depend on their values. Rows of one
    sequence have one segment and positions 0..seq-1.
    """
    import numpy as np

    rows, seq = spec["steps"] * spec["batch"], spec["seq"]
    tokens = np.random.default_rng(0).integers(0, spec["arch"]["vocab_size"], (rows, seq), dtype=np.int32)
    if spec["packed"]:
        segments, positions = packed_layout(rows, seq, *spec["doc_lengths"])
    else:
        segments = np.ones_like(tokens)
        positions = np.broadcast_to(np.arange(seq, dtype=np.int32), tokens.shape).copy()
    return tokens, segments, positions


def clock_marks(steps: int, window: int) -> list[int]:
    """Steps after which a worker reads the clock: step 1 (compilation ends there), then every ``window``."""
    return sorted({1, *range(window, steps + 1, window)})


def steady_rate(times: dict[int, float], tokens_per_step: int) -> tuple[float, list[float]]:
    """Median tokens/s over the windows after the first (which holds the warm-up), and every window's rate."""
    done = sorted(times)
    rates = [(s1 - s0) * tokens_per_step / (times[s1] - times[s0]) for s0, s1 in zip(done, done[1:])]
    steady = rates[1:] or rates
    return (statistics.median(steady) if steady else float("nan")), rates
