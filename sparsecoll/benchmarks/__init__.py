"""Benchmarks behind ``python -m sparsecoll bench`` (problem generators, the main comparison)."""
