"""JAX integration: the public `attention`, the support query and the backends."""
