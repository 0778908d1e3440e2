"""Benchmarks that print ratios measured in one invocation: simulator delay overhead, 2BW vs 1F1B throughput."""
