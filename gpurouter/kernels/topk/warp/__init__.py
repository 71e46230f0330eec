"""gpurouter.kernels.topk.warp: see gpurouter/kernels/README.md for the layout."""
