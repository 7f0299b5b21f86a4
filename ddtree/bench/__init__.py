"""Benchmarks: offline latency/throughput, peers, and the prompt sets they use."""
