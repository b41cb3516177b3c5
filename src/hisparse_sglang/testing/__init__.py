"""Simulators, case builders and the top-k workload model (``workload.py``) shared by the tests, the
demo and the benchmarks (not used when serving)."""
