"""XLA's typed FFI C ABI, as far as the ``"ffi"`` transport's handler reads it.

The handler (``ffi.py``) is a ``numba.cfunc``: XLA calls it with an
``XLA_FFI_CallFrame*`` and it reads that struct, the buffers, one attribute
and the API table by byte offset. The offsets are not written by hand: they
are computed here by ``ctypes`` from the struct declarations below, which
copy ``xla/ffi/api/c_api.h`` field for field (only the structs and fields the
handler touches, each struct up to the last field read). A CPU test
(tests/transport/test_ffi_abi.py) parses the ``c_api.h`` that the installed jaxlib ships
and checks every declaration against it.

ABI rules relied on (c_api.h's own versioning notes): fields are only ever
appended (a MINOR change); every struct starts with ``struct_size``; XLA
keeps old API versions working for at least 12 months. The handler therefore
declares the lowest API version whose fields it reads unconditionally
(``DECLARED_VERSION``), checks ``struct_size`` of the call frame and of the API
table before it reads a field, and reads ``XLA_FFI_DeviceOrdinal_Get``, a
later addition, only when the table is long enough to hold it.

The numba intrinsics at the end (raw loads and stores, stack scratch, calls
through a function pointer known only at run time) are what a cfunc needs to
use these structs without any Python at call time.
"""

from __future__ import annotations

import ctypes

# XLA FFI API version the handler declares in its metadata: XLA refuses a
# handler that declares a newer version than its own (jaxlib 0.9.1-0.11.0
# report 0.3, 0.11.1+ 0.4). Everything read unconditionally exists in 0.1.
DECLARED_VERSION = (0, 1)
#: the API major version these layouts belong to (a new major may move fields)
ABI_MAJOR = 0

# enum values (c_api.h)
EXTENSION_METADATA = 1  # XLA_FFI_Extension_Type
ARG_BUFFER = 1  # XLA_FFI_ArgType
ATTR_SCALAR = 3  # XLA_FFI_AttrType
DTYPE_S64 = 5  # XLA_FFI_DataType
ERROR_INVALID_ARGUMENT = 3  # XLA_FFI_Error_Code
ERROR_FAILED_PRECONDITION = 9
ERROR_INTERNAL = 13

_sz, _vp, _i32, _i64 = ctypes.c_size_t, ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64


# -- struct declarations, in c_api.h's order (checked by tests/transport/test_ffi_abi.py) --


class ExtensionBase(ctypes.Structure):  # XLA_FFI_Extension_Base
    _fields_ = [("struct_size", _sz), ("type", _i32), ("next", _vp)]


class ApiVersion(ctypes.Structure):  # XLA_FFI_Api_Version
    _fields_ = [("struct_size", _sz), ("extension_start", _vp), ("major_version", _i32),
                ("minor_version", _i32)]


class Args(ctypes.Structure):  # XLA_FFI_Args
    _fields_ = [("struct_size", _sz), ("extension_start", _vp), ("size", _i64), ("types", _vp),
                ("args", _vp)]


class Rets(ctypes.Structure):  # XLA_FFI_Rets
    _fields_ = [("struct_size", _sz), ("extension_start", _vp), ("size", _i64), ("types", _vp),
                ("rets", _vp)]


class Attrs(ctypes.Structure):  # XLA_FFI_Attrs
    _fields_ = [("struct_size", _sz), ("extension_start", _vp), ("size", _i64), ("types", _vp),
                ("names", _vp), ("attrs", _vp)]


class CallFrame(ctypes.Structure):  # XLA_FFI_CallFrame (up to attrs)
    _fields_ = [("struct_size", _sz), ("extension_start", _vp), ("api", _vp), ("ctx", _vp),
                ("stage", _i32), ("args", Args), ("rets", Rets), ("attrs", Attrs)]


