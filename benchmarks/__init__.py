"""Benchmarks: stripped copies of the hot paths, run as ``python -m benchmarks.<name>``."""
