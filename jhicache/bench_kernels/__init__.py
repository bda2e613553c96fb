"""The kernel benchmark (`python -m jhicache.bench_kernels`), one module per kind of part."""
