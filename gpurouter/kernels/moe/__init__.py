"""gpurouter.kernels.moe: see gpurouter/kernels/README.md for the layout."""
