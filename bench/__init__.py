"""Benchmarks: engine micro-benchmarks (scripts) and the HTTP load generator (`python -m bench.loadgen`)."""
