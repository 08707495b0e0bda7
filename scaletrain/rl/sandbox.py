"""A built-in tool that runs Python code in a subprocess with limits: ``python_sandbox`` (or :func:`make_sandbox`).

Why a subprocess: a tool runs the model's code, which may loop, allocate without bound, print without end or
touch files. A child process can be bounded by the kernel where a thread cannot: CPU seconds
(``RLIMIT_CPU``), address space (``RLIMIT_AS``), the size of files it writes (``RLIMIT_FSIZE``), a wall-clock
timeout that kills it, its output cut to a length, a fresh temporary working directory removed after, an
isolated interpreter (``python -I``: no user site, no ``PYTHON*`` variables, the script's folder not on the
path) and an empty environment. Where the kernel lets an unprivileged user make a network namespace
(``unshare --net --map-root-user``), the code runs in one with no interface but loopback: no network.

What it does NOT isolate: the file system (the code can read every file the training user can, and write
outside its directory where permissions allow), other processes of the user (signals), the number of
processes it starts, and, where user namespaces are refused, the network. It is a guard against accidents and
runaway code in rewards, not a security boundary against hostile code: run untrusted code in a container.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable


@functools.lru_cache(maxsize=1)
def _netns_prefix() -> tuple[str, ...]:
    """``unshare``'s prefix for a process without network where this kernel allows it, else ``()``."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    prefix = (unshare, "--net", "--map-root-user")
    try:
        ok = subprocess.run([*prefix, sys.executable, "-c", "pass"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return prefix if ok else ()


def run_python(code: str, *, cpu_seconds: int = 5, memory_mb: int = 512, output_chars: int = 4000,
               wall_seconds: float = 10.0, file_mb: int = 16) -> str:
    """Run ``code`` under the limits (module docstring); its stdout and stderr, cut to ``output_chars``, and a
    last line naming how it ended when it did not end well."""
    # the limits are set by the child itself before it runs the code: no ``preexec_fn``, whose fork is unsafe in
    # a process running JAX's threads (the spawn subprocess uses instead is not)
    boot = ("import resource, sys\n"
            f"for kind, value in ((resource.RLIMIT_CPU, {int(cpu_seconds)}),"
            f" (resource.RLIMIT_AS, {int(memory_mb) << 20}), (resource.RLIMIT_FSIZE, {int(file_mb) << 20})):\n"
            "    resource.setrlimit(kind, (value, value))\n"
            "code = sys.stdin.read()\n"
            "del resource, sys, kind, value\n"
            "exec(compile(code, '<sandbox>', 'exec'), {'__name__': '__main__'})\n")
    with tempfile.TemporaryDirectory(prefix="scaletrain-sandbox-") as folder:
        command = [*_netns_prefix(), sys.executable, "-I", "-c", boot]
        try:
            done = subprocess.run(command, input=code, cwd=folder, env={"PATH": "/usr/bin:/bin", "HOME": folder},
                                  capture_output=True, timeout=wall_seconds, text=True, errors="replace")
        except subprocess.TimeoutExpired as err:
            out = ((err.stdout or "") if isinstance(err.stdout, str) else "")[:output_chars]
            return out + f"\n[killed: no result within {wall_seconds:g} s]"
    out = (done.stdout + done.stderr)[:output_chars]
    if done.returncode < 0:
        return out + f"\n[killed by signal {-done.returncode}: a CPU ({cpu_seconds} s) or memory limit]"
    if done.returncode:
        return out + f"\n[exit status {done.returncode}]"
    return out


def make_sandbox(**limits: float) -> Callable[[str], str]:
    """A ``python_sandbox`` tool with other limits (the keywords of :func:`run_python`)."""

    def python_sandbox(code: str) -> str:
        """Run Python code and return what it prints.

        Args:
            code: A complete Python program; print what you want to see.
        """
        return run_python(code, **limits)  # type: ignore[arg-type]

    return python_sandbox


python_sandbox = make_sandbox()
