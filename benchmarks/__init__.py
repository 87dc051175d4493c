"""Reproducible memory and speed evidence: ``python -m benchmarks [NAME ...] [--quick]``."""