class Buffer(ctypes.Structure):  # XLA_FFI_Buffer
    _fields_ = [("struct_size", _sz), ("extension_start", _vp), ("dtype", _i32), ("data", _vp),
                ("rank", _i64), ("dims", _vp)]


class ByteSpan(ctypes.Structure):  # XLA_FFI_ByteSpan
    _fields_ = [("ptr", _vp), ("len", _sz)]


class Scalar(ctypes.Structure):  # XLA_FFI_Scalar
    _fields_ = [("dtype", _i32), ("value", _vp)]


class Metadata(ctypes.Structure):  # XLA_FFI_Metadata (up to traits)
    _fields_ = [("struct_size", _sz), ("api_version", ApiVersion), ("traits", ctypes.c_uint32)]


class MetadataExtension(ctypes.Structure):  # XLA_FFI_Metadata_Extension
    _fields_ = [("extension_base", ExtensionBase), ("metadata", _vp)]


class ErrorCreateArgs(ctypes.Structure):  # XLA_FFI_Error_Create_Args
    _fields_ = [("struct_size", _sz), ("extension_start", _vp), ("message", _vp), ("errc", _i32)]


class StreamGetArgs(ctypes.Structure):  # XLA_FFI_Stream_Get_Args
    _fields_ = [("struct_size", _sz), ("extension_start", _vp), ("ctx", _vp), ("stream", _vp)]


class DeviceOrdinalGetArgs(ctypes.Structure):  # XLA_FFI_DeviceOrdinal_Get_Args
    _fields_ = [("struct_size", _sz), ("extension_start", _vp), ("ctx", _vp),
                ("device_ordinal", _i32)]


#: XLA_FFI_Api's function pointers in order (c_api.h; the handler calls three)
API_FUNCTIONS = (
    "XLA_FFI_Error_Create", "XLA_FFI_Error_GetMessage", "XLA_FFI_Error_Destroy",
    "XLA_FFI_Handler_Register", "XLA_FFI_Stream_Get", "XLA_FFI_Type_Register",
    "XLA_FFI_ExecutionContext_Get", "XLA_FFI_State_Set", "XLA_FFI_State_Get",
    "XLA_FFI_DeviceMemory_Allocate", "XLA_FFI_DeviceMemory_Free", "XLA_FFI_ThreadPool_Schedule",
    "XLA_FFI_ThreadPool_NumThreads", "XLA_FFI_Future_Create", "XLA_FFI_Future_SetAvailable",
    "XLA_FFI_Future_SetError", "XLA_FFI_RunId_Get", "XLA_FFI_DeviceOrdinal_Get",
)


class Api(ctypes.Structure):  # XLA_FFI_Api
    _fields_ = [("struct_size", _sz), ("extension_start", _vp), ("api_version", ApiVersion),
                ("internal_api", _vp)] + [(name, _vp) for name in API_FUNCTIONS]


#: every struct above by its C name, for the header test (a struct renamed
#: without a layout change, e.g. XLA_FFI_Extension_Base -> XLA_FFI_InternalExtension
#: in API 0.4, is listed under each name; a header needs one of them)
STRUCTS = {
    "XLA_FFI_Extension_Base": ExtensionBase, "XLA_FFI_InternalExtension": ExtensionBase,
    "XLA_FFI_Api_Version": ApiVersion,
    "XLA_FFI_Args": Args, "XLA_FFI_Rets": Rets, "XLA_FFI_Attrs": Attrs,
    "XLA_FFI_CallFrame": CallFrame, "XLA_FFI_Buffer": Buffer, "XLA_FFI_ByteSpan": ByteSpan,
    "XLA_FFI_Scalar": Scalar, "XLA_FFI_Metadata": Metadata,
    "XLA_FFI_Metadata_Extension": MetadataExtension, "XLA_FFI_Error_Create_Args": ErrorCreateArgs,
    "XLA_FFI_Stream_Get_Args": StreamGetArgs, "XLA_FFI_DeviceOrdinal_Get_Args": DeviceOrdinalGetArgs,
    "XLA_FFI_Api": Api,
}


