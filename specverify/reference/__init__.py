"""Plain-torch references: the definition of correct for every kernel. CPU-runnable; kernels never import them."""
