"""Probe: zero-copy transport on the second GPU (issue #19). Run with SCEN=A|B."""
import ctypes, os, sys, threading, traceback
import jax, jax.numpy as jnp, numpy as np
from cuda.bindings import driver as drv
import gpurouter as gr
from gpurouter.kernels import _pointer
from gpurouter.presets import PRESETS

lib = _pointer._libcuda()
lib.cuCtxGetDevice.argtypes = [ctypes.POINTER(ctypes.c_int)]
def cur():
    c = ctypes.c_void_p(); lib.cuCtxGetCurrent(ctypes.byref(c))
    d = ctypes.c_int(-1)
    if c.value: lib.cuCtxGetDevice(ctypes.byref(d))
    return f"{(c.value or 0):#x}(dev{d.value})"
drv.cuInit(0)
prim = {}
for i in range(2):
    err, dev = drv.cuDeviceGet(i); err, ctx = drv.cuDevicePrimaryCtxRetain(dev); prim[i] = f"{int(ctx):#x}" if ctx is not None else str(err)
print("primary contexts (driver):", prim, "main cur", cur(), flush=True)
orig_init = _pointer.PointerLaunch.__init__
def init(self, plan, ordinal):
    print(f"PL.__init__ ordinal={ordinal} thread={threading.get_ident()} cur before={cur()}", flush=True)
    orig_init(self, plan, ordinal)
    print(f"  -> context={self.context:#x} cur after={cur()} handles={[hex(s[0]) for s in self.steps]}", flush=True)
_pointer.PointerLaunch.__init__ = init
orig_call = _pointer.PointerLaunch.__call__
def call(self, ptrs, stream):
    print(f"PL.__call__ ordinal={self.ordinal} ctx={self.context:#x} cur={cur()} stream={stream} thread={threading.get_ident()}", flush=True)
    try:
        return orig_call(self, ptrs, stream)
    finally:
        print(f"   after call cur={cur()}", flush=True)
_pointer.PointerLaunch.__call__ = call
orig_cs = _pointer.compile_steps
def cs(plan, ordinal, counters=None):
    print(f"compile_steps ordinal={ordinal} cur before={cur()} thread={threading.get_ident()}", flush=True)
    r = orig_cs(plan, ordinal, counters)
    print(f"  compile_steps done cur={cur()} handles={[hex(s.handle) for s in r]}", flush=True)
    return r
_pointer.compile_steps = cs

KW = PRESETS["deepseek-v3"].router_kwargs()
dev = jax.devices()[int(os.environ.get("DEV", "1"))]
x = jax.device_put(jax.random.normal(jax.random.PRNGKey(0), (64, 256)), dev)
def go(transport):
    f = jax.jit(lambda x: gr.fused_topk_with_score_function(x, **KW, backend="numba", transport=transport)[0])
    try:
        y = f(x); y.block_until_ready(); print(transport, "OK", float(jnp.sum(y)), y.devices(), flush=True)
    except Exception as e:
        print(transport, "FAILED", str(e)[-300:], flush=True)
    print("main cur now", cur(), flush=True)
for t in os.environ.get("SCEN", "zero-copy").split(","):
    go(t)
print("exit", flush=True)
