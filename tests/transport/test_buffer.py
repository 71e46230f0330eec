"""The zero-copy plumbing that needs no GPU: pointer arithmetic over vmap batch
dims and the launches a callback issues (the launches themselves are faked;
on a GPU every public test runs them for real)."""

from __future__ import annotations

import numpy as np
import pytest

from gpurouter._transport import buffer as cb

pytest.importorskip("numba")
L = pytest.importorskip("gpurouter.kernels._base.launch")
_plan = pytest.importorskip("gpurouter.kernels._base.plan")


def _ptr_of(a: np.ndarray) -> cb._Ptr:
    return cb._Ptr(a.ctypes.data, a.shape, a.dtype)


@pytest.mark.parametrize("idx", [(), (1,), (1, 2), (0, 3, 1)])
def test_ptr_indexing_matches_numpy_byte_offsets(idx):
    a = np.zeros((2, 4, 3, 5), np.float32)
    got = _ptr_of(a)[idx]
    want = a[idx]
    assert got.ptr == want.ctypes.data and got.shape == want.shape


class _FakePlan:
    steps = ("launch",)
    tmps = ()

    def __init__(self, *specs):
        self.specs = specs


def _recording(monkeypatch):
    calls = []
    monkeypatch.setattr(cb, "_ordinal", lambda ptr: 0)
    monkeypatch.setattr(cb, "_pointer_launch",
                        lambda plan, ordinal: lambda ptrs, stream: calls.append((plan.specs, ptrs, stream)))
    return calls


def test_unbatched_call_is_one_launch_on_the_buffers(monkeypatch):
    calls = _recording(monkeypatch)
    x, b = np.zeros((6, 8), np.uint16), np.zeros((8,), np.float32)
    outs = [np.zeros((6, 8), np.float32), np.zeros((6, 8), np.bool_)]
    cb._run_plans(_FakePlan, 1, 2, [_ptr_of(x), _ptr_of(b)], [_ptr_of(o) for o in outs], 7)
    (specs, ptrs, stream), = calls
    assert stream == 7
    assert specs == (_plan.spec_for((6, 8), np.uint16), _plan.spec_for((8,), np.float32))
    assert specs[0].kind == L.BF16
    assert ptrs == [x.ctypes.data, b.ctypes.data] + [o.ctypes.data for o in outs]


def test_vmap_batch_folds_into_tokens(monkeypatch):
    calls = _recording(monkeypatch)
    x = np.zeros((2, 3, 5, 8), np.float32)  # batch (2, 3) of [T=5, E=8]
    b = np.zeros((1, 1, 8), np.float32)  # unbatched bias, expand_dims style
    out = np.zeros((2, 3, 5, 8), np.float32)
    cb._run_plans(_FakePlan, 1, 1, [_ptr_of(x), _ptr_of(b)], [_ptr_of(out)], 0)
    (specs, ptrs, _), = calls
    assert specs == (_plan.spec_for((30, 8), np.float32), _plan.spec_for((8,), np.float32))
    assert ptrs == [x.ctypes.data, b.ctypes.data, out.ctypes.data]


def test_batched_bias_launches_once_per_element_at_the_right_offsets(monkeypatch):
    calls = _recording(monkeypatch)
    x = np.zeros((2, 3, 5, 8), np.float32)
    b = np.zeros((2, 1, 8), np.float32)  # batched along the first batch dim only
    out = np.zeros((2, 3, 5, 8), np.float32)
    cb._run_plans(_FakePlan, 1, 1, [_ptr_of(x), _ptr_of(b)], [_ptr_of(out)], 0)
    assert len(calls) == 6
    for (specs, ptrs, _), (i, j) in zip(calls, np.ndindex(2, 3), strict=True):
        assert specs == (_plan.spec_for((5, 8), np.float32), _plan.spec_for((8,), np.float32))
        assert ptrs == [x[i, j].ctypes.data, b[i, 0].ctypes.data, out[i, j].ctypes.data]


