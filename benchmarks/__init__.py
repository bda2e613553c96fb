"""Benchmarks and probes beside the library (not installed): `python -m benchmarks.<name>` from
the repository root, reaching the engine through its public API."""
