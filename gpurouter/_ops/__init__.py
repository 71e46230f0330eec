"""Bindings: the only place where the reference and the numba kernels meet."""
