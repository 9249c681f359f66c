"""Attention kernels over the paged KV cache, each beside a pure-jnp reference."""
