"""The benchmarks run end to end (tiny configs; speed is never asserted here)."""

import json
import math
import os
import subprocess
import sys

import pytest

from xla_testing import CHEAP_COMPILE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env():
    """The benchmarks' own devices (not the suite's 8 fake ones), compiled at XLA's cheap setting: each bench
    compares only programs of its own process tree, and speed is never asserted (tests/xla_testing.py)."""
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env["XLA_FLAGS"] = " ".join(dict.fromkeys([*flags, *CHEAP_COMPILE.split()]))  # the suite's own already has them
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


def test_gpu_benchmark_runs_both_systems_side_by_side_tiny_on_cpu(tmp_path):
    """bench/gpu.py --tiny: scaletrain and the HF + torch contender (eager in tiny), each case × system
    in its own process; the ratios are the quotients of the recorded tokens/s and both systems' MFU
    use one FLOPs-per-token and one peak."""
    out = tmp_path / "gpu.json"
    cmd = [sys.executable, os.path.join(ROOT, "bench", "gpu.py"), "--tiny", "--cases", "single,packed",
           "--steps", "2", "--window", "1", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["tiny"] is True and result["contender"] == "eager" and result["config"]["dtype"] == "bfloat16"
    assert list(result["cases"]) == ["single", "packed"]
    for name, case in result["cases"].items():
        st, hf = case["scaletrain"], case["hf"]
        for entry in (st, hf):
            assert entry["error"] is None, entry["error"]
            for key in ("tokens_per_s", "mfu", "tflops", "first_step_s", "host_peak_rss_gb", "final_loss"):
                assert math.isfinite(entry[key]) and entry[key] > 0, (name, key)
        assert st["num_params"] == hf["num_params"]  # one architecture, built by both from the same dict
        assert st["mfu"] / st["tokens_per_s"] == pytest.approx(hf["mfu"] / hf["tokens_per_s"], rel=1e-12)
        assert result["ratios"]["vs_hf_eager"][name] == pytest.approx(st["tokens_per_s"] / hf["tokens_per_s"],
                                                                      rel=1e-12)
        # random init (N(0, 0.02) tied embeddings, unit-RMS final norm, hidden 64): logits ~ N(0, 0.16²), so the
        # first loss is ln(512) + 0.16²/2 ≈ ln(512) + 0.013, and the mean over 62 targets of a per-token spread of
        # ~0.16 varies by ~0.02: 0.1 is over 4 of those from the expected value
        assert abs(hf["first_loss"] - math.log(512)) < 0.1
    packed = result["cases"]["packed"]
    assert packed["hf"]["info"]["packed_attention"] == "position_ids"  # transformers built the same-document mask
    assert result["ratios"]["packed_vs_single"] == pytest.approx(
        packed["scaletrain"]["tokens_per_s"] / result["cases"]["single"]["scaletrain"]["tokens_per_s"], rel=1e-12)
    assert "| packed | HF + torch (eager) |" in done.stdout


def test_variant_ab_compares_two_module_switches():
    cmd = [sys.executable, os.path.join(ROOT, "bench", "variant_ab.py"), "--tiny", "--rounds", "1", "--steps", "1",
           "attention.MAX_CAUSAL_BLOCKS = 1", "attention.MIN_CAUSAL_BLOCK = 8; attention.MAX_CAUSAL_BLOCKS = 4"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    values = dict(line.split() for line in done.stdout.splitlines() if line.strip())
    assert float(values["b_over_a_speed_wall"]) > 0 and float(values["A_cpu_s"]) > 0


def test_window_attention_times_mask_and_window_side_by_side(tmp_path):
    out = tmp_path / "window.json"
    cmd = [sys.executable, os.path.join(ROOT, "bench", "window_attention.py"), "--seq", "512", "--window", "64",
           "--batch", "1", "--heads", "2", "--kv-heads", "1", "--head-dim", "8", "--rounds", "1", "--steps", "1",
           "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["config"]["query_blocks"] > 1 and result["window_over_mask_speed_wall"] > 0
    assert result["max_rel_diff"] < 1e-5  # the same float32 terms in the same order: equal up to rounding


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
           "--layers", "1", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [r["batch_kind"] for r in result["runs"]] == ["packed", "tokens"]
    for r in result["runs"]:
        assert r["memory"]["temp_size_in_bytes"] > 0 and r["peak_bytes"] > r["memory"]["temp_size_in_bytes"]
        assert r["num_params"] > 0 and r["conditionals"] >= 1 and r["cudnn_attention"] == {}
        assert r["host_peak_rss_gb"] >= r["host_rss_before_compile_gb"] > 0  # the compiling process's VmHWM
    assert result["config"]["num_hidden_layers"] == 1  # --layers overrides the model's depth


def test_eval_bench_runs_both_models_side_by_side_tiny(tmp_path):
    """bench/eval.py --tiny: lm-eval's loglikelihood requests through ScaletrainLM and lm-eval's hf model."""
    out = tmp_path / "eval.json"
    cmd = [sys.executable, os.path.join(ROOT, "bench", "eval.py"), "--tiny", "--requests", "12", "--batch-size", "4",
           "--repeats", "1", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["max_rel_diff"] < 1e-4 and result["same_greedy"]
    assert result["scaletrain"]["requests_per_s"] > 0 and result["hf"]["requests_per_s"] > 0
    assert "| scaletrain |" in done.stdout


def test_preference_bench_runs_scaletrain_steps_and_trl_side_by_side_tiny(tmp_path):
    """bench/preference.py --tiny: an SFT and a DPO step (frozen reference) in scaletrain's process and TRL's
    DPOTrainer in its own, on the same pairs; the DPO state holds a reference as large as the weights."""
    out = tmp_path / "preference.json"
    cmd = [sys.executable, os.path.join(ROOT, "bench", "preference.py"), "--tiny", "--variants", "sft,dpo-frozen",
           "--trl", "frozen", "--rounds", "1", "--steps", "1", "--batch", "2", "--batches", "1", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["errors"] == {}
    ours, trl = record["scaletrain"], record["trl"]["frozen"]
    for name in ("sft", "dpo-frozen"):
        assert ours[name]["tokens_per_s"] > 0 and math.isfinite(ours[name]["loss"])
    assert ours["sft"]["reference_bytes"] == 0 and ours["dpo-frozen"]["reference_bytes"] == ours["sft"]["params_bytes"]
    assert trl["pairs_per_s"] > 0 and trl["reference_weight_bytes"] > 0
    assert record["ratios"]["dpo-frozen_vs_sft"] > 0 and record["ratios"]["dpo-frozen_vs_trl_frozen"] > 0


def test_gpu_benchmark_rollout_case_tiny_on_cpu(tmp_path):
    """bench/gpu.py --rollout (alone): bench/rollout.py in its own process, the engine and transformers'
    generate on the same random tiny model, every batch with both rates, the ratio and the first call."""
    out = tmp_path / "gpu.json"
    cmd = [sys.executable, os.path.join(ROOT, "bench", "gpu.py"), "--tiny", "--cases", "", "--rollout",
           "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rollout = json.loads(out.read_text())["rollout"]
    assert rollout["error"] is None, rollout["error"]
    assert [row["batch"] for row in rollout["rows"]] == [2, 4]
    for row in rollout["rows"]:
        assert row["first_call_s"] > 0 and row["scaletrain_tok_s"] > 0 and row["transformers_tok_s"] > 0
        assert row["ratio"] == pytest.approx(row["scaletrain_tok_s"] / row["transformers_tok_s"], rel=0.02)


def test_rollout_bench_runs_both_workloads_with_every_contender_tiny(tmp_path):
    """bench/rollout.py --tiny: the fixed-length and the long-tailed workload, scaletrain's engines (the
    continuous one skipped with a printed line where this tree lacks it) and transformers' generate and
    generate_batch in one process; rates, ratios, first call and cache against live bytes for each."""
    out = tmp_path / "rollout.json"
    cmd = [sys.executable, os.path.join(ROOT, "bench", "rollout.py"), "--tiny", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    present = ["static", "generate", "generate_batch"] + [n for n in ["continuous"] if n not in result["skipped"]]
    assert ("continuous: skipped" in done.stdout) == ("continuous" in result["skipped"])
    assert [row["workload"] for row in result["rows"]] == ["fixed", "long-tailed"]
    for row in result["rows"]:
        assert set(row["contenders"]) == set(present)
        for name, f in row["contenders"].items():
            assert f["tok_s"] > 0 and f["lengths"]["max"] <= row["cap"]
            assert f["cache_over_live"] >= 1.0 or (name == "continuous" and f["cache_over_live"] is None)
        st = row["contenders"]["static"]
        assert st["first_call_s"] > 0 and "compile_s" in st
        assert row["ratios"]["static_vs_generate"] == pytest.approx(
            st["tok_s"] / row["contenders"]["generate"]["tok_s"], rel=0.02)
    fixed, tail = result["rows"]
    assert all(f["lengths"]["min"] == fixed["cap"] for f in fixed["contenders"].values())  # no early stop
    assert tail["contenders"]["static"]["lengths"]["min"] < tail["cap"]  # rows stop early: lengths spread
