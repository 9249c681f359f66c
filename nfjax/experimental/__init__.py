"""EXPERIMENTAL: mechanisms that were measured and lost, kept for the probes that measure them again.

Nothing in the engine imports this package; a benchmark opts in explicitly.
"""