def _at(struct, *path: str) -> int:
    """Byte offset of a (nested) field."""
    off, cls = 0, struct
    for name in path:
        field = getattr(cls, name)
        off += field.offset
        cls = dict(cls._fields_)[name]
    return off


# -- the offsets the handler reads (bytes) --
CF_STRUCT_SIZE = _at(CallFrame, "struct_size")
CF_EXTENSION = _at(CallFrame, "extension_start")
CF_API = _at(CallFrame, "api")
CF_CTX = _at(CallFrame, "ctx")
CF_ARGS_SIZE = _at(CallFrame, "args", "size")
CF_ARGS_TYPES = _at(CallFrame, "args", "types")
CF_ARGS_ARGS = _at(CallFrame, "args", "args")
CF_RETS_SIZE = _at(CallFrame, "rets", "size")
CF_RETS_TYPES = _at(CallFrame, "rets", "types")
CF_RETS_RETS = _at(CallFrame, "rets", "rets")
CF_ATTRS_SIZE = _at(CallFrame, "attrs", "size")
CF_ATTRS_TYPES = _at(CallFrame, "attrs", "types")
CF_ATTRS_NAMES = _at(CallFrame, "attrs", "names")
CF_ATTRS_ATTRS = _at(CallFrame, "attrs", "attrs")
#: the call frame must be at least this long for the fields above
CF_MIN_SIZE = ctypes.sizeof(CallFrame)

EXT_TYPE = _at(ExtensionBase, "type")
EXT_METADATA = _at(MetadataExtension, "metadata")
MD_STRUCT_SIZE = _at(Metadata, "struct_size")
MD_VERSION_STRUCT_SIZE = _at(Metadata, "api_version", "struct_size")
MD_VERSION_MAJOR = _at(Metadata, "api_version", "major_version")
MD_VERSION_MINOR = _at(Metadata, "api_version", "minor_version")
MD_TRAITS = _at(Metadata, "traits")
VERSION_SIZE = ctypes.sizeof(ApiVersion)

BUF_DATA = _at(Buffer, "data")
BUF_RANK = _at(Buffer, "rank")
BUF_DIMS = _at(Buffer, "dims")
SPAN_PTR = _at(ByteSpan, "ptr")
SPAN_LEN = _at(ByteSpan, "len")
SCALAR_DTYPE = _at(Scalar, "dtype")
SCALAR_VALUE = _at(Scalar, "value")

API_STRUCT_SIZE = _at(Api, "struct_size")
API_MAJOR = _at(Api, "api_version", "major_version")
API_ERROR_CREATE = _at(Api, "XLA_FFI_Error_Create")
API_STREAM_GET = _at(Api, "XLA_FFI_Stream_Get")
API_DEVICE_ORDINAL_GET = _at(Api, "XLA_FFI_DeviceOrdinal_Get")

# argument structs: their sizes (what struct_size says) and out-field offsets
ERR_SIZE = ErrorCreateArgs.errc.offset + ctypes.sizeof(_i32)  # XLA's STRUCT_SIZE: up to errc
ERR_MESSAGE = _at(ErrorCreateArgs, "message")
ERR_ERRC = _at(ErrorCreateArgs, "errc")
STREAM_SIZE = ctypes.sizeof(StreamGetArgs)
STREAM_CTX = _at(StreamGetArgs, "ctx")
STREAM_OUT = _at(StreamGetArgs, "stream")
ORDINAL_SIZE = DeviceOrdinalGetArgs.device_ordinal.offset + ctypes.sizeof(_i32)
ORDINAL_CTX = _at(DeviceOrdinalGetArgs, "ctx")
ORDINAL_OUT = _at(DeviceOrdinalGetArgs, "device_ordinal")
#: the two context queries' Args share their layout up to the out field
#: (ctx, then the out field at the same offsets; tests/transport/test_ffi_abi.py)
QUERY_CTX, QUERY_OUT = STREAM_CTX, STREAM_OUT


