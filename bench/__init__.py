"""The benchmark suite. Run its scripts as modules from the repository root, e.g. `python -m bench.offline --help`.

offline, serving, tp, latency: the engine end to end (bench/setup.py builds every engine from the product's
flags); nanoflow, profile_step: compiled steps on synthetic batches; kernels/: the Pallas kernels alone;
peers/: other engines run beside ours; probes/: one-off experiments. Results go to bench/results, and
bench/NOTES.md is the log of what they found.
"""
