"""One GPU, a real ~1B Llama, bf16 compute: tokens/s, TFLOP/s, MFU, time to first step.

``python bench/gpu.py`` trains Llama-3.2-1B's architecture (hidden 2048, 16 layers,
32 heads / 8 kv heads, head dim 64, intermediate 8192, vocab 128,256, tied
embeddings, llama3 RoPE; 1.24B parameters) on random tokens at sequence 2048 with
``scaletrain.Trainer``: bfloat16 compute, float32 master weights and AdamW state,
cuDNN fused attention where the backend has it (``attn_mechanism="auto"``), the
chunked loss for the 128k vocabulary. MFU is against the device's dense bf16 peak
from ``scaletrain.training.metrics.PEAK_FLOPS`` (989 TFLOP/s for H100/H200).

``--fp8`` runs the q/k/v/o and MLP projections as FP8 GEMMs (``model.fp8``: e4m3 forward,
e5m2 gradients, current per-tensor scaling; cuBLASLt FP8 on Hopper, emulated elsewhere),
for the tokens/s ratio against the bf16 run of the same command; MFU stays against the
bf16 peak, so the two runs' MFUs compare like their tokens/s.

``--tiny`` swaps in a toy model and a few steps so the same code path runs end to
end on a CPU (that is what the test suite does); its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

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
    """Segment ids (1, 2, ...) and per-document positions [rows, seq] of documents of random lengths."""
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


def main(argv: list[str] | None = None) -> dict[str, Any]:
    launched = process_start_time()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="toy model, CPU-friendly (tests the plumbing only)")
    p.add_argument("--steps", type=int, default=None, help="default 30 (tiny: 4)")
    p.add_argument("--window", type=int, default=None, help="steps per timing window (default 5; tiny: 2)")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default 8; tiny: 2)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default 2048; tiny: 32)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--remat", default="none", help="gradient_checkpointing policy (none, full, dots, ...)")
    p.add_argument("--attn", default="auto", help="attn_mechanism: auto (cuDNN on GPU), cudnn, xla")
    p.add_argument("--fp8", action="store_true", help="FP8 projection matmuls (model.fp8; see scaletrain.models.fp8)")
    p.add_argument("--packed", action="store_true",
                   help="rows of several documents (64-1024 tokens; tiny 4-16): segment ids and positions, "
                        "so attention gets the same-document mask (cuDNN: a bias; --attn pallas: segment ids)")
    p.add_argument("--out", default=None, help="result JSON (default bench/results/gpu-<date>.json)")
    a = p.parse_args(argv)
    steps = a.steps or (4 if a.tiny else 30)
    window = a.window or (2 if a.tiny else 5)
    batch = a.batch or (2 if a.tiny else 8)
    seq = a.seq or (32 if a.tiny else 2048)

    import jax
    import numpy as np

    import scaletrain as st
    from scaletrain.data.packing import PackedRows
    from scaletrain.models import LlamaConfig, LlamaForCausalLM, create_sharded_model
    from scaletrain.models.attention import use_fused_attention
    from scaletrain.training.callbacks import memory_stats
    from scaletrain.training.metrics import peak_flops_per_device

    arch = TINY if a.tiny else LLAMA_1B
    cfg = LlamaConfig(**arch, gradient_checkpointing=a.remat, attn_mechanism=a.attn, fp8=a.fp8)
    model, _ = create_sharded_model(LlamaForCausalLM, cfg, dtype=a.dtype, param_dtype="float32")
    rows = steps * batch
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (rows, seq), dtype=np.int32)
    if a.packed:  # documents of random length per row, as first-fit packing leaves them (last one cut)
        segments, positions = packed_layout(rows, seq, *((4, 16) if a.tiny else (64, 1024)))
        data = PackedRows(tokens, segments, positions)
    else:
        data = PackedRows(tokens, np.ones_like(tokens), np.broadcast_to(np.arange(seq, dtype=np.int32),
                                                                        tokens.shape).copy())

    marks = sorted({1, *range(window, steps + 1, window)})
    times: dict[int, float] = {}
    first_step_s: list[float] = []

    class Clock(st.Callback):
        def post_step(self, trainer: Any, step: int, metrics: Any) -> None:
            if step in marks:
                jax.block_until_ready(metrics.device("loss"))
                times[step] = time.perf_counter()
                if step == 1:
                    first_step_s.append(time.time() - launched)

    with tempfile.TemporaryDirectory(prefix="scaletrain-gpu-bench-") as tmp:
        args = st.TrainingArguments(
            output_dir=tmp, total_batch_size=batch, max_length=seq, num_train_epochs=None, max_training_steps=steps,
            learning_rate=3e-4, scheduler="constant", dtype=a.dtype, param_dtype="float32", do_eval=False,
            log_steps=window, progress_bar=False, report_to=(), save_at_end=False,
        )
        trainer = st.Trainer(args, model=model, dataset_train=data, callbacks=[Clock()])
        trainer.train()
        final_loss = trainer.metrics_logger.last_train.get("loss")
        num_params = trainer.model_state.num_params
    done = sorted(times)
    rates = [(s1 - s0) * batch * seq / (times[s1] - times[s0]) for s0, s1 in zip(done, done[1:])]
    steady = rates[1:] or rates
    tps = statistics.median(steady) if steady else float("nan")
    fpt = cfg.flops_per_token(seq)
    peak = peak_flops_per_device()
    device = jax.devices()[0]
    result = {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "command": "python bench/gpu.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "tiny": a.tiny,
        "measured_on": f"{device.platform}: {device.device_kind}",
        "num_params": num_params,
        "config": {"batch": batch, "seq": seq, "steps": steps, "window": window, "dtype": a.dtype,
                   "param_dtype": "float32", "remat": a.remat, "attn_mechanism": a.attn, "fp8": a.fp8,
                   "packed": a.packed,
                   "fused_attention": use_fused_attention(a.attn, jax.numpy.dtype(a.dtype), cfg.head_dim)},
        "tokens_per_s": tps,
        "tflops": tps * fpt / 1e12,
        "mfu": tps * fpt / peak,
        "peak_flops_per_device": peak,
        "flops_per_token": fpt,
        "first_step_s": first_step_s[0] if first_step_s else None,
        "final_loss": final_loss,
        "memory": memory_stats(),
        "window_tokens_per_s": rates,
    }
    out = a.out or os.path.join(HERE, "results", f"gpu-{dt.date.today().isoformat()}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"{result['measured_on']}: {num_params / 1e6:.1f}M params, {tps:.0f} tokens/s, {result['tflops']:.1f} "
          f"TFLOP/s, MFU {100 * result['mfu']:.1f}%, first step {result['first_step_s']:.1f}s; wrote {out}")
    return result


if __name__ == "__main__":
    main()
