"""MLA / EG-MLA absorbed decoding kernels: every head in one pass over the cached latent."""
