"""Benchmarks that print JSON; `make bench` runs them side by side."""
