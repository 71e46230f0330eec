"""The ``"ffi"`` transport without a GPU: its ABI against the installed jaxlib's
c_api.h, its launch records, and its handler run by XLA:CPU up to the point
where it asks for a CUDA stream (every check before the launch runs)."""

from __future__ import annotations

import re
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpurouter._transport import ffi, ffi_abi, ffi_cache, ffi_record

numba = pytest.importorskip("numba")


def _header() -> str:
    path = ffi_abi.header_path()
    if path is None:
        pytest.skip("this jaxlib ships no include/xla/ffi/api/c_api.h")
    return path.read_text()


def test_every_declared_struct_matches_the_installed_header():
    """Each field the handler reads: same name, order and kind as c_api.h."""
    assert ffi_abi.header_mismatches(_header()) == []
    assert ffi.unavailable_reason() is None


def test_the_offsets_are_the_c_layout_of_the_header():
    """Spot checks of the LP64 layout (the ctypes rules are the C compiler's)."""
    assert (ffi_abi.CF_API, ffi_abi.CF_CTX, ffi_abi.CF_ARGS_SIZE, ffi_abi.CF_RETS_RETS,
            ffi_abi.CF_ATTRS_ATTRS, ffi_abi.CF_MIN_SIZE) == (16, 24, 56, 112, 160, 168)
    assert (ffi_abi.BUF_DATA, ffi_abi.BUF_RANK, ffi_abi.BUF_DIMS) == (24, 32, 40)
    assert (ffi_abi.API_ERROR_CREATE, ffi_abi.API_STREAM_GET, ffi_abi.API_DEVICE_ORDINAL_GET) == (48, 80, 184)
    assert (ffi_abi.STREAM_CTX, ffi_abi.STREAM_OUT) == (ffi_abi.ORDINAL_CTX, ffi_abi.ORDINAL_OUT) == (
        ffi_abi.QUERY_CTX, ffi_abi.QUERY_OUT)  # one Args layout for both context queries
    _, _, version = ffi_abi.parse_header(_header())
    assert version[0] == ffi_abi.ABI_MAJOR and version >= ffi_abi.DECLARED_VERSION


@pytest.mark.parametrize("pattern, repl, what", [
    (r"(\n\s*void\* data;)(\n\s*int64_t rank;)", r"\2\1", "XLA_FFI_Buffer field 3"),
    (r"(\n\s*\w+\* ctx;)(\n\s*XLA_FFI_ExecutionStage stage;)", r"\2\1", "XLA_FFI_CallFrame field 3"),
    (r"#define XLA_FFI_API_MAJOR 0", "#define XLA_FFI_API_MAJOR 1", "XLA_FFI_API_MAJOR is 1"),
    (r"_XLA_FFI_API_STRUCT_FIELD\(XLA_FFI_Stream_Get\);", "", "XLA_FFI_Api field 8"),
    (r"(\n\s*)const char\* message;", r"\1int32_t message;", "XLA_FFI_Error_Create_Args field 2"),
])
def test_a_moved_field_or_a_new_major_version_is_found(pattern, repl, what):
    text = _header()
    edited = re.sub(pattern, repl, text, count=1)
    assert edited != text
    bad = ffi_abi.header_mismatches(edited)
    assert any(what in b for b in bad), bad


def test_renamed_structs_and_uncalled_functions_are_no_mismatch():
    """API 0.4 renamed XLA_FFI_Extension_Base and some functions the handler
    never calls, with the same layout: still the ABI the handler reads."""
    text = _header()
    text = re.sub(r"\bXLA_FFI_Extension_Base\b", "XLA_FFI_InternalExtension", text)
    text = text.replace("XLA_FFI_Error_GetMessage", "XLA_FFI_Error_GetDetails")
    assert ffi_abi.header_mismatches(text) == []
    bad = ffi_abi.header_mismatches(text.replace("(XLA_FFI_Stream_Get)", "(XLA_FFI_Stream_Fetch)"))
    assert any("XLA_FFI_Api field 8: gpurouter reads XLA_FFI_Stream_Get" in b for b in bad), bad


def test_an_unknown_abi_falls_back_to_zero_copy_with_one_warning(monkeypatch):
    monkeypatch.setattr(ffi, "unavailable_reason", lambda: "its XLA FFI ABI differs (test).")
    monkeypatch.setattr(ffi, "_WARNED", [])
    with pytest.warns(RuntimeWarning, match='transport "ffi" is off: its XLA FFI ABI differs'):
        assert not ffi.available()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not ffi.available()  # once


class _Step:
    """What ``kernels._pointer.compile_steps`` gives, for a record test."""

    def __init__(self, handle, params, holes, name="k"):
        self.handle, self.grid, self.block, self.shared = handle, 3, 64, 128
        self.params, self.holes, self.name = params, holes, name


def _plan():
    from gpurouter.kernels._base.plan import Plan, Spec

    return Plan("test_op", [Spec((4, 8), np.float32)], [Spec((4, 8), np.float32)],
                [Spec((2,), np.float32)], [])


