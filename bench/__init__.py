"""Benchmarks (pytest-benchmark) and the fixed workloads they run."""
