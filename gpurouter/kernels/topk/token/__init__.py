"""gpurouter.kernels.topk.token: see gpurouter/kernels/README.md for the layout."""
