"""Benchmark and measurement scripts (`python -m eval.bench.<name>`): each prints or writes a
table for BENCHMARKS.md; none is a test."""
