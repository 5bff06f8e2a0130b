"""Device kernels for the attention backends (Triton); imported only by the backend that uses them."""
