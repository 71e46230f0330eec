"""gpurouter.kernels.topk.lane: see gpurouter/kernels/README.md for the layout."""
