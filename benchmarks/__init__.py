"""The benchmark suite; run it with ``python -m benchmarks``."""
