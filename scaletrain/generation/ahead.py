"""Compile a jitted program on a thread while the caller goes on with other work.

Why: the continuous engine's first call compiles its decode program (the largest: ~4 CPU-s for
SmolLM2-135M on a CPU) only after every first prompt was prefilled and inserted, so the compile
waited for them and they for it. XLA compiles without holding Python's GIL, so the decode
program can compile on a second core while the host prefills. The program is traced and lowered on the
caller's thread first: tracing is Python and holds the GIL, so a trace on the thread would only slow the
caller's own (the prefill's) while neither got a core to itself. ``jax.jit``'s own cache keeps the
result: the later ordinary call with arguments of the same shapes, dtypes and shardings finds the
executable and compiles nothing (``test_prompts_of_three_buckets_compile_one_prefill_one_insert_and_decode_once``).
"""

from __future__ import annotations

import contextlib
import contextvars
import gc
import threading
from collections.abc import Iterator
from typing import Any

import jax


class Ahead:
    """``program.lower(*args, **kwargs)`` here, then its ``.compile()`` on a daemon thread; :meth:`wait` joins it and
    raises what it raised. Arrays are passed as their shapes, dtypes and shardings only, so the caller may
    donate or delete them meanwhile. The current mesh (``jax.set_mesh``) and context variables (the model's
    placement) are the thread's too, so it compiles what the caller's own call will run."""

    def __init__(self, program: Any, *args: Any, **kwargs: Any):
        args = jax.tree.map(_abstract, args)
        mesh = jax.sharding.get_mesh()
        self._error: BaseException | None = None
        with paused_gc():
            lowered = program.lower(*args, **kwargs)  # tracing holds the GIL: done here, before the caller's own

        def work() -> None:
            try:
                with contextlib.nullcontext() if mesh.empty else jax.set_mesh(mesh):
                    lowered.compile()
            except BaseException as e:  # noqa: BLE001  (raised again in the caller's thread by wait())
                self._error = e

        self._thread = threading.Thread(target=contextvars.copy_context().run, args=(work,),
                                        name="scaletrain-compile-ahead", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Block until the compile is done; raise its error, if any, here."""
        self._thread.join()
        if self._error is not None:
            raise self._error


def _abstract(x: Any) -> Any:
    """An array's shape, dtype and, where it is committed to devices, sharding (an uncommitted one, e.g. a
    ``jnp.asarray`` scalar, goes where the program puts it, as it would in the call)."""
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding if x.committed else None)
    return x


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Python's cyclic garbage collector off inside (as it was after), for a first call's tracing.

    Why: tracing a program allocates hundreds of thousands of short-lived objects, and each full collection
    walks every object the process holds (~440k with a model, its tokenizer and transformers loaded), ~20 % of
    the decode program's trace for SmolLM2-135M. The objects are collected when it is back on."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
