"""MFU's CPU peak: measured per CPU-second and scaled to the machine's physical cores.

The old peak was a wall-clock matmul rate: measured while other processes held the
cores (or while XLA ran that one device's matmul on a single thread) it came out
several times too low, and MFU above 100 % was logged. Only the formulas are tested
here; timings themselves never are.
"""

from __future__ import annotations

import pytest

from scaletrain.training.metrics import (
    cpu_peak_flops,
    measured_cpu_peak_flops,
    peak_flops_per_device,
    physical_cores,
    throughput,
)

FLOPS = 2.0 * 1024**3


def test_a_busy_machine_does_not_lower_the_peak():
    # idle: one matmul took 20 ms on one thread of a 2-core machine (20 ms of CPU time)
    idle = cpu_peak_flops(FLOPS, wall_s=0.020, cpu_s=0.020, cores=2)
    # loaded: another process held the cores, so the same work took 10x the wall time
    busy = cpu_peak_flops(FLOPS, wall_s=0.200, cpu_s=0.020, cores=2)
    assert idle == busy == pytest.approx(2 * FLOPS / 0.020, rel=1e-12)  # float rounding only
    # the old wall-clock peak was 10x lower, so the same training measured 10x the MFU
    assert FLOPS / 0.200 == pytest.approx(busy / 20)


def test_the_peak_counts_every_core_whatever_threads_xla_used():
    one_thread = cpu_peak_flops(FLOPS, wall_s=0.020, cpu_s=0.020, cores=4)
    four_threads = cpu_peak_flops(FLOPS, wall_s=0.005, cpu_s=0.020, cores=4)
    assert one_thread == four_threads
    # CPU time inflated by spinning threads: the wall-clock rate is the floor
    assert cpu_peak_flops(FLOPS, wall_s=0.005, cpu_s=0.100, cores=2) == FLOPS / 0.005


def _topology(root, cpu, package, core):
    topo = root / f"cpu{cpu}" / "topology"
    topo.mkdir(parents=True)
    (topo / "physical_package_id").write_text(f"{package}\n")
    (topo / "core_id").write_text(f"{core}\n")


def test_hyperthreads_are_not_extra_cores(tmp_path):
    for cpu, (package, core) in enumerate([(0, 0), (0, 1), (0, 0), (0, 1), (1, 0), (1, 0)]):
        _topology(tmp_path, cpu, package, core)
    assert physical_cores({0, 1, 2, 3, 4, 5}, str(tmp_path)) == 3
    assert physical_cores({0, 2}, str(tmp_path)) == 1  # two siblings of one core
    assert physical_cores({7, 8}, str(tmp_path)) == 2  # no topology: each CPU counts


def test_mfu_formula_and_the_cpu_peak_split_over_fake_devices():
    import jax

    # 8 fake CPU devices share the machine: per device 1/8 of it, so MFU counts it once
    assert peak_flops_per_device() * jax.local_device_count() == pytest.approx(measured_cpu_peak_flops())
    perf = throughput(tokens=1000, seconds=2.0, flops_per_token=6e6, peak_per_device=1e9, num_devices=4)
    assert perf == pytest.approx({"tokens_per_s": 500.0, "tflops": 3e-3, "mfu": 0.75}, rel=1e-12)  # rounding only
    assert peak_flops_per_device(123.0) == 123.0


def test_grpo_step_flops_equal_a_hand_count_on_a_tiny_model():
    """The FLOPs a GRPO step counts (scaletrain/rl/flops.py), against a count by hand of the tiny Llama's matmuls:
    hidden 32, mlp 64, 2 layers, 4 query heads and 2 key/value heads of 8, vocab 50, untied head. Two rows: prompts
    of 5 and 3 tokens, completions of 3 and 1. Full fine-tune and rank-2 LoRA on every linear layer (frozen base:
    forward and input gradient, no weight gradient; adapters: all three)."""
    from flax import nnx

    from preference_testing import one_device_mesh
    from scaletrain.models import LlamaConfig, LlamaForCausalLM, create_sharded_model
    from scaletrain.peft.lora import LoRAConfig, LoRAParam, apply_lora
    from scaletrain.rl.flops import StepFlops, TokenCost, adapter_parameters

    config = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         eos_token_id=1, pad_token_id=0, bos_token_id=None)
    layer = 32 * 32 + 32 * 16 + 32 * 16 + 32 * 32 + 3 * 32 * 64 + 2 * 32  # q, k, v, o, gate/up/down, two norms
    body, head, width = 2 * layer + 32, 50 * 32, 2 * 4 * 8  # + final norm; vocab x hidden; layers x query width
    adapters = 2 * 2 * ((32 + 32) + (32 + 16) + (32 + 16) + (32 + 32) + 3 * (32 + 64))  # layers x rank x (in + out)
    model = apply_lora(create_sharded_model(LlamaForCausalLM, config, seed=0, mesh=one_device_mesh())[0],
                       LoRAConfig(rank=2, alpha=4, target_modules="all-linear"))
    assert adapter_parameters(nnx.state(model, LoRAParam)) == adapters == 2048

    def attention(t):  # token i sees i keys: scores and weighted sum, 2 x 2 x keys x width
        return sum(4 * i * width for i in range(1, t + 1))

    p, c = [5, 3], [3, 1]
    # the rollout: one forward over prompt + completion - 1 tokens (the last token sampled is not fed), logits at c
    rollout = sum(2 * body * (a + b - 1) + attention(a + b - 1) + 2 * head * b for a, b in zip(p, c))
    forward = [2 * body * (a + b) + attention(a + b) + 2 * head * b for a, b in zip(p, c)]
    full = sum(3 * f for f in forward)  # forward; input gradients (as much again, attention twice); weight gradients
    lora_forward = [f + 2 * adapters * (a + b) for f, a, b in zip(forward, p, c)]
    lora = sum(2 * f + attention(a + b) + 2 * adapters * (a + b) for f, a, b in zip(lora_forward, p, c))
    full_cost, lora_cost = TokenCost.of(config, 0, lora=False), TokenCost.of(config, adapters, lora=True)
    assert (full_cost.body, full_cost.head, full_cost.attention) == (body, head, width)
    for cost, update, sampled in ((full_cost, full, rollout),
                                  (lora_cost, lora, rollout + sum(2 * adapters * (a + b - 1) for a, b in zip(p, c)))):
        flops = StepFlops(cost, peak_per_device=1e12, devices=2)
        figures, one_update, tokens = flops.rollout(p, c, 0.5, scored=False, reference=False)
        assert one_update == pytest.approx(update, rel=1e-12) and tokens == 12
        assert figures == pytest.approx({"rollout/tflops": sampled / 0.5 / 1e12,
                                         "rollout/mfu": sampled / 0.5 / 2e12}, rel=1e-12)
        assert flops.update(one_update, tokens, 0.25)["update/mfu"] == pytest.approx(update / 0.25 / 2e12, rel=1e-12)
        # the interval since the last log: the rollout and the update, over its wall time
        assert flops.interval(1.0) == pytest.approx({"tokens_per_s": 12.0, "tflops": (sampled + update) / 1e12,
                                                     "mfu": (sampled + update) / 2e12}, rel=1e-12)
    assert lora < full  # no weight gradient for the frozen base (here the rank-2 adapters are 11 % of it)
