"""The benchmarks run end to end (tiny configs; speed is never asserted here)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env():
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f)
    env["PYTHONPATH"] = ROOT
    env["JAX_PLATFORMS"] = "cpu"
    return env


def test_run_writes_ratios_for_the_in_process_contenders(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, os.path.join(ROOT, "bench", "run.py"), "--tiny", "--steps", "3", "--window", "1",
           "--repeats", "1", "--only", "scaletrain,bare_jax", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(out.read_text())
    assert {"vs_bare_jax", "vs_easydel", "vs_hf_compile"} <= set(record["ratios"])
    assert record["ratios"]["vs_bare_jax"] > 0
    assert record["ratios"]["vs_easydel"] is None and "not selected" in record["ratio_notes"]["vs_easydel"]
    for name in ("scaletrain", "bare_jax"):
        c = record["contenders"][name]
        assert c["tokens_per_s"] > 0 and c["first_step_s"] > 0 and c["peak_rss_mb"] > 0 and c["mfu"] > 0
    assert "| scaletrain |" in done.stdout


def test_gpu_benchmark_runs_tiny_on_cpu(tmp_path):
    out = tmp_path / "gpu.json"
    cmd = [sys.executable, os.path.join(ROOT, "bench", "gpu.py"), "--tiny", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["tiny"] is True and result["config"]["dtype"] == "bfloat16"
    for key in ("tokens_per_s", "tflops", "mfu", "first_step_s"):
        assert result[key] > 0, key


def test_variant_ab_compares_two_module_switches():
    cmd = [sys.executable, os.path.join(ROOT, "bench", "variant_ab.py"), "--tiny", "--rounds", "1", "--steps", "1",
           "attention.MAX_CAUSAL_BLOCKS = 1", "attention.MIN_CAUSAL_BLOCK = 8; attention.MAX_CAUSAL_BLOCKS = 4"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    values = dict(line.split() for line in done.stdout.splitlines() if line.strip())
    assert float(values["b_over_a_speed_wall"]) > 0 and float(values["A_cpu_s"]) > 0


def test_host_memory_compares_hugepage_tunable_in_two_processes():
    cmd = [sys.executable, os.path.join(ROOT, "bench", "host_memory.py"), "--tiny", "--rounds", "1", "--steps", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert any("huge-page tunable off" in x for x in lines) and any("huge-page tunable on" in x for x in lines)
    assert "tuned / untuned" in lines[-1]


def test_aot_compiles_both_batch_kinds_for_this_cpu(tmp_path):
    """The ahead-of-time compile report runs (here for the CPU: CI has no CUDA plugin): packed
    batches and token-only batches both compile, and the CPU step keeps its guard conditional."""
    out = tmp_path / "aot.json"
    cmd = [sys.executable, os.path.join(ROOT, "bench", "aot.py"), "--tiny", "--cpu", "--dtype", "float32",
           "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [r["batch_kind"] for r in result["runs"]] == ["packed", "tokens"]
    for r in result["runs"]:
        assert r["memory"]["temp_size_in_bytes"] > 0 and r["peak_bytes"] > r["memory"]["temp_size_in_bytes"]
        assert r["num_params"] > 0 and r["conditionals"] >= 1 and r["cudnn_attention"] == {}