# ----------------------------------------------------------------------------
# numba intrinsics: raw memory and indirect calls inside a cfunc
# ----------------------------------------------------------------------------


def intrinsics():
    """``(load_u8, load_i32, load_i64, store_u8, store_i32, store_i64, scratch,
    caller)``: numba intrinsics (numba imported only here):

    - ``load_*(address)``, ``store_*(address, value)``: an 8/32/64-bit
      integer at an integer address;
    - ``scratch(words)`` (``words`` a literal int): the address of that many
      8-byte words of stack memory in the calling function's frame, private
      to the calling thread and valid until it returns;
    - ``caller(signature)`` -> an intrinsic ``f(address, (args...))`` that
      calls the C function at ``address`` (known only at run time) with
      ``signature`` ``(restype, argtype, ...)`` of "i32" and "i64" (pointers
      pass as i64: LP64).
    """
    import llvmlite.ir as ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    i64 = ir.IntType(64)

    def address_of(context, builder, val, ty, llty):
        return builder.inttoptr(context.cast(builder, val, ty, types.int64), llty.as_pointer())

    def loader(nbty):
        @intrinsic
        def load(typingctx, address):
            def codegen(context, builder, sig, args):
                llty = context.get_value_type(nbty)
                return builder.load(address_of(context, builder, args[0], sig.args[0], llty))

            return nbty(address), codegen

        return load

    def storer(nbty):
        @intrinsic
        def store(typingctx, address, value):
            def codegen(context, builder, sig, args):
                llty = context.get_value_type(nbty)
                val = context.cast(builder, args[1], sig.args[1], nbty)
                builder.store(val, address_of(context, builder, args[0], sig.args[0], llty))
                return context.get_dummy_value()

            return types.none(address, value), codegen

        return store

    @intrinsic
    def scratch(typingctx, words):
        if not isinstance(words, types.IntegerLiteral):
            return None
        n = words.literal_value

        def codegen(context, builder, sig, args):
            return builder.ptrtoint(cgutils.alloca_once(builder, ir.ArrayType(i64, n)), i64)

        return types.int64(words), codegen

    kinds = {"i32": types.int32, "i64": types.int64}

    def caller(signature):
        restype, *argtypes = signature

        @intrinsic
        def call(typingctx, address, arg_tuple):
            if not isinstance(arg_tuple, types.BaseTuple) or len(arg_tuple) != len(argtypes):
                return None

            def codegen(context, builder, sig, args):
                fnty = ir.FunctionType(context.get_value_type(kinds[restype]),
                                       [context.get_value_type(kinds[a]) for a in argtypes])
                fn = address_of(context, builder, args[0], sig.args[0], fnty)
                vals = [context.cast(builder, builder.extract_value(args[1], i), sig.args[1][i], kinds[a])
                        for i, a in enumerate(argtypes)]
                return builder.call(fn, vals)

            return kinds[restype](address, arg_tuple), codegen

        return call

    loads = [loader(t) for t in (types.uint8, types.int32, types.int64)]
    stores = [storer(t) for t in (types.uint8, types.int32, types.int64)]
    return (*loads, *stores, scratch, caller)


# ----------------------------------------------------------------------------
# The declarations above against a c_api.h (the installed jaxlib's, at run
# time, before the transport is first used; and in the CPU test)
# ----------------------------------------------------------------------------


def header_path():
    """The ``xla/ffi/api/c_api.h`` the installed jaxlib ships, or None."""
    import pathlib

    import jaxlib

    path = pathlib.Path(jaxlib.__file__).parent / "include" / "xla" / "ffi" / "api" / "c_api.h"
    return path if path.is_file() else None


