"""Benchmarks: accuracy against the paper's baselines, and throughput and cost of the service."""