def test_scratch_outputs_follow_the_op_outputs(monkeypatch):
    calls = _recording(monkeypatch)
    p, t = np.zeros((4, 8), np.float32), np.zeros((8,), np.int32)
    loss, coeff, tmp = np.zeros((), np.float32), np.zeros((), np.float32), np.zeros((3, 8), np.float32)
    cb._run_plans(_FakePlan, 0, 2, [_ptr_of(p), _ptr_of(t)], [_ptr_of(a) for a in (loss, coeff, tmp)], 0)
    (specs, ptrs, _), = calls
    assert specs[1].kind == L.INT and specs[1].dtype == np.int32
    assert ptrs[2:] == [loss.ctypes.data, coeff.ctypes.data, tmp.ctypes.data]


def test_nothing_launches_when_every_array_is_empty(monkeypatch):
    calls = _recording(monkeypatch)
    cb._run_plans(_FakePlan, 1, 1, [cb._Ptr(0, (0, 8), np.float32)], [cb._Ptr(0, (0, 8), np.float32)], 0)
    assert calls == []


class _Buf:
    """A host array posing as an XLA buffer (what a zero-copy callback receives)."""

    def __init__(self, a: np.ndarray):
        self.a = a
        typestr = "<V2" if a.dtype == np.uint16 else a.dtype.str  # JAX's bf16 typestr
        ptr = a.ctypes.data if a.size else 0  # XLA's empty buffers have no address
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": a.shape,
                                         "typestr": typestr, "version": 3}


def test_device_call_caches_the_launch_and_takes_new_pointers(monkeypatch):
    calls = _recording(monkeypatch)
    made = []

    class Planner(_FakePlan):
        def __init__(self, *specs):
            made.append(specs)
            super().__init__(*specs)

    monkeypatch.setattr(cb, "_DIRECT", {})
    for _ in range(3):  # new buffers each call, same shapes: one plan, three launches
        x, b = np.zeros((2, 6, 8), np.uint16), np.zeros((1, 8), np.float32)  # a folding vmap batch
        out = np.zeros((2, 6, 8), np.float32)
        cb._device_call(Planner, 1, 1, [_Buf(x), _Buf(b)], [_Buf(out)], 5)
        assert calls[-1][1:] == ([x.ctypes.data, b.ctypes.data, out.ctypes.data], 5)
    assert made == [(_plan.spec_for((12, 8), np.uint16), _plan.spec_for((8,), np.float32))]
    assert made[0][0].kind == L.BF16 and len(calls) == 3


def test_device_call_batched_bias_takes_the_per_element_launches(monkeypatch):
    calls = _recording(monkeypatch)
    monkeypatch.setattr(cb, "_DIRECT", {})
    x, b = np.zeros((2, 5, 8), np.float32), np.zeros((2, 8), np.float32)
    out = np.zeros((2, 5, 8), np.float32)
    for _ in range(2):
        cb._device_call(_FakePlan, 1, 1, [_Buf(x), _Buf(b)], [_Buf(out)], 0)
    assert [c[1] for c in calls] == [[x[i].ctypes.data, b[i].ctypes.data, out[i].ctypes.data]
                                     for i in range(2)] * 2


def test_device_call_with_empty_arrays_launches_nothing(monkeypatch):
    calls = _recording(monkeypatch)
    monkeypatch.setattr(cb, "_DIRECT", {})
    e = np.zeros((0, 8), np.float32)
    cb._device_call(_FakePlan, 1, 1, [_Buf(e)], [_Buf(e)], 0)
    assert calls == []


def test_plans_of_a_bitmap_backward_and_a_replay_take_their_int_inputs(monkeypatch):
    """The zero-copy callback describes XLA's buffers by spec_for: a BITMAP_U8
    map (uint8) and forced indices (int32) must pass (the bitmap backward once
    failed here on the GPU: 'spec_for: array must be ... got uint8')."""
    calls = _recording(monkeypatch)
    bits, saved, grad = (np.zeros((6, 2), np.uint8), np.zeros((6, 12), np.float32),
                         np.zeros((6, 12), np.uint16))
    out = np.zeros((6, 12), np.uint16)
    cb._run_plans(_FakePlan, 3, 1, [_ptr_of(bits), _ptr_of(saved), _ptr_of(grad)], [_ptr_of(out)], 0)
    (specs, _, _), = calls
    assert specs[0] == _plan.Spec((6, 2), np.uint8, None)
    forced = np.zeros((6, 3), np.int32)
    assert _plan.spec_for(forced.shape, forced.dtype).dtype == np.int32
