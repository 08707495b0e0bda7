"""Huge pages for XLA's per-step scratch buffer on CPU (Linux, glibc >= 2.35).

XLA's CPU runtime allocates each execution's temporary buffer with ``malloc`` and
frees it when the step ends (471 MB for the benchmark's 8M-parameter step). glibc
serves an allocation that large with a fresh ``mmap`` and returns it with
``munmap``, so *every step* the kernel faults in and zeroes ~120k 4 KiB pages: 0.35
CPU-s of system time in a 1.9 CPU-s step (``bench/host_memory.py``). glibc's
``glibc.malloc.hugetlb=1`` tunable makes it ask for transparent huge pages on such
mappings (``madvise(MADV_HUGEPAGE)``), which turns those faults into ~700 2 MiB ones:
system time falls to ~0.07 s per step, and memory is still returned to the OS when
freed, so peak RSS does not change.

(Keeping the freed buffer in the heap instead — one arena, no ``mmap`` — removes
the faults altogether but holds one extra scratch buffer per step in flight: peak
RSS went from 1.1 to 2.0 GB in the Trainer benchmark. Not done.)

glibc reads tunables only when a process starts, so :func:`reexec_with_hugepages`
starts the current command again with ``GLIBC_TUNABLES`` set; the ``scaletrain``
CLI calls it first thing, Ray workers get the variable in their environment, and a
training script can call it on its first line (or be started with
:func:`hugepage_env`'s variable). ``SCALETRAIN_HUGEPAGES=0`` switches it off.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

TUNABLE = "glibc.malloc.hugetlb=1"
_THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def hugepages_supported() -> bool:
    """Linux with glibc >= 2.35 and transparent huge pages available to ``madvise``."""
    if not sys.platform.startswith("linux") or os.environ.get("SCALETRAIN_HUGEPAGES", "1") == "0":
        return False
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()  # e.g. "glibc 2.36"
        major, minor = (int(x) for x in version.split(".")[:2])
        with open(_THP) as f:
            mode = f.read()
    except (ValueError, OSError, AttributeError):
        return False
    return name == "glibc" and (major, minor) >= (2, 35) and ("[madvise]" in mode or "[always]" in mode)


def hugepage_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``environ`` (default: this process's) with :data:`TUNABLE` added to ``GLIBC_TUNABLES``."""
    env = dict(os.environ if environ is None else environ)
    current = env.get("GLIBC_TUNABLES", "")
    if TUNABLE not in current.split(":"):
        env["GLIBC_TUNABLES"] = f"{current}:{TUNABLE}" if current else TUNABLE
    return env


def hugepages_enabled() -> bool:
    """Whether this process was started with the tunable."""
    return TUNABLE in os.environ.get("GLIBC_TUNABLES", "").split(":")


def reexec_with_hugepages() -> None:
    """Start this command again with the tunable set, unless it is set, unsupported or switched off.

    Call it before anything else happens: the process is replaced. Returns normally
    when nothing needs doing (and after the restart, where the tunable is set).
    """
    if hugepages_enabled() or not hugepages_supported():
        return
    argv = [sys.executable, *sys.orig_argv[1:]]  # the interpreter's own options included
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, argv, hugepage_env())
