"""Benchmarks: what the picker hop costs, and (later) routing quality on real traces."""
