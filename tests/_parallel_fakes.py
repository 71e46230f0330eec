"""Module-level fakes for tests/test_parallel_compile.py: the spawn workers
import them by name (a factory with a recipe, compile steps that work, raise
or crash)."""

import functools
import hashlib
import os

from gpurouter.kernels._base.keys import kernel_text
from gpurouter.kernels._base.parallel import recipe


class FakeDispatcher:
    """What the key reads of a numba dispatcher: ``py_func``, ``targetoptions``."""

    def __init__(self, py_func, **options):
        self.py_func = py_func
        self.targetoptions = {"opt": True, **options}


@recipe
@functools.cache
def factory(n, flag=True):
    def kernel(out, x):
        out[0] = x + n if flag else x

    return FakeDispatcher(kernel)


@functools.cache
def no_recipe(n):
    def kernel(out, x):
        out[0] = x * n

    return FakeDispatcher(kernel)


def cubin_of(kernel) -> bytes:
    """The fake cubin of a kernel: a digest of its own text (equal in every process)."""
    return hashlib.sha256(kernel_text(kernel).encode()).digest()


def compile_ok(kernel, argtypes, ordinal):
    return 1, f"entry_{os.getpid()}", cubin_of(kernel)


def compile_raises(kernel, argtypes, ordinal):
    raise RuntimeError("nvvm said no")


def compile_crashes(kernel, argtypes, ordinal):
    os._exit(3)


def compile_slow(kernel, argtypes, ordinal):
    """compile_ok after a pause: the parent's lookup meets the kernel still in flight."""
    import time

    time.sleep(1.5)
    return compile_ok(kernel, argtypes, ordinal)
