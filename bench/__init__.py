"""Benchmarks of meld against its peers; `harness` holds the one timer all of them share (BENCH.md)."""