def parse_header(text: str) -> tuple[dict[str, list[tuple[str, str]]], set[str], tuple[int, int]]:
    """``(structs, int_types, version)`` of a c_api.h: each struct's fields as
    ``(type, name)`` in order, the names of its 32-bit enum and integer
    typedefs, and ``(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR)``."""
    import re

    text = re.sub(r"//[^\n]*|/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r"^\s*#(?!define\s+XLA_FFI_API_M).*$", "", text, flags=re.M)  # other preprocessor lines
    ints = set(re.findall(r"typedef\s+enum\s*\{[^}]*\}\s*(\w+)\s*;", text))
    ints |= set(re.findall(r"typedef\s+u?int32_t\s+(\w+)\s*;", text))
    structs = {}
    for name, body in re.findall(r"struct\s+(\w+)\s*\{(.*?)\}", text, flags=re.S):
        fields = []
        for stmt in body.split(";"):
            stmt = " ".join(stmt.split())
            macro = re.fullmatch(r"_XLA_FFI_API_STRUCT_FIELD\((\w+)\)", stmt)
            if macro:
                fields.append(("*", macro.group(1)))
            elif stmt:
                m = re.fullmatch(r"(.*?)\s*(\w+)", stmt)
                fields.append((m.group(1), m.group(2)) if m else (stmt, ""))  # (not a plain field)
        structs[name] = fields
    major = int(re.search(r"#define\s+XLA_FFI_API_MAJOR\s+(\d+)", text).group(1))
    minor = int(re.search(r"#define\s+XLA_FFI_API_MINOR\s+(\d+)", text).group(1))
    return structs, ints, (major, minor)


#: XLA_FFI_Api's functions the handler calls: only their names must match
#: (renaming the others changes no byte the handler reads: a MINOR change)
CALLED = ("XLA_FFI_Error_Create", "XLA_FFI_Stream_Get", "XLA_FFI_DeviceOrdinal_Get")


def _kinds(ctype) -> set[str]:
    if isinstance(ctype, type) and issubclass(ctype, ctypes.Structure):
        return {n for n, s in STRUCTS.items() if s is ctype}
    return { {ctypes.c_size_t: "size_t", ctypes.c_void_p: "pointer", ctypes.c_int64: "int64",
            ctypes.c_int32: "int32", ctypes.c_uint32: "int32"}[ctype]}


def _header_kind(ctype: str, ints: set[str]) -> str:
    ctype = ctype.replace("const ", "").strip()
    if "*" in ctype:
        return "pointer"
    if ctype in ("int", "int32_t", "uint32_t") or ctype in ints:
        return "int32"
    return {"size_t": "size_t", "int64_t": "int64"}.get(ctype, ctype)


def header_mismatches(text: str) -> list[str]:
    """Every difference between the declarations here and the header ``text``:
    a struct or field missing, renamed, moved or of another kind, or another
    API major version. Empty when the handler may read this runtime."""
    structs, ints, (major, _) = parse_header(text)
    bad = [] if major == ABI_MAJOR else [f"XLA_FFI_API_MAJOR is {major}, gpurouter reads {ABI_MAJOR}"]
    for struct in dict.fromkeys(STRUCTS.values()):
        names = sorted(_kinds(struct))
        cname = next((n for n in names if n in structs), None)
        if cname is None:
            bad.append(f"struct {' or '.join(names)} not in the header")
            continue
        fields = structs[cname]
        for i, (name, ctype) in enumerate(struct._fields_):
            if i >= len(fields):
                bad.append(f"{cname}.{name}: the header's struct ends before field {i}")
                break
            htype, hname = fields[i]
            want, got = _kinds(ctype), _header_kind(htype, ints)
            renamed = hname != name and not (struct is Api and name in API_FUNCTIONS and name not in CALLED)
            if renamed or got not in want:
                bad.append(f"{cname} field {i}: gpurouter reads {name} ({' or '.join(sorted(want))}), "
                           f"the header has {hname} ({htype})")
    return bad
