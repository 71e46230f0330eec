"""gpurouter.kernels.losses: see gpurouter/kernels/README.md for the layout."""
