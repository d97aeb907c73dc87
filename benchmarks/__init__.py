"""Benchmarks of hftatf: throughput harnesses, run as `python -m
benchmarks.<name>` (not tests)."""
