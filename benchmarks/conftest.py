"""Benchmarks: run with `python -m pytest benchmarks/ --benchmark-only` (not part of the test suite)."""
