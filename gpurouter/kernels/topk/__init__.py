"""gpurouter.kernels.topk: see gpurouter/kernels/README.md for the layout."""
