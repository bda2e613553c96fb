"""The bench that drives the public API (`python -m jhicache.bench`): its clients, in process
and over HTTP, the multi-turn workload, and the report. The benches that time the engine's parts
live in the repository's benchmarks/ folder, not installed."""
