"""The built-in Python sandbox tool: output comes back; a loop, a huge allocation and a flood of output are bounded."""

from __future__ import annotations

from scaletrain.rl.sandbox import make_sandbox, python_sandbox


def test_sandbox_returns_output_and_bounds_cpu_memory_output_and_runs_in_a_fresh_folder():
    assert python_sandbox("print(6 * 7)").strip() == "42"
    assert "[exit status 1]" in python_sandbox("raise SystemExit(1)")
    tight = make_sandbox(cpu_seconds=1, memory_mb=256, output_chars=100, wall_seconds=20)
    assert "[killed by signal" in tight("while True: pass")
    big = make_sandbox(memory_mb=256)("x = bytearray(1 << 30)")
    assert "MemoryError" in big or "[killed" in big
    assert len(tight("print('y' * 10000)")) <= 100
    listed = python_sandbox("import os; print(os.listdir('.'), os.getcwd())")
    assert listed.startswith("[]") and "scaletrain-sandbox-" in listed


def test_sandbox_has_no_network_where_the_kernel_allows_a_network_namespace():
    import pytest

    from scaletrain.rl.sandbox import _netns_prefix

    if not _netns_prefix():
        pytest.skip("this kernel refuses unprivileged network namespaces: the sandbox has the network (documented)")
    code = ("import socket\ntry:\n socket.create_connection(('1.1.1.1', 80), timeout=2); print('net')\n"
            "except OSError:\n print('none')")
    assert python_sandbox(code).strip() == "none"
