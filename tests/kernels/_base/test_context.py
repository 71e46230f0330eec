"""``gpurouter.kernels._base.context`` against a fake CUDA driver (a context stack per
thread, two GPUs): ``on_gpu`` gives the caller its context back whatever the
block did to the stack (numba-cuda did that on 2 x H200, issue #19),
``function_of`` refuses to resolve a kernel in another GPU's context, and a
zero-copy call's GPU is its stream's. No GPU needed: the real driver's side
runs in tests/sharding/test_multi_gpu.py."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import types

import pytest

from gpurouter.kernels._base import context as _context

PRIMARY = {0: 0x1000, 1: 0x2000}  # GPU -> its primary context
DEVICE_OF = {v: k for k, v in PRIMARY.items()}


class FakeDriver:
    """The driver calls ``_context`` makes, on one thread's context stack."""

    def __init__(self, streams=None):
        self.stack: list[int] = []
        self.streams = streams or {}  # stream handle -> context
        self.calls: list[str] = []

    @staticmethod
    def _out(ref, value):
        ref._obj.value = value

    @staticmethod
    def _handle(ctx):  # ctypes passes a c_void_p or an int as the same void*
        return ctx.value if isinstance(ctx, ctypes.c_void_p) else ctx

    def cuInit(self, flags):
        return 0

    def cuDeviceGet(self, dev, ordinal):
        self._out(dev, ordinal)
        return 0 if ordinal in PRIMARY else 101  # CUDA_ERROR_INVALID_DEVICE

    def cuDevicePrimaryCtxRetain(self, ctx, dev):
        self._out(ctx, PRIMARY[dev.value])
        return 0

    def cuCtxGetCurrent(self, ctx):
        self._out(ctx, self.stack[-1] if self.stack else None)
        return 0

    def cuCtxSetCurrent(self, ctx):  # replaces the top; None pops it
        if self.stack:
            self.stack.pop()
        if self._handle(ctx) is not None:
            self.stack.append(self._handle(ctx))
        return 0

    def cuCtxPushCurrent_v2(self, ctx):
        self.stack.append(self._handle(ctx))
        return 0

    def cuCtxPopCurrent_v2(self, ctx):
        if not self.stack:
            return 201  # CUDA_ERROR_INVALID_CONTEXT
        self._out(ctx, self.stack.pop())
        return 0

    def cuCtxGetDevice(self, dev):
        if not self.stack:
            return 201
        self._out(dev, DEVICE_OF[self.stack[-1]])
        return 0

    def cuStreamGetCtx(self, stream, ctx):
        self.calls.append("cuStreamGetCtx")
        self._out(ctx, self.streams[stream.value])
        return 0

    def cuKernelGetFunction(self, fn, kernel):
        self._out(fn, kernel.value + self.stack[-1])  # a function per (kernel, context)
        return 0


@pytest.fixture
def driver(monkeypatch):
    fake = FakeDriver(streams={0xA0: PRIMARY[0], 0xB1: PRIMARY[1]})
    monkeypatch.setattr(_context, "libcuda", lambda: fake)
    monkeypatch.setattr(_context, "_PRIMARY", {})
    monkeypatch.setattr(_context, "_STREAM_ORDINAL", {})
    monkeypatch.setattr(_context, "_register_exit_hook", lambda: fake.calls.append("exit hook"))
    return fake


@pytest.mark.parametrize("caller", [None, 0, 1])
@pytest.mark.parametrize("gpu", [0, 1])
def test_on_gpu_makes_the_gpu_current_then_gives_the_caller_its_context_back(driver, caller, gpu):
    driver.stack = [] if caller is None else [0xF00, PRIMARY[caller]]
    before = list(driver.stack)
    with _context.on_gpu(gpu):
        assert _context.current_context() == PRIMARY[gpu]
    assert driver.stack == before


@pytest.mark.parametrize("block", ["replaces the top", "pops everything", "pushes and leaves it"])
def test_on_gpu_repairs_what_the_block_did_to_the_stack(driver, block):
    driver.stack = [PRIMARY[1]]  # XLA's thread for GPU 1
    with _context.on_gpu(0):
        if block == "replaces the top":
            driver.cuCtxSetCurrent(PRIMARY[1])
        elif block == "pops everything":
            driver.stack.clear()
        else:
            driver.cuCtxPushCurrent_v2(PRIMARY[1])
    assert _context.current_context() == PRIMARY[1]


