"""The benchmarks: `python -m jhicache.bench` and the kernel benchmark, beside the engine."""
