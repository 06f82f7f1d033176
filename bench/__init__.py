"""Benchmarks that reproduce the performance figures of DESIGN.md; see bench/README.md."""
