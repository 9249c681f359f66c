"""Attention kernels over the paged KV cache, each beside a pure-jnp reference."""

# The score of a masked attention position, in every kernel and reference (and nfjax's own attention code).
# Finite: exp(MASK_VALUE - m) underflows to exactly 0 beside any real score, a fully masked row stays NaN-free
# (uniform weights instead of inf - inf), and a running max that starts here never makes inf - inf either.
MASK_VALUE = -1e30