def test_on_gpu_gives_the_context_back_when_the_block_raises(driver):
    driver.stack = [PRIMARY[1]]
    with pytest.raises(KeyError), _context.on_gpu(0):
        raise KeyError("compile failed")
    assert driver.stack == [PRIMARY[1]]


def test_an_unknown_gpu_is_an_error_naming_it(driver):
    with pytest.raises(RuntimeError, match=r"cuDeviceGet\(5\) failed with CUresult 101"):
        _context.primary_context(5)


def test_function_of_resolves_in_the_gpus_context_and_refuses_another(driver):
    with _context.on_gpu(1):
        assert _context.function_of(0x7, 1) == 0x7 + PRIMARY[1]
    driver.stack = [PRIMARY[0]]
    with pytest.raises(RuntimeError, match="GPU 1's context is not current"):
        _context.function_of(0x7, 1)


def test_stream_ordinal_is_the_streams_gpu_cached_and_restores_the_stack(driver):
    driver.stack = [PRIMARY[0]]
    assert _context.stream_ordinal(0xB1) == 1
    assert _context.stream_ordinal(0xA0) == 0
    assert _context.stream_ordinal(0xB1) == 1
    assert driver.calls.count("cuStreamGetCtx") == 2  # once a stream
    assert driver.stack == [PRIMARY[0]]


@pytest.mark.parametrize("current", [0, 1])
def test_default_streams_are_the_current_contexts_gpu(driver, current):
    driver.stack = [PRIMARY[current]]
    for stream in (0, 1, 2):
        assert _context.stream_ordinal(stream) == current
    assert "cuStreamGetCtx" not in driver.calls


def test_zero_copy_takes_the_gpu_of_its_stream(driver, monkeypatch):
    from gpurouter._transport import buffer

    monkeypatch.setattr(buffer, "_GPU_COUNT", [2])
    driver.stack = [PRIMARY[1]]
    assert buffer._ordinal(0xA0) == 0
    assert buffer._ordinal(0xB1) == 1
    monkeypatch.setattr(buffer, "_GPU_COUNT", [1])
    assert buffer._ordinal(0xB1) == 0  # one GPU: no driver call


def test_the_exit_hook_is_registered_once_with_the_first_primary_context(driver):
    assert "exit hook" not in driver.calls
    _context.primary_context(1)
    _context.primary_context(0)
    _context.primary_context(1)
    assert driver.calls.count("exit hook") == 1


class FakePending:
    """numba's ``_PendingDeallocs``: a generator-based ``disable()``, frees on ``clear()``."""

    def __init__(self):
        self._disable_count, self.freed, self.queued = 0, [], []

    @contextlib.contextmanager
    def disable(self):
        self._disable_count += 1
        try:
            yield
        finally:
            self._disable_count -= 1

    def add_item(self, handle):
        self.queued.append(handle)
        if not self._disable_count:
            self.freed += self.queued
            self.queued = []


class FakeGpu:
    def __init__(self, made: bool):
        ctx = types.SimpleNamespace(deallocations=FakePending(),
                                    memory_manager=types.SimpleNamespace(deallocations=FakePending()))
        self.primary_context = ctx if made else None


def test_frees_held_at_exit_stay_held_after_a_collection(monkeypatch):
    """Each context's module unloads and memory frees queue and are not run, also
    once the garbage collector has run (an entered ``disable()`` generator that
    is collected leaves its block: the first version of this hook did nothing)."""
    monkeypatch.setattr(_context, "_HELD", [])
    gpus = [FakeGpu(True), FakeGpu(False), FakeGpu(True)]
    _context.hold_numba_frees_at_exit(gpus)
    _context.hold_numba_frees_at_exit(gpus)  # twice: held once
    gc.collect()
    for gpu in (gpus[0], gpus[2]):
        for pending in (gpu.primary_context.deallocations, gpu.primary_context.memory_manager.deallocations):
            pending.add_item("library 0x1")
            assert pending.freed == [] and pending.queued == ["library 0x1"]
            assert pending._disable_count == 1
    assert len(_context._HELD) == 4
