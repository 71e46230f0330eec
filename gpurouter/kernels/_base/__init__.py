"""gpurouter.kernels._base: see gpurouter/kernels/README.md for the layout."""
