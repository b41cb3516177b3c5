"""Simulators and case builders shared by the tests, the demo and the benchmarks (not used when serving)."""
