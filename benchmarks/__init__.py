"""Benchmarks for pagedllm, each measured next to a baseline in the same run (see README.md)."""
