"""The kernel benchmark (`python -m benchmarks.kernels`), one module per kind of part."""
