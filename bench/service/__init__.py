"""Benches of the served model: load over gRPC and HTTP, latency, memory, noisy neighbours, swaps, replicas."""