def test_a_record_lays_out_every_device_and_step():
    params = np.arange(12, dtype=np.int64).tobytes()
    steps = {0: [_Step(11, params, [(4, 0), (10, 1)])], 2: [_Step(22, params, [(4, 2)])] * 2}
    rec, _ = ffi_record.build_record(_plan(), [0, 2], steps, {0: 100, 2: 200}, (1, 2, 3, 4))
    assert rec[0] == ffi_record.MAGIC and (rec[1], rec[2]) == (1, 2) and list(rec[3:7]) == [1, 2, 3, 4]
    assert list(rec[ffi_record.COUNTS:ffi_record.COUNTS + 3]) == [32, 32, 2]
    assert rec[ffi_record.DEVICES + 1] == 0  # no kernels for GPU 1
    dev0, dev2 = rec[ffi_record.DEVICES], rec[ffi_record.DEVICES + 2]
    assert list(rec[dev0:dev0 + 8]) == [100, 1, 11, 3, 64, 128, 12, 2]
    assert list(rec[dev0 + 8:dev0 + 20]) == list(range(12)) and list(rec[dev0 + 20:dev0 + 24]) == [4, 0, 10, 1]
    assert list(rec[dev2:dev2 + 2]) == [200, 2]
    assert rec[dev2 + 2] == 22 and rec[dev2 + 2 + 6 + 12 + 2] == 22  # the second step follows the first


def test_limits_of_a_record_are_errors_naming_the_op():
    big = np.zeros(ffi_record.MAX_PARAMS + 1, np.int64).tobytes()
    with pytest.raises(NotImplementedError, match="test_op: kernel k takes 257 parameter words"):
        ffi_record.build_record(_plan(), [0], {0: [_Step(1, big, [])]}, {0: 0}, (0, 0, 0, 0))
    with pytest.raises(NotImplementedError, match="test_op: CUDA device 64"):
        ffi_record.build_record(_plan(), [64], {64: []}, {64: 0}, (0, 0, 0, 0))


@pytest.fixture(scope="module", params=["compiled", "seed"])
def cpu_target(request, tmp_path_factory):
    """The handler registered for XLA:CPU under a test name: the process's
    (compiled or from the cache), and the one LLVM makes of its seed (numba's
    bitcode for a generic CPU, written by a fresh process: ``ffi_cache.make_seed``)."""
    if "cpu" not in {d.platform for d in jax.devices()}:
        pytest.skip("needs XLA:CPU")
    if request.param == "compiled":
        address = ffi._handler().address
    else:
        folder = tmp_path_factory.mktemp("seeds")
        path = ffi_cache.make_seed(folder)
        assert path.parent == folder and ffi_cache.unpack_seed(path.read_bytes()) is not None
        seeded = ffi_cache._from_seed(ffi_cache._codegen(), folder)
        assert seeded is not None, "the handler's seed did not load"
        request.node.library = seeded[0]  # its code lives as long as the library
        address = seeded[2]
    name = f"gpurouter_plan_cpu_test_{request.param}"
    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(address), platform="cpu")
    return name


def _run(target, x, **attrs):
    outs = (jax.ShapeDtypeStruct((4, 8), jnp.float32), jax.ShapeDtypeStruct((2,), jnp.float32))
    with jax.default_device(jax.devices("cpu")[0]):
        fn = jax.jit(lambda a: jax.ffi.ffi_call(target, outs)(a, **attrs))
        return jax.block_until_ready(fn(jnp.asarray(x)))


def test_the_handler_checks_everything_before_the_stream(cpu_target):
    """XLA:CPU answers the stream query with its own error: reaching it means the
    metadata, call frame, attribute, record and buffer checks all passed."""
    params = np.zeros(12, np.int64).tobytes()
    rec, _ = ffi_record.build_record(_plan(), [0], {0: [_Step(0, params, [(4, 0)])]}, {0: 0}, (0, 0, 0, 0))
    x = np.ones((4, 8), np.float32)
    with pytest.raises(Exception, match="GPU context is not available"):
        _run(cpu_target, x, plan=np.int64(rec.ctypes.data))
    with pytest.raises(Exception, match=re.escape(
            "gpurouter ffi (test_op): an array's size differs from the traced call's ((4, 8), (4, 8), (2,))")):
        _run(cpu_target, np.ones((3, 8), np.float32), plan=np.int64(rec.ctypes.data))
    for attrs in (dict(other=np.int64(rec.ctypes.data)), dict(plan=np.int64(0))):
        with pytest.raises(Exception, match="gpurouter ffi: the call has no int64 'plan' attribute"):
            _run(cpu_target, x, **attrs)
    # and the handler still works after its errors, with the process number beside the plan (ignored)
    with pytest.raises(Exception, match="GPU context is not available"):
        _run(cpu_target, x, plan=np.int64(rec.ctypes.data), process=ffi.PROCESS_SALT)


def test_the_process_number_differs_between_processes():
    """What keeps a persistent compile cache from reusing a program (and its
    ``plan`` address) in another process: ffi.PROCESS_SALT is drawn per process."""
    code = "from gpurouter._transport import ffi; print(int(ffi.PROCESS_SALT))"
    numbers = [int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                  timeout=120).stdout.split()[-1]) for _ in range(2)]
    assert numbers[0] != numbers[1] and min(numbers) >= 0


def test_the_handler_refuses_a_call_with_other_arguments(cpu_target):
    rec, _ = ffi_record.build_record(_plan(), [0], {0: []}, {0: 0}, (0, 0, 0, 0))
    outs = (jax.ShapeDtypeStruct((4, 8), jnp.float32),)  # the plan has a scratch result too
    with jax.default_device(jax.devices("cpu")[0]), pytest.raises(Exception, match=re.escape(
            "gpurouter ffi (test_op): XLA passed other arguments than the traced call (1 inputs, 2 results")):
        jax.block_until_ready(jax.jit(lambda a: jax.ffi.ffi_call(cpu_target, outs)(
            a, plan=np.int64(rec.ctypes.data)))(jnp.ones((4, 8))))
