"""Kernel benches: the Pallas kernels alone on the device (python -m bench.kernels.gemm, .attention, .decode_share)."""
