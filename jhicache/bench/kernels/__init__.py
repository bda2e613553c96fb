"""The kernel benchmark (`python -m jhicache.bench.kernels`), one module per kind of part."""
